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
#   (default: .venv; --without-torch: no python3-torch, so no
#   attention_client.torch unless torch is there already)
# Then:  .venv/bin/python -c 'import attention_client'
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
torch=(); modules=attention_client,attention_client.aio
if [[ ${1:-} == --without-torch ]]; then
  torch=(--without-torch)
  shift
fi
venv=${1:-.venv}

bash deploy/install-deps.sh --python-client "${torch[@]}"
# Debian's interpreter: the venv's site packages are Debian's dist-packages.
/usr/bin/python3 -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install --quiet --no-index --no-build-isolation \
  --disable-pip-version-check --upgrade client/python
[[ ${#torch[@]} -gt 0 ]] || modules+=,attention_client.torch
"$venv/bin/python" -c "import $modules"
echo "install-python-client: attention_client installed in $venv ($venv/bin/python)"
