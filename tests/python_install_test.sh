#!/usr/bin/env bash
# deploy/install-python-client.sh as a user runs it: into a new virtual
# environment, with torch and --without-torch; each installed package then
# calls a real server (attention_client.torch's layer too, where installed).
#
# Usage: python_install_test.sh SERVER_BIN CLI_BIN
set -euo pipefail

if [[ $# -ne 2 ]]; then
  echo "usage: $0 SERVER_BIN CLI_BIN" >&2
  exit 2
fi
server_bin=$1
cli_bin=$2
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

source "$repo/deploy/server_control.sh"

tmp=$(mktemp -d)
trap 'server_kill; rm -rf "$tmp"' EXIT
fail() { server_fail "python_install_test: $*"; }

server_start "$server_bin" "$tmp"
server_wait_serving "$cli_bin"

# A call of the demo model, and with torch the drop-in layer over it;
# without, torch (which Debian'"'"'s site packages hold here) cannot be
# imported, so the package and its asyncio client must not need it.
call='
import sys
if sys.argv[2] == "without-torch":
    sys.modules["torch"] = None
import numpy as np
import attention_client.aio
from attention_client import Client
with Client(sys.argv[1], timeout=30) as c:
    out = c.attend(np.ones((1, 3, 64), np.float32), model="demo").output
    assert out.shape == (1, 3, 64), out.shape
if sys.argv[2] == "torch":
    import torch
    from attention_client.torch import RemoteMultiheadAttention
    layer = RemoteMultiheadAttention(sys.argv[1], "demo", batch_first=True)
    x = torch.ones(1, 3, 64)
    out, _ = layer(x, x, x)
    assert tuple(out.shape) == (1, 3, 64), out.shape
    layer.client.close()
print("ok")
'
for variant in torch without-torch; do
  args=("$tmp/venv-$variant")
  [[ $variant == torch ]] || args=(--without-torch "${args[@]}")
  log=$tmp/install-$variant.log
  bash "$repo/deploy/install-python-client.sh" "${args[@]}" > "$log" 2>&1 ||
    fail "install-python-client.sh ${args[*]} failed: $(cat "$log")"
  grep -q "attention_client installed in $tmp/venv-$variant" "$log" ||
    fail "install-python-client.sh ${args[*]} did not say where it installed: $(cat "$log")"
  [[ $("$tmp/venv-$variant/bin/python" -c "$call" "127.0.0.1:$SERVER_PORT" "$variant") == ok ]] ||
    fail "the $variant venv's client did not call the server"
  echo "python_install_test: $variant: installed, called the server"
done
server_stop
echo "PASS: python_install_test"
