#!/usr/bin/env bash
# cmake --install of the build into a fresh prefix, then tests/consumer (a
# separate CMake project) configured against that prefix alone, built, and run
# against a real server on 127.0.0.1:0 with a golden case. Also checks that
# the installed headers include nothing of server/, engine/ or the build tree,
# and that pkg-config finds the library.
#
# Usage: consumer_test.sh BUILD_DIR SERVER_BIN CLI_BIN
set -euo pipefail
if [[ $# -ne 3 ]]; then
  echo "usage: $0 BUILD_DIR SERVER_BIN CLI_BIN" >&2
  exit 2
fi
build=$1 server_bin=$2 cli_bin=$3
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/deploy/server_control.sh"
tmp=$(mktemp -d)
trap 'server_kill; rm -rf "$tmp"' EXIT
fail() { echo "FAIL: consumer_test: $*" >&2; exit 1; }

prefix="$tmp/prefix"
cmake --install "$build" --prefix "$prefix" --component client >/dev/null
# What the installed headers include: ours must be installed beside them.
while IFS= read -r include; do
  case $include in
    server/* | engine/* | */build/* | /*) fail "an installed header includes \"$include\"" ;;
    attention/v1/* | client/*)
      [[ -f $prefix/include/$include ]] || fail "an installed header includes \"$include\", which is not installed" ;;
  esac
done < <(grep -rhoE '#include "[^"]+"' "$prefix/include" | sed 's/#include "\(.*\)"/\1/' | sort -u)
PKG_CONFIG_PATH="$(dirname "$(find "$prefix" -name attention-client.pc)")" \
  pkg-config --exists --print-errors attention-client || fail "pkg-config cannot use attention-client.pc"

cmake -S "$root/tests/consumer" -B "$tmp/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_BUILD_TYPE=Release >"$tmp/configure.log" 2>&1 || { cat "$tmp/configure.log" >&2; fail "configure"; }
cmake --build "$tmp/consumer" >"$tmp/build.log" 2>&1 || { cat "$tmp/build.log" >&2; fail "build"; }

mkdir "$tmp/server"
server_start "$server_bin" "$tmp/server"
server_wait_serving "$cli_bin"
"$tmp/consumer/consumer" "127.0.0.1:$SERVER_PORT" "$root/tests/golden/heads_split.json" ||
  fail "the installed client's answer differs from the golden case"
echo "consumer_test: PASS"
