#!/usr/bin/env bash
# Installs what is missing, builds Release into build-release/ (build/ stays the
# test build) and runs attention_bench, passing it this script's arguments.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash deploy/install-deps.sh
cmake -S . -B build-release -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build-release -j2 --target attention_bench
build-release/attention_bench "$@"
