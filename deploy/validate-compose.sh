#!/usr/bin/env bash
# Validates deploy/compose.yaml offline against the Compose Specification and
# its own layout (deploy/validator/compose.mjs), then checks that two broken
# copies fail. Installs the validator's npm packages if missing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source deploy/validator/setup.sh

fail() {
  echo "FAIL: compose: $*" >&2
  exit 1
}

validator_setup
node deploy/validator/compose.mjs deploy/compose.yaml || fail "deploy/compose.yaml is invalid (above)"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# expect_invalid NAME SED_SCRIPT EXPECTED: deploy/compose.yaml edited by
# SED_SCRIPT must fail with a message containing EXPECTED.
expect_invalid() {
  local name=$1 script=$2 expected=$3
  sed "$script" deploy/compose.yaml >"$tmp/$name.yaml"
  ! cmp -s deploy/compose.yaml "$tmp/$name.yaml" || fail "negative check $name: '$script' changed nothing"
  if node deploy/validator/compose.mjs "$tmp/$name.yaml" 2>"$tmp/$name.err"; then
    fail "negative check $name: the broken file passed"
  fi
  grep -qF -- "$expected" "$tmp/$name.err" ||
    fail "negative check $name: want '$expected' in: $(cat "$tmp/$name.err")"
  echo "compose: broken as expected ($name): $(grep -F -- "$expected" "$tmp/$name.err" | head -n 1)"
}
expect_invalid misspelt_key 's/stop_grace_period:/stop_grace_periods:/' \
  "must NOT have additional properties (stop_grace_periods)"
expect_invalid missing_target 's/, --target, "server-3:50051"//' "no --target server-3:50051"
echo "compose: PASS"
