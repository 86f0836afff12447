#!/usr/bin/env bash
# Scale-out with the real binaries: three servers on 127.0.0.1 and one
# attention_loadtest over all three (--target given three times).
#   A. All up: round robin spreads the calls evenly (each server's count of OK
#      Attend calls within 10% of the mean).
#   B. One server killed (-9) a third of the way into a run: the run goes on
#      with the other two and ends on time, the errors are UNAVAILABLE only,
#      few, and reported by code, and the survivors take the calls after the kill.
#   C. dns:///localhost:PORT targets work (gRPC's resolver, round_robin).
#
# Usage: scale_out_test.sh SERVER_BIN CLI_BIN LOADTEST_BIN
set -euo pipefail

if [[ $# -ne 3 ]]; then
  echo "usage: $0 SERVER_BIN CLI_BIN LOADTEST_BIN" >&2
  exit 2
fi
server_bin=$1
cli_bin=$2
loadtest_bin=$3
command -v jq >/dev/null || { echo "scale_out_test: needs jq (deploy/install-deps.sh)" >&2; exit 1; }

source "$(dirname "${BASH_SOURCE[0]}")/../deploy/server_control.sh"

tmp=$(mktemp -d)
pids=() ports=() metrics_ports=() logs=()
loadtest_pid=""
cleanup() {
  [[ -n $loadtest_pid ]] && kill -KILL "$loadtest_pid" 2>/dev/null
  for pid in "${pids[@]}"; do
    SERVER_PID=$pid
    server_kill
  done
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() {
  echo "FAIL: scale_out_test: $*" >&2
  for log in "${logs[@]}"; do
    sed "s|^|  $(basename "$(dirname "$log")"): |" "$log" >&2
  done
  exit 1
}

# OK Attend calls of the demo model that server $1 (0, 1, 2) has answered.
ok_calls() {
  metric "${metrics_ports[$1]}" 'attention_requests_total{method="Attend",model="demo",code="OK"}'
}

for i in 0 1 2; do
  mkdir "$tmp/server$i"
  server_start "$server_bin" "$tmp/server$i" --metrics_port 0
  server_wait_serving "$cli_bin"
  pids+=("$SERVER_PID") ports+=("$SERVER_PORT") logs+=("$SERVER_LOG")
  metrics_ports+=("$(server_metrics_port)")
done
targets=(--target "127.0.0.1:${ports[0]}" --target "127.0.0.1:${ports[1]}"
         --target "127.0.0.1:${ports[2]}")

# --- A. even spread -----------------------------------------------------------
"$loadtest_bin" "${targets[@]}" --model demo --concurrency 6 --duration 4s --timeout 5s \
  --json "$tmp/spread.json" --progress=false >"$tmp/spread.out" 2>&1 ||
  fail "the load tester failed: $(cat "$tmp/spread.out")"
[[ $(jq '.error_count' "$tmp/spread.json") -eq 0 ]] ||
  fail "spread: errors with every server up: $(jq -c .errors "$tmp/spread.json")"
counts=("$(ok_calls 0)" "$(ok_calls 1)" "$(ok_calls 2)")
total=$(( counts[0] + counts[1] + counts[2] ))
(( total > 0 )) || fail "spread: the servers counted no OK call"
for i in 0 1 2; do
  # |count - mean| <= 10% of mean, in integers: |3 count - total| * 10 <= total.
  diff=$(( 3 * counts[i] - total ))
  (( (diff < 0 ? -diff : diff) * 10 <= total )) ||
    fail "spread: server $i answered ${counts[i]} of $total calls, not within 10% of a third"
done
echo "spread over 3 servers: ${counts[*]} OK calls (within 10% of the mean)"

# --- B. one server killed mid-run ---------------------------------------------
"$loadtest_bin" "${targets[@]}" --model demo --concurrency 6 --duration 6s --timeout 5s \
  --json "$tmp/kill.json" --progress=false >"$tmp/kill.out" 2>&1 &
loadtest_pid=$!
sleep 2
before_kill=("$(ok_calls 0)" "$(ok_calls 1)")
kill -KILL "${pids[2]}"
wait "${pids[2]}" 2>/dev/null || true
status=0
# 6 s of load plus the drain: 30 s is a hang.
wait_bounded "$loadtest_pid" 30 || status=$?
loadtest_pid=""
[[ $status -eq 0 ]] || fail "the load tester exited $status: $(cat "$tmp/kill.out")"
bad=$(unexpected_errors "$tmp/kill.json" '["UNAVAILABLE"]')
[[ -z $bad ]] || fail "kill -9: errors other than UNAVAILABLE: $bad"
requests=$(jq '.requests' "$tmp/kill.json")
errors=$(jq '.error_count' "$tmp/kill.json")
# Only the calls the dead server had in flight (about 6 / 3), and those sent
# to it before its channel saw the connection go, should fail; 0.5% leaves
# room for a slow machine (over 10 000 calls a run here).
(( errors * 200 <= requests )) ||
  fail "kill -9: $errors of $requests calls failed, more than 0.5%: $(jq -c .errors "$tmp/kill.json")"
after_kill=()
for i in 0 1; do
  after_kill+=($(( $(ok_calls "$i") - before_kill[i] )))
  (( after_kill[i] > 0 )) || fail "kill -9: server $i took no call after the kill"
done
# The dead server's share went to both survivors alike: within 10% of their mean.
diff=$(( after_kill[0] - after_kill[1] ))
(( (diff < 0 ? -diff : diff) * 20 <= after_kill[0] + after_kill[1] )) ||
  fail "kill -9: the survivors took ${after_kill[*]} calls after the kill, not within 10% of each other's mean"
# The last second of the run: every call went to the survivors and succeeded.
last=$(jq -c '[.timeline[] | select(.completed > 0)] | last' "$tmp/kill.json")
[[ $(jq '.errors' <<<"$last") -eq 0 && $(jq '.completed' <<<"$last") -gt 0 ]] ||
  fail "kill -9: the last second was not all OK: $last"
echo "kill -9 of 1 of 3 mid-run: $errors of $requests calls failed ($(jq -c .errors "$tmp/kill.json")), survivors took ${after_kill[*]} calls after the kill, no hang"

# --- C. dns:/// targets ---------------------------------------------------------
before=("$(ok_calls 0)" "$(ok_calls 1)")
"$loadtest_bin" --target "dns:///localhost:${ports[0]}" --target "dns:///localhost:${ports[1]}" \
  --model demo --concurrency 2 --duration 1s --timeout 5s --json "$tmp/dns.json" \
  --progress=false >"$tmp/dns.out" 2>&1 || fail "dns:///localhost: $(cat "$tmp/dns.out")"
[[ $(jq '.error_count' "$tmp/dns.json") -eq 0 ]] ||
  fail "dns:///localhost: errors: $(jq -c .errors "$tmp/dns.json")"
for i in 0 1; do
  (( $(ok_calls "$i") > before[i] )) || fail "dns:///localhost: server $i took no call"
done
echo "dns:///localhost targets: $(jq .ok "$tmp/dns.json") calls OK on both servers"

for i in 0 1; do
  SERVER_PID=${pids[i]} SERVER_LOG=${logs[i]}
  status=0
  server_stop || status=$?
  [[ $status -eq 0 ]] || fail "server $i exited with $status after SIGTERM"
done
echo "scale_out_test: PASS"
