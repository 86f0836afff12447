#!/usr/bin/env bash
# Installs what is missing, builds Release into build-release/ (build/ stays the
# test build) and runs the benchmarks:
#   bash deploy/bench.sh [ARGS]          attention_bench ARGS, then attention_server_bench
#   bash deploy/bench.sh engine [ARGS]   attention_bench ARGS only
#   bash deploy/bench.sh server [ARGS]   attention_server_bench ARGS only
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

which=all
case "${1:-}" in
  engine | server) which=$1; shift ;;
esac

bash deploy/install-deps.sh
cmake -S . -B build-release -G Ninja -DCMAKE_BUILD_TYPE=Release
case "$which" in
  engine) targets=(attention_bench) ;;
  server) targets=(attention_server_bench) ;;
  *) targets=(attention_bench attention_server_bench) ;;
esac
cmake --build build-release -j2 --target "${targets[@]}"
case "$which" in
  engine) build-release/attention_bench "$@" ;;
  server) build-release/attention_server_bench "$@" ;;
  *) build-release/attention_bench "$@" && build-release/attention_server_bench ;;
esac
