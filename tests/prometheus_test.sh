#!/usr/bin/env bash
# Debian's Prometheus scraping a real attention_server, both on 127.0.0.1,
# with deploy/prometheus/prometheus.yml (its target and a 1 s interval put
# in) and its alert rules: a short load of stateless calls and of sessions,
# one session left open, then tests/prometheus_check.py checks what
# Prometheus stored and the dashboard's queries (deploy/grafana).
#
# Usage: prometheus_test.sh SERVER_BIN CLI_BIN LOADTEST_BIN
set -euo pipefail
if [[ $# -ne 3 ]]; then
  echo "usage: $0 SERVER_BIN CLI_BIN LOADTEST_BIN" >&2
  exit 2
fi
server_bin=$1 cli_bin=$2 loadtest_bin=$3
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
command -v prometheus >/dev/null || { echo "prometheus_test: needs prometheus (deploy/install-deps.sh)" >&2; exit 1; }
source "$root/deploy/server_control.sh"

tmp=$(mktemp -d)
prometheus_pid=""
cleanup() {
  if [[ -n $prometheus_pid ]]; then
    kill -TERM "$prometheus_pid" 2>/dev/null
    wait "$prometheus_pid" 2>/dev/null || true
  fi
  server_kill
  rm -rf "$tmp"
}
trap cleanup EXIT

mkdir "$tmp/server"
server_start "$server_bin" "$tmp/server" --metrics_port 0 --max_queue 256
server_wait_serving "$cli_bin"
metrics_port=$(server_metrics_port)

# Prometheus on a free port (picked by binding port 0), retried if taken meanwhile.
free_port() {
  /usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
# The shipped target is the Debian package's metrics port, not Prometheus's own
# 9090 (on one host, a server there would clash with Prometheus, or the job
# would scrape Prometheus itself).
grep -q -- '--metrics_port=9464 ' "$root/deploy/debian/default" ||
  server_fail "deploy/debian/default does not serve metrics on 9464, prometheus.yml's target"
if grep -q ':9090\b' "$root/deploy/prometheus/prometheus.yml"; then
  server_fail "deploy/prometheus/prometheus.yml scrapes port 9090, Prometheus's own"
fi
sed -e "s/127.0.0.1:9464/127.0.0.1:$metrics_port/" -e 's/_interval: 15s/_interval: 1s/' \
  "$root/deploy/prometheus/prometheus.yml" >"$tmp/prometheus.yml"
grep -q "127.0.0.1:$metrics_port" "$tmp/prometheus.yml" ||
  server_fail "deploy/prometheus/prometheus.yml has no target 127.0.0.1:9464 to point at the server"
cp "$root/deploy/prometheus/alerts.yml" "$tmp/"
promtool check config "$tmp/prometheus.yml" >/dev/null
for attempt in 1 2 3; do
  prometheus_port=$(free_port)
  prometheus --config.file="$tmp/prometheus.yml" --storage.tsdb.path="$tmp/data" \
    --web.listen-address="127.0.0.1:$prometheus_port" --log.level=warn >"$tmp/prometheus.log" 2>&1 &
  prometheus_pid=$!
  for _ in $(seq 100); do
    kill -0 "$prometheus_pid" 2>/dev/null || break
    /usr/bin/python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$prometheus_port/-/ready', timeout=1)" \
      2>/dev/null && break
    sleep 0.2
  done
  kill -0 "$prometheus_pid" 2>/dev/null && break
  prometheus_pid=""
done
[[ -n $prometheus_pid ]] || { cat "$tmp/prometheus.log" >&2; server_fail "prometheus did not start"; }

# Prometheus scrapes the server (twice: rates need two samples) before the
# load begins, so that the load spans several scrapes.
/usr/bin/python3 - "http://127.0.0.1:$prometheus_port" <<'PY' || server_fail "Prometheus does not scrape the server"
import json, sys, time, urllib.parse, urllib.request
url = sys.argv[1] + "/api/v1/query?" + urllib.parse.urlencode({"query": 'count_over_time(up{job="attention-server"}[1m])'})
deadline = time.time() + 30
while time.time() < deadline:
    result = json.loads(urllib.request.urlopen(url, timeout=5).read())["data"]["result"]
    if result and float(result[0]["value"][1]) >= 2:
        sys.exit(0)
    time.sleep(0.2)
sys.exit(1)
PY

# A short load: stateless calls of the demo model, then decoders with sessions.
"$loadtest_bin" --target "127.0.0.1:$SERVER_PORT" --model demo --concurrency 4 --duration 4s \
  --json "$tmp/load.json" >"$tmp/load.log" 2>&1 || { cat "$tmp/load.log" >&2; server_fail "load failed"; }
"$loadtest_bin" --target "127.0.0.1:$SERVER_PORT" --sessions 4 --prefill 32 --steps 20 --heads 2 \
  --embed_dim 16 --json "$tmp/sessions.json" >"$tmp/sessions.log" 2>&1 ||
  { cat "$tmp/sessions.log" >&2; server_fail "session load failed"; }
# One session left open: 3 rows.
"$cli_bin" --target "127.0.0.1:$SERVER_PORT" call - >/dev/null <<'JSON'
{"query": {"shape": [1, 3, 4], "float_data": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]},
 "num_heads": 2, "session": {"ids": ["left-open"], "positions": [0], "create": true}}
JSON
"$cli_bin" --target "127.0.0.1:$SERVER_PORT" session left-open >"$tmp/info.json"

/usr/bin/python3 "$root/tests/prometheus_check.py" "http://127.0.0.1:$prometheus_port" \
  "http://127.0.0.1:$metrics_port/metrics" "$tmp/load.json" "$tmp/sessions.json" "$tmp/info.json" 3 \
  "$root/deploy/grafana/attention-dashboard.json" || { sed 's/^/  prometheus: /' "$tmp/prometheus.log" >&2; exit 1; }
