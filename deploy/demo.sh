#!/usr/bin/env bash
# Installs what is missing, builds Release into build/, starts attention_server
# on a free port of 127.0.0.1, sends deploy/demo_request.json with attention_cli,
# prints the answer, runs a 3-second load test with attention_loadtest, prints
# its summary and stops the server with SIGTERM.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source deploy/server_control.sh

bash deploy/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build -j2 --target attention_server attention_cli attention_loadtest

tmp=$(mktemp -d)
trap 'server_kill; rm -rf "$tmp"' EXIT

server_start build/attention_server "$tmp"
server_wait_serving build/attention_cli
echo "attention_server is SERVING on 127.0.0.1:$SERVER_PORT"
echo
echo "\$ attention_cli --target 127.0.0.1:$SERVER_PORT call deploy/demo_request.json"
build/attention_cli --target "127.0.0.1:$SERVER_PORT" call deploy/demo_request.json ||
  server_fail "the demo call failed"
echo

echo "\$ attention_loadtest --target 127.0.0.1:$SERVER_PORT --model demo --concurrency 8" \
  "--warmup 500ms --duration 3s --verify --threshold 'errors<1%'"
build/attention_loadtest --target "127.0.0.1:$SERVER_PORT" --model demo --concurrency 8 \
  --warmup 500ms --duration 3s --verify --threshold 'errors<1%' --progress=false ||
  server_fail "the load test failed"
echo

status=0
server_stop || status=$?
[[ $status -eq 0 ]] || server_fail "attention_server exited with $status after SIGTERM"
echo "attention_server stopped cleanly after SIGTERM"
