#!/usr/bin/env bash
# Installs what is missing, builds Release into build-release/ (build/ stays the
# test build) and runs the benchmarks:
#   bash deploy/bench.sh [ARGS]          attention_bench ARGS, then attention_server_bench
#   bash deploy/bench.sh engine [ARGS]   attention_bench ARGS only
#   bash deploy/bench.sh server [ARGS]   attention_server_bench ARGS only
#   bash deploy/bench.sh cost           cost_model_check: the cost model against
#                                        measured time and peak RSS per score kind
#   bash deploy/bench.sh memory         server_memory_check: how far long calls
#                                        grow attention_server's peak RSS
#   bash deploy/bench.sh decode [ARGS]   decode_bench and session_server_bench ARGS:
#                                        sessions' decode against a memory-read probe,
#                                        BFLOAT16 caches, prefill, steps through the server
#   bash deploy/bench.sh loadtest [SECS] attention_loadtest's own CPU use and rate
#                                        accuracy up to the server's capacity
#                                        (deploy/loadtest_bench.sh)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

which=all
case "${1:-}" in
  engine | server | cost | memory | decode | loadtest) which=$1; shift ;;
esac

bash deploy/install-deps.sh
cmake -S . -B build-release -G Ninja -DCMAKE_BUILD_TYPE=Release
case "$which" in
  engine) targets=(attention_bench) ;;
  server) targets=(attention_server_bench) ;;
  cost) targets=(cost_model_check) ;;
  memory) targets=(attention_server server_memory_check) ;;
  decode) targets=(decode_bench session_server_bench) ;;
  loadtest) targets=(attention_server attention_cli attention_loadtest) ;;
  *) targets=(attention_bench attention_server_bench) ;;
esac
cmake --build build-release -j2 --target "${targets[@]}"
case "$which" in
  engine) build-release/attention_bench "$@" ;;
  server) build-release/attention_server_bench "$@" ;;
  cost) build-release/cost_model_check ;;
  memory) build-release/server_memory_check build-release/attention_server ;;
  decode) build-release/decode_bench "$@" && build-release/session_server_bench "$@" ;;
  loadtest)
    bash deploy/loadtest_bench.sh build-release/attention_server build-release/attention_cli \
      build-release/attention_loadtest "$@"
    ;;
  *) build-release/attention_bench "$@" && build-release/attention_server_bench ;;
esac
