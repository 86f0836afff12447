#!/usr/bin/env bash
# Makes .venv/ (python3 -m venv --system-site-packages, so Debian's grpcio,
# protobuf, numpy and torch are used) and installs the Python client
# (client/python) there, offline: pip --no-index --no-build-isolation, with
# Debian's setuptools; the build generates the protobuf and gRPC stubs from
# proto/ with protoc and grpc_python_plugin. Installs the Debian packages that
# are missing first (deploy/install-deps.sh; root). Idempotent.
#
# Usage: deploy/install-python-client.sh [VENV_DIR]   (default: .venv)
# Then:  .venv/bin/python -c 'import attention_client'
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv=${1:-.venv}

bash deploy/install-deps.sh
# Debian's interpreter: the venv's site packages are Debian's dist-packages.
/usr/bin/python3 -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install --quiet --no-index --no-build-isolation \
  --disable-pip-version-check --upgrade client/python
"$venv/bin/python" -c 'import attention_client, attention_client.aio, attention_client.torch'
echo "install-python-client: attention_client installed in $venv ($venv/bin/python)"
