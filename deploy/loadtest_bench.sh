#!/usr/bin/env bash
# attention_loadtest's own targets (docs/loadtest.md; the figures are in
# docs/benchmarks.md): its CPU use at the server's saturation point (< 30% of
# the machine) and how closely its open loop holds the rate it is given
# (within 1%) up to the server's capacity.
# Starts attention_server on a free port of 127.0.0.1 (serving models/) and,
# for each transport (--transport grpc, then h2), finds the server's capacity
# with a closed loop of 64 callers on the demo model and runs open loops at
# 50, 80 and 100% of that rate; prints one table. Informational: exits 0
# unless a run cannot start.
#
# Usage: loadtest_bench.sh SERVER_BIN CLI_BIN LOADTEST_BIN [SECONDS]
#        (SECONDS measured per run, after a 1 s warm-up; default 5)
set -euo pipefail

if [[ $# -lt 3 || $# -gt 4 ]]; then
  echo "usage: $0 SERVER_BIN CLI_BIN LOADTEST_BIN [SECONDS]" >&2
  exit 2
fi
server_bin=$1
cli_bin=$2
loadtest_bin=$3
seconds=${4:-5}

source "$(dirname "${BASH_SOURCE[0]}")/server_control.sh"

tmp=$(mktemp -d)
trap 'server_kill; rm -rf "$tmp"' EXIT
server_start "$server_bin" "$tmp"
server_wait_serving "$cli_bin"

csv=$tmp/runs.csv
labels=()
# run LABEL LOAD_FLAGS...: one measured run, appended to the CSV.
run() {
  local label=$1
  shift
  echo "$label: attention_loadtest --model demo --warmup 1s --duration ${seconds}s $*" >&2
  "$loadtest_bin" --target "127.0.0.1:$SERVER_PORT" --model demo --warmup 1s \
    --duration "${seconds}s" --progress=false --csv "$csv" "$@" >"$tmp/$label.txt" ||
    server_fail "attention_loadtest failed: $(cat "$tmp/$label.txt")"
  labels+=("$label")
}

capacities=()
for transport in grpc h2; do
  run "$transport:capacity" --transport "$transport" --concurrency 64
  # The throughput_rps column of the last row: this capacity run.
  capacity=$(awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) if ($i == "throughput_rps") c = i }
                      NR > 1 { v = $c } END { printf "%.0f", v }' "$csv")
  capacities+=("$transport $capacity calls/s")
  for percent in 50 80 100; do
    run "$transport:open_${percent}%" --transport "$transport" \
      --rate "$(awk -v c="$capacity" -v p="$percent" 'BEGIN { printf "%.0f", c * p / 100 }')"
  done
done

echo
echo "attention_server capacity (closed loop, 64 callers, model demo) on $(nproc) cores, by the"
echo "load tester's transport: $(IFS=,; echo "${capacities[*]}" | sed 's/,/, /g')"
echo
awk -F, -v labels="${labels[*]}" '
  NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i
            split(labels, label, " ")
            printf "%-15s %10s %10s %9s %11s %8s %10s %10s %10s %9s\n", "run", "target/s", "sent/s",
                   "sent/tgt", "answered/s", "errors", "p99", "p99 uncorr", "late p99", "CPU %"
            next }
  { target = $col["target_rps"]
    ratio = target > 0 ? sprintf("%.4f", $col["sent_rps"] / target) : "-"
    printf "%-15s %10s %10.1f %9s %11.1f %8d %9.2fms %9.2fms %9.2fms %8.1f%%\n", label[NR - 1],
           target == "" ? "-" : target, $col["sent_rps"], ratio, $col["throughput_rps"],
           $col["errors"], $col["latency_p99_us"] / 1000, $col["uncorrected_latency_p99_us"] / 1000,
           $col["send_lateness_p99_us"] / 1000, $col["cpu_percent"] }' "$csv"
echo
echo "CPU %: the load tester's user + system time over the run's wall time, of all $(nproc) cores."
echo "Targets: CPU % < 30 at the capacity run; sent/tgt within 0.99 to 1.01 for the open loops."
