#!/usr/bin/env bash
# Checks that BIN --help lists every flag BIN defines in this source tree, each
# with its meaning and default (empty for an optional flag with none). --helpfull lists every flag of the binary,
# Abseil's own included, under "Flags from FILE:"; the flags from files under
# SOURCE_DIR are the binary's own.
#
# Usage: tests/help_test.sh SOURCE_DIR BIN
set -euo pipefail
src=${1:?usage: $0 SOURCE_DIR BIN}
bin=${2:?usage: $0 SOURCE_DIR BIN}
name=$(basename "$bin")

# Abseil exits 1 after printing help; what it printed is what counts.
full=$("$bin" --helpfull 2>&1 || true)
help=$("$bin" --help 2>&1 || true)

# Abseil prints the paths without their leading "/".
mapfile -t flags < <(awk -v src="${src#/}/" '
  /^  Flags from / { own = index($0, src) > 0; next }
  own && match($0, /^    --[A-Za-z0-9_]+ \(/) { print substr($0, RSTART + 6, RLENGTH - 8) }
' <<<"$full")
if [[ ${#flags[@]} -eq 0 ]]; then
  echo "FAIL: $name --helpfull lists no flag from files under $src" >&2
  exit 1
fi

# Each flag's entry in --help: from its "--NAME (" line to the next flag's.
entry() {
  awk -v flag="    --$1 (" '
    index($0, flag) == 1 { on = 1; print; next }
    on && /^    --/ { exit }
    on && /^  [^ ]/ { exit }
    on { print }
  ' <<<"$help"
}

failures=0
for flag in "${flags[@]}"; do
  text=$(entry "$flag" | tr -s ' \n' ' ')
  if [[ -z $text ]]; then
    echo "FAIL: $name --help does not list --$flag" >&2
    failures=$((failures + 1))
  elif ! [[ $text =~ ^\ *--$flag\ \(.*[^[:space:]].*\)\;\ default:\ .*\; ]]; then
    echo "FAIL: $name --help lists --$flag without a meaning or a default: $text" >&2
    failures=$((failures + 1))
  fi
done
if [[ $failures -gt 0 ]]; then
  echo "$name --help was:" >&2
  echo "$help" >&2
  exit 1
fi
echo "PASS: $name --help lists all ${#flags[@]} of its flags with a meaning and a default"
