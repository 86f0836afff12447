#!/usr/bin/env bash
# Makes .venv/ (python3 -m venv --system-site-packages, so Debian's grpcio,
# protobuf, numpy and torch are used) and installs the Python client
# (client/python) there, offline: pip --no-index --no-build-isolation, with
# Debian's setuptools; the build generates the protobuf and gRPC stubs from
# proto/ with protoc and grpc_python_plugin. Installs the Debian packages it
# needs that are missing first (deploy/install-deps.sh --python-client; root),
# not the service's build and test tools. Idempotent.
#
# Usage: deploy/install-python-client.sh [--without-torch] [VENV_DIR]
#   (VENV_DIR: relative to the current folder; default: the repository's
#   .venv; --without-torch: no python3-torch, so no attention_client.torch
#   unless torch is there already)
# Then:  .venv/bin/python -c 'import attention_client'
set -euo pipefail
usage="usage: $0 [--without-torch] [VENV_DIR]"
torch=(); modules=attention_client,attention_client.aio; venv=
for arg in "$@"; do
  case $arg in
    --without-torch) torch=(--without-torch) ;;
    -*) echo "install-python-client: unknown option $arg; $usage" >&2; exit 2 ;;
    *)
      [[ -z $venv ]] || { echo "install-python-client: two folders, $venv and $arg; $usage" >&2; exit 2; }
      venv=$(realpath -m -- "$arg")
      ;;
  esac
done
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv=${venv:-$PWD/.venv}

bash deploy/install-deps.sh --python-client "${torch[@]}"
# Debian's interpreter: the venv's site packages are Debian's dist-packages.
/usr/bin/python3 -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install --quiet --no-index --no-build-isolation \
  --disable-pip-version-check --upgrade client/python
[[ ${#torch[@]} -gt 0 ]] || modules+=,attention_client.torch
"$venv/bin/python" -c "import $modules"
echo "install-python-client: attention_client installed in $venv ($venv/bin/python)"
