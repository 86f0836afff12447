#!/usr/bin/env bash
# Validates deploy/k8s, deploy/k8s-sessions and deploy/k8s-monitoring
# offline: renders each
# kustomization with kubectl kustomize and checks every object against its
# API schema (Kubernetes, Istio, Gateway API, Prometheus Operator) and the
# rules of
# deploy/validator/k8s.mjs (gRPC probes, grace period > preStop + drain, the
# memory limit against the budgets, no prometheus.io annotations,
# selectors, session routing on attention-affinity, ...); checks that the
# ConfigMap's model is the repository's models/demo and that the sessions
# overlay leaves every object of deploy/k8s as it is; then checks that broken
# renderings fail. Installs kubectl (Debian's kubernetes-client) and the
# validator's npm packages if missing.
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

kubectl kustomize deploy/k8s-sessions >"$tmp/sessions.yaml" || fail "kubectl kustomize deploy/k8s-sessions failed"
node deploy/validator/k8s.mjs "$tmp/sessions.yaml" || fail "the session routing manifests are invalid (above)"
# The stateless path's objects are unchanged by the overlay.
node --input-type=module - "$tmp/rendered.yaml" "$tmp/sessions.yaml" <<'EOF_NODE' ||
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
const require = createRequire(process.cwd() + "/deploy/validator/");
const { parseAllDocuments } = require("yaml");
const docs = (f) => parseAllDocuments(readFileSync(f, "utf8")).map((d) => JSON.stringify(d.toJS()));
const overlay = new Set(docs(process.argv[3]));
const changed = docs(process.argv[2]).filter((d) => !overlay.has(d));
if (changed.length > 0) {
  console.error(`changed by deploy/k8s-sessions: ${changed.map((d) => JSON.parse(d).kind).join(", ")}`);
  process.exit(1);
}
EOF_NODE
  fail "deploy/k8s-sessions changes objects of deploy/k8s"

# Monitoring: its objects with deploy/k8s's (whose Services they select).
kubectl kustomize deploy/k8s-monitoring >"$tmp/monitoring-only.yaml" ||
  fail "kubectl kustomize deploy/k8s-monitoring failed"
{ cat "$tmp/rendered.yaml"; echo "---"; cat "$tmp/monitoring-only.yaml"; } >"$tmp/monitoring.yaml"
export ATTENTION_ALERTS_FILE=deploy/prometheus/alerts.yml
node deploy/validator/k8s.mjs "$tmp/monitoring.yaml" || fail "the monitoring manifests are invalid (above)"

# expect_invalid NAME SED_SCRIPT EXPECTED [RENDERING]: the rendering
# (rendered.yaml, or sessions.yaml) edited by SED_SCRIPT must fail validation
# with a message containing EXPECTED.
expect_invalid() {
  local name=$1 script=$2 expected=$3 rendering=${4:-rendered}
  sed "$script" "$tmp/$rendering.yaml" >"$tmp/$name.yaml"
  ! cmp -s "$tmp/$rendering.yaml" "$tmp/$name.yaml" || fail "negative check $name: '$script' changed nothing"
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
expect_invalid delay_past_grace 's/^        - --drain_seconds=20$/&\n        - --shutdown_delay_seconds=10/' \
  "+ --shutdown_delay_seconds 10 + --drain_seconds 20"
expect_invalid memory_limit_short 's/memory: 4Gi/memory: 3Gi/' \
  "is below --memory_budget_mb + --session_memory_mb + 1536 MiB = 4096 MiB"
expect_invalid memory_request_low '/requests:/,/memory:/s/memory: 4Gi/memory: 1Gi/' "memory request 1Gi differs from the limit 4Gi"
expect_invalid replicas_beside_hpa 's/^  revisionHistoryLimit: 5$/  replicas: 3\n&/' \
  "replicas 3 is set, but HorizontalPodAutoscaler/attention-server scales it"
expect_invalid scraped_twice 's/^      labels:$/      annotations: {prometheus.io\/scrape: "true"}\n&/' \
  "pod annotation prometheus.io/scrape"
expect_invalid ring_size_as_word 's/minimumRingSize: 4096/minimumRingSize: many/' \
  "minimumRingSize must be integer" sessions
expect_invalid ring_size_deprecated '/ringHash:/d; s/^          minimumRingSize/        minimumRingSize/' \
  "consistentHash.minimumRingSize is deprecated" sessions
expect_invalid grpcroute_v1alpha2 '/^apiVersion: gateway.networking.k8s.io\/v1$/{N;s/v1\nkind: GRPCRoute/v1alpha2\nkind: GRPCRoute/}' \
  "is no longer served" sessions
expect_invalid other_header 's/httpHeaderName: attention-affinity/httpHeaderName: x-session/' \
  "not attention-affinity" sessions
expect_invalid route_to_nowhere 's/- name: attention-server$/- name: attention-sever/' \
  "is not a Service port" sessions
expect_invalid scrape_no_port 's/^    port: metrics$/    port: prometheus/' \
  "no Service it selects has a port named prometheus" monitoring
expect_invalid rules_drifted 's/> 0.05/> 0.1/' "its groups differ from" monitoring
expect_invalid interval_as_number 's/interval: 15s/interval: 15/' "interval must be string" monitoring
echo "k8s: PASS"
