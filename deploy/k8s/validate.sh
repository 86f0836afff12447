#!/usr/bin/env bash
# Validates deploy/k8s offline: renders the kustomization with kubectl kustomize
# and checks every object against the Kubernetes API schemas and the rules of
# deploy/validator/k8s.mjs (gRPC probes, grace period > preStop + drain,
# selectors, ...); checks that the ConfigMap's model is the repository's
# models/demo; then checks that two broken renderings fail. Installs kubectl
# (Debian's kubernetes-client) and the validator's npm packages if missing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source deploy/validator/setup.sh

fail() {
  echo "FAIL: k8s: $*" >&2
  exit 1
}

if ! command -v kubectl >/dev/null; then
  echo "k8s: installing kubernetes-client (kubectl)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends kubernetes-client >/dev/null ||
    { apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends kubernetes-client >/dev/null; }
fi
validator_setup

for f in config.pbtxt weights.safetensors; do
  cmp -s "models/demo/$f" "deploy/k8s/models/demo/$f" ||
    fail "deploy/k8s/models/demo/$f differs from models/demo/$f (copy it: kustomize reads files below deploy/k8s only)"
done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
kubectl kustomize deploy/k8s >"$tmp/rendered.yaml" || fail "kubectl kustomize deploy/k8s failed"
node deploy/validator/k8s.mjs "$tmp/rendered.yaml" || fail "the rendered manifests are invalid (above)"

# expect_invalid NAME SED_SCRIPT EXPECTED: the rendering edited by SED_SCRIPT
# must fail validation with a message containing EXPECTED.
expect_invalid() {
  local name=$1 script=$2 expected=$3
  sed "$script" "$tmp/rendered.yaml" >"$tmp/$name.yaml"
  ! cmp -s "$tmp/rendered.yaml" "$tmp/$name.yaml" || fail "negative check $name: '$script' changed nothing"
  if node deploy/validator/k8s.mjs "$tmp/$name.yaml" 2>"$tmp/$name.err"; then
    fail "negative check $name: the broken manifests passed"
  fi
  grep -qF -- "$expected" "$tmp/$name.err" ||
    fail "negative check $name: want '$expected' in: $(cat "$tmp/$name.err")"
  echo "k8s: broken as expected ($name): $(grep -F -- "$expected" "$tmp/$name.err" | head -n 1)"
}
expect_invalid port_as_string 's/containerPort: 50051/containerPort: "50051"/' \
  "containerPort must be integer"
expect_invalid short_grace_period 's/terminationGracePeriodSeconds: .*/terminationGracePeriodSeconds: 20/' \
  "terminationGracePeriodSeconds 20 must exceed"
echo "k8s: PASS"
