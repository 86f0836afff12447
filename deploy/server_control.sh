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
