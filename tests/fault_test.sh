#!/usr/bin/env bash
# Faults under load, with the real binaries on 127.0.0.1:
#   1. kill -9 of the server mid-run, then a restart on the same port 1.5 s
#      later: the load tester gets UNAVAILABLE while it is down (nothing else),
#      does not hang, and its channels reconnect within the client's reconnect
#      backoff (at most 2 s): the last second of the run has no error.
#   2. SIGTERM mid-run: the server drains and exits 0, and no call it accepted
#      is lost: each is answered OK (or UNAVAILABLE when refused), as the
#      server's per-call debug log shows. Calls gRPC cancels at shutdown before
#      they reach the service come back CANCELLED; they are counted apart.
#   3. Deadlines that expire while requests are queued: the server drops that
#      work (attention_not_computed_total{reason="deadline_exceeded"} grows) and
#      computes fewer requests than it was sent.
#
# Usage: fault_test.sh SERVER_BIN CLI_BIN LOADTEST_BIN
set -euo pipefail

if [[ $# -ne 3 ]]; then
  echo "usage: $0 SERVER_BIN CLI_BIN LOADTEST_BIN" >&2
  exit 2
fi
server_bin=$1
cli_bin=$2
loadtest_bin=$3
command -v jq >/dev/null || { echo "fault_test: needs jq (deploy/install-deps.sh)" >&2; exit 1; }

source "$(dirname "${BASH_SOURCE[0]}")/../deploy/server_control.sh"

tmp=$(mktemp -d)
loadtest_pid=""
cleanup() {
  [[ -n $loadtest_pid ]] && kill -KILL "$loadtest_pid" 2>/dev/null
  server_kill
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { server_fail "fault_test: $*"; }

# --- 1. kill -9 under load, restart on the same port -------------------------
server_start "$server_bin" "$tmp"
server_wait_serving "$cli_bin"
port=$SERVER_PORT
# 14 s: the restart (1.5 s after the kill, plus the server's start, which
# under ASan on a loaded machine takes a second or two) and the channels'
# reconnect (up to 2 s) are over before the run's last second with seconds
# to spare.
"$loadtest_bin" --target "127.0.0.1:$port" --model demo --concurrency 4 --duration 14s \
  --timeout 2s --json "$tmp/kill.json" --progress=false >"$tmp/kill.out" 2>&1 &
loadtest_pid=$!
sleep 2
kill -KILL "$SERVER_PID"
wait "$SERVER_PID" 2>/dev/null || true
SERVER_PID=""
sleep 1.5
# The same port: --listen given twice, the last one wins.
server_start "$server_bin" "$tmp" --listen "127.0.0.1:$port"
server_wait_serving "$cli_bin"
status=0
wait_bounded "$loadtest_pid" 60 || status=$?
loadtest_pid=""
[[ $status -eq 0 ]] || fail "the load tester exited $status: $(cat "$tmp/kill.out")"
bad=$(unexpected_errors "$tmp/kill.json" '["UNAVAILABLE"]')
[[ -z $bad ]] || fail "kill -9: errors other than UNAVAILABLE: $bad"
down=$(jq '.errors.UNAVAILABLE // 0' "$tmp/kill.json")
(( down > 0 )) || fail "kill -9: no call failed, so the server was not down under load"
# The last full second of the run (the timeline's last point may be a few ms
# long), 9 s after the restart: every call succeeds again. With gRPC's default
# reconnect backoff (1 s, x1.6) the channel would still be failing calls then.
last_second=$(jq -c '.timeline | [range(length) as $i | .[$i]
  + {length_s: (.[$i].t_s - (if $i == 0 then 0 else .[$i - 1].t_s end))}]
  | map(select(.length_s >= 0.9)) | last' "$tmp/kill.json")
last_ok=$(jq '.completed - .errors' <<<"$last_second")
(( last_ok > 0 && $(jq '.errors' <<<"$last_second") == 0 )) ||
  fail "kill -9: calls still fail in the last second after the restart: $(jq -c .timeline "$tmp/kill.json")"
echo "kill -9 under load: $down calls UNAVAILABLE while down, $last_ok OK in the last second after the restart, no hang"

# --- 2. SIGTERM loses no accepted request -------------------------------------
status=0
server_stop || status=$?
[[ $status -eq 0 ]] || fail "the server exited with $status after SIGTERM"
# --log_level debug: one line per call the service took, with its code, so
# that calls it accepted can be told from calls gRPC cancelled at shutdown
# before they reached the service (those come back CANCELLED: they were never
# accepted, and a client may retry them).
server_start "$server_bin" "$tmp" --drain_seconds 10 --log_level debug
server_wait_serving "$cli_bin"
# Raw B1 H8 L=S=256 calls keep work queued and computing when SIGTERM comes.
"$loadtest_bin" --target "127.0.0.1:$SERVER_PORT" --concurrency 8 --duration 5s \
  --seq_len 256 --embed_dim 512 --heads 8 --timeout 20s --json "$tmp/term.json" \
  --progress=false >"$tmp/term.out" 2>&1 &
loadtest_pid=$!
sleep 2
status=0
server_stop || status=$?
exited=$(date +%s.%N)
[[ $status -eq 0 ]] || fail "SIGTERM under load: the server exited with $status"
# It exits once it has logged "stopped": gRPC's own teardown after that at
# times took 10 s or more, past a pod's grace period. (server_stop looks
# every 0.1 s.) A sanitizer build tears down in full (server/main.cc).
stopped_at=$(grep -m 1 ' info stopped' "$SERVER_LOG" | cut -d ' ' -f 1)
[[ -n $stopped_at ]] || fail "SIGTERM under load: no 'stopped' line in the server's log"
linger=$(awk -v a="$(date -d "$stopped_at" +%s.%N)" -v b="$exited" 'BEGIN { printf "%.2f", b - a }')
if ! ldd "$server_bin" | grep -q 'libasan\|libtsan'; then
  awk -v l="$linger" 'BEGIN { exit !(l < 2) }' ||
    fail "SIGTERM under load: the server exited ${linger} s after logging 'stopped'"
fi
status=0
wait_bounded "$loadtest_pid" 60 || status=$?
loadtest_pid=""
[[ $status -eq 0 ]] || fail "the load tester exited $status: $(cat "$tmp/term.out")"
bad=$(unexpected_errors "$tmp/term.json" '["UNAVAILABLE", "CANCELLED"]')
[[ -z $bad ]] || fail "SIGTERM: unexpected errors: $bad ($(jq -r '.first_error // ""' "$tmp/term.json"))"
ok=$(jq '.ok' "$tmp/term.json")
(( ok > 0 )) || fail "SIGTERM: no call succeeded before it"
# Every call the service accepted was answered OK (or refused UNAVAILABLE),
# and every OK answer reached the client.
accepted_ok=$(grep -c 'debug Attend .* code=0 ' "$SERVER_LOG" || true)
accepted_bad=$(grep 'debug Attend ' "$SERVER_LOG" | grep -v -c ' code=0 \| code=14 ' || true)
(( accepted_bad == 0 )) ||
  fail "SIGTERM: $accepted_bad accepted calls ended neither OK nor UNAVAILABLE: $(grep 'debug Attend ' "$SERVER_LOG" | grep -v ' code=0 \| code=14 ' | head -n 3)"
(( accepted_ok == ok )) || fail "SIGTERM: the service answered $accepted_ok calls OK, the client got $ok"
cancelled=$(jq '.errors.CANCELLED // 0' "$tmp/term.json")
echo "SIGTERM under load: exit 0 (${linger} s after 'stopped'), all $ok accepted calls answered OK; $cancelled cancelled by gRPC before reaching the service; the rest refused with UNAVAILABLE"

# --- 3. an expired deadline frees the server's work ---------------------------
# --max_batch_size 1: each call computes alone, so calls queue behind it.
server_start "$server_bin" "$tmp" --metrics_port 0 --max_batch_size 1
server_wait_serving "$cli_bin"
metrics_port=$(server_metrics_port)
# L=S=8192 D64 raw calls: little to send (6 MiB) and much to compute (17
# GFLOP, tens of ms), 12 in flight, each with 100 ms to live. A burst's calls
# go out together (the first at once; later, those that expired together are
# sent again together), so their deadlines fall close together and, while
# one computes, others expire in the queue (docs/reliability.md says why a
# fixed rate did not). Little to send, so that even in a sanitizer build the
# deadlines pass while the requests wait in the queue, not while they are
# still being transferred and parsed.
"$loadtest_bin" --target "127.0.0.1:$SERVER_PORT" --concurrency 12 --duration 3s \
  --seq_len 8192 --embed_dim 64 --heads 1 --timeout 100ms \
  --json "$tmp/deadline.json" --progress=false >"$tmp/deadline.out" 2>&1 ||
  fail "the load tester failed: $(cat "$tmp/deadline.out")"
bad=$(unexpected_errors "$tmp/deadline.json" '["DEADLINE_EXCEEDED"]')
[[ -z $bad ]] || fail "deadlines: errors other than DEADLINE_EXCEEDED: $bad"
sent=$(jq '.sent' "$tmp/deadline.json")
sleep 1  # let the queue empty
dropped=$(metric "$metrics_port" 'attention_not_computed_total{reason="deadline_exceeded"}')
computed=$(metric "$metrics_port" 'attention_batch_size_sum')
interrupted=$(metric "$metrics_port" 'attention_interrupted_total{reason="deadline_exceeded"}')
(( ${dropped%.*} > 0 )) || fail "deadlines: attention_not_computed_total shows no dropped work"
(( ${computed%.*} < sent )) || fail "deadlines: the server computed $computed of $sent requests"
echo "expired deadlines: $sent sent, ${computed%.*} computed (${interrupted%.*} of them stopped at their deadline), ${dropped%.*} dropped before compute"
status=0
server_stop || status=$?
[[ $status -eq 0 ]] || fail "the server exited with $status after SIGTERM"
echo "fault_test: PASS"
