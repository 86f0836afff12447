# Shell functions to run attention_server on a free port of 127.0.0.1 and stop
# it; sourced by deploy/demo.sh and tests/smoke_test.sh (bash, set -euo pipefail).
#
#   server_start SERVER_BIN WORKDIR [FLAG...]  starts it, waits (at most 20 s) for
#                                              its port file; sets SERVER_PID,
#                                              SERVER_PORT, SERVER_LOG
#   server_wait_serving CLI_BIN                waits (at most 20 s) for health SERVING
#   server_stop                                SIGTERM, waits (at most 20 s); returns
#                                              the server's exit code
#   server_kill                                SIGKILL if still running; for traps
#   server_fail MESSAGE                        prints MESSAGE and the server's log, exits 1
#   server_metrics_port                        the --metrics_port 0 server's metrics port,
#                                              from its log
#   metric PORT SAMPLE                         a Prometheus sample's value (0 if absent)
#   wait_bounded PID SECONDS                   waits for background PID, returns its exit
#                                              code; fails if it still runs then
#   unexpected_errors REPORT ALLOWED           the error codes of an attention_loadtest
#                                              --json REPORT not in ALLOWED (a jq array)
#
# Several servers: call server_start once per WORKDIR and keep each one's
# SERVER_PID, SERVER_PORT and SERVER_LOG; the functions act on the current ones.

SERVER_PID=""
SERVER_PORT=""
SERVER_LOG=""

server_fail() {
  echo "FAIL: $*" >&2
  if [[ -n $SERVER_LOG && -s $SERVER_LOG ]]; then
    sed 's/^/  server: /' "$SERVER_LOG" >&2
  fi
  exit 1
}

server_start() {
  local bin=$1 workdir=$2
  shift 2
  SERVER_LOG="$workdir/server.log"
  rm -f "$workdir/port"
  "$bin" --listen 127.0.0.1:0 --port_file "$workdir/port" "$@" >"$SERVER_LOG" 2>&1 &
  SERVER_PID=$!
  local _
  for _ in $(seq 200); do  # 200 x 0.1 s
    [[ -s $workdir/port ]] && break
    kill -0 "$SERVER_PID" 2>/dev/null || server_fail "the server exited before writing its port file"
    sleep 0.1
  done
  [[ -s $workdir/port ]] || server_fail "no port file after 20 s"
  SERVER_PORT=$(<"$workdir/port")
  [[ $SERVER_PORT =~ ^[0-9]+$ ]] || server_fail "the port file holds '$SERVER_PORT', not a port"
}

server_wait_serving() {
  local cli=$1 health="" _
  for _ in $(seq 100); do  # 100 x (call + 0.2 s)
    health=$("$cli" --target "127.0.0.1:$SERVER_PORT" --timeout 2s health 2>/dev/null) && return 0
    kill -0 "$SERVER_PID" 2>/dev/null || server_fail "the server exited while warming up"
    sleep 0.2
  done
  server_fail "health is '$health', not SERVING, after 20 s"
}

server_stop() {
  local _ status=0
  kill -TERM "$SERVER_PID"
  for _ in $(seq 200); do  # 200 x 0.1 s
    kill -0 "$SERVER_PID" 2>/dev/null || break
    sleep 0.1
  done
  kill -0 "$SERVER_PID" 2>/dev/null && server_fail "the server still runs 20 s after SIGTERM"
  wait "$SERVER_PID" || status=$?
  SERVER_PID=""
  return "$status"
}

server_kill() {
  if [[ -n $SERVER_PID ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -KILL "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=""
}

server_metrics_port() {
  local port
  port=$(sed -n 's/.*metrics on http:\/\/127.0.0.1:\([0-9]*\)\/metrics.*/\1/p' "$SERVER_LOG" | head -n 1)
  [[ $port =~ ^[0-9]+$ ]] || server_fail "no metrics port in the server's log"
  echo "$port"
}

# bash's /dev/tcp, so no HTTP client is needed.
metric() {
  local body
  exec 3<>"/dev/tcp/127.0.0.1/$1"
  printf 'GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
  body=$(cat <&3)
  exec 3<&-
  awk -v name="$2" '$1 == name { print $2; found = 1 } END { if (!found) print 0 }' <<<"$body"
}

wait_bounded() {
  local pid=$1 limit=$2 _ status=0
  for _ in $(seq $((limit * 10))); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -0 "$pid" 2>/dev/null && server_fail "process $pid still runs after $limit s: it hangs"
  wait "$pid" || status=$?
  return "$status"
}

unexpected_errors() {
  jq -r --argjson allowed "$2" \
    '.errors | to_entries | map(select(.key as $k | $allowed | index($k) | not))
     | map("\(.key) x\(.value)") | join(", ")' "$1"
}
