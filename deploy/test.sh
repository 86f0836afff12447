#!/usr/bin/env bash
# Installs what is missing, builds everything into build/ and runs every test.
# Fails when a test fails or is skipped: no test here skips on purpose, and
# GoogleTest reports a failed SetUpTestSuite as skipped tests.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash deploy/install-deps.sh
cmake -S . -B build -G Ninja
cmake --build build -j2

log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
ctest --test-dir build --output-on-failure -j2 2>&1 | tee "$log" || status=$?
if grep -q "(Skipped)" "$log"; then
  echo "FAIL: tests were skipped (see 'did not run' above)" >&2
  exit 1
fi
exit "$status"
