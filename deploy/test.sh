#!/usr/bin/env bash
# Installs what is missing, builds everything into build/ and runs every test.
# Exits with ctest's exit code.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash deploy/install-deps.sh
cmake -S . -B build -G Ninja
cmake --build build -j2
exec ctest --test-dir build --output-on-failure -j2
