// Checks Kubernetes manifests offline: every object against the API schema of
// its apiVersion and kind (npm's kubernetes-models, @kubernetes-models/istio
// and @kubernetes-models/gateway-api), then the rules that deploy/k8s and
// deploy/k8s-sessions rely on. Prints each problem and exits 1 if there is any.
//
//   node k8s.mjs FILE      (multi-document YAML, e.g. the output of kubectl kustomize)
//   node k8s.mjs -         (the same on standard input)
//
// The API schemas check types, formats and required fields; like the API
// server's OpenAPI, they do not reject unknown fields.
import { readFileSync } from "node:fs";
import { parseAllDocuments } from "yaml";

const source = process.argv[2];
if (!source) {
  console.error("usage: node k8s.mjs FILE|-");
  process.exit(2);
}
const text = readFileSync(source === "-" ? 0 : source, "utf8");

const problems = [];
const objects = [];
for (const doc of parseAllDocuments(text)) {
  if (doc.errors.length > 0) {
    problems.push(`YAML: ${doc.errors[0].message}`);
    continue;
  }
  const object = doc.toJS();
  if (object == null) continue;
  // kustomize wraps binaryData's base64 over lines; the API server's decoder
  // (Go's encoding/base64) skips line breaks, the schema's "byte" format does not.
  for (const [key, value] of Object.entries(object.binaryData ?? {})) {
    if (typeof value === "string") object.binaryData[key] = value.replace(/[\r\n]/g, "");
  }
  objects.push(object);
}
const nameOf = (o) => `${o.kind ?? "?"}/${o.metadata?.name ?? "?"}`;

// --- Kubernetes API schemas ---------------------------------------------------
// Packages with the schemas of API groups beyond Kubernetes' own.
const groupPackages = {
  "networking.istio.io": "@kubernetes-models/istio",
  "gateway.networking.k8s.io": "@kubernetes-models/gateway-api",
  "monitoring.coreos.com": "@kubernetes-models/prometheus-operator",
};
async function modelFor(apiVersion, kind) {
  // "v1" (core) or "GROUP/VERSION"; each package has one module per version.
  if (!/^([a-z0-9.-]+\/)?v[0-9]+((alpha|beta)[0-9]+)?$/.test(apiVersion)) return undefined;
  const group = apiVersion.includes("/") ? apiVersion.split("/")[0] : "";
  const module = groupPackages[group] ? `${groupPackages[group]}/${apiVersion}` : `kubernetes-models/${apiVersion}`;
  try {
    return (await import(module))[kind];
  } catch {
    return undefined;
  }
}

for (const object of objects) {
  const Model = await modelFor(String(object.apiVersion), String(object.kind));
  if (Model === undefined) {
    problems.push(`${nameOf(object)}: no API schema for apiVersion ${object.apiVersion}, kind ${object.kind}`);
    continue;
  }
  try {
    new Model(object).validate();
  } catch (error) {
    for (const e of error.errors ?? [{ instancePath: "", message: error.message }]) {
      problems.push(`${nameOf(object)}: ${e.instancePath || "/"} ${e.message}`);
    }
  }
}

// --- the rules of deploy/k8s ----------------------------------------------------
const ofKind = (kind) => objects.filter((o) => o.kind === kind);
const deployments = ofKind("Deployment");
const selects = (selector, labels) =>
  selector != null &&
  Object.keys(selector).length > 0 &&
  Object.entries(selector).every(([key, value]) => labels?.[key] === value);
const selectsAPod = (selector) =>
  deployments.some((d) => selects(selector, d.spec?.template?.metadata?.labels));
// The value of the last --NAME=VALUE or --NAME VALUE in args, as the server's
// flag parser reads them.
function flag(args, name) {
  let value;
  args.forEach((arg, i) => {
    if (arg === `--${name}`) value = args[i + 1];
    else if (arg.startsWith(`--${name}=`)) value = arg.slice(name.length + 3);
  });
  return value;
}
const configMaps = new Set(ofKind("ConfigMap").map((c) => c.metadata?.name));
// A memory quantity (1Gi, 4096Mi, 4G, 4294967296) in MiB; NaN if not one.
function mebibytes(quantity) {
  const m = /^([0-9.]+)(Ki|Mi|Gi|Ti|k|M|G|T)?$/.exec(String(quantity ?? ""));
  if (m === null) return NaN;
  const factor = { Ki: 2 ** 10, Mi: 2 ** 20, Gi: 2 ** 30, Ti: 2 ** 40, k: 1e3, M: 1e6, G: 1e9, T: 1e12 };
  return (Number(m[1]) * (factor[m[2]] ?? 1)) / 2 ** 20;
}
// What the server may hold beside its two budgets: the engine's pool of freed
// output blocks (512 MiB), closed sessions' kept blocks (256 MiB) and 768 MiB
// for the process (docs/serving.md, "The container's memory limit").
const UNBUDGETED_MIB = 1536;

for (const d of deployments) {
  const pod = d.spec?.template?.spec ?? {};
  const grace = pod.terminationGracePeriodSeconds ?? 30;
  // One discovery path (docs/operations.md): the Service's metrics port.
  for (const key of Object.keys(d.spec?.template?.metadata?.annotations ?? {})) {
    if (key.startsWith("prometheus.io/")) {
      problems.push(`${nameOf(d)}: pod annotation ${key}: Prometheus would scrape the pods twice, also through the attention-server Service`);
    }
  }
  for (const c of pod.containers ?? []) {
    const where = `${nameOf(d)} container ${c.name}`;
    for (const probe of ["startupProbe", "readinessProbe", "livenessProbe"]) {
      if (c[probe] !== undefined && c[probe].grpc === undefined) {
        problems.push(`${where}: ${probe} is not a native gRPC probe (grpc: {port: ...})`);
      }
    }
    if (c.readinessProbe?.grpc === undefined || c.livenessProbe?.grpc === undefined) {
      problems.push(`${where}: needs gRPC readiness and liveness probes`);
    }
    const args = (c.args ?? []).map(String);
    const drain = Number(flag(args, "drain_seconds") ?? 30);  // the server's defaults
    const delay = Number(flag(args, "shutdown_delay_seconds") ?? 0);
    const budgets = Number(flag(args, "memory_budget_mb") ?? 1536) +  // the defaults
      Number(flag(args, "session_memory_mb") ?? 1024);
    const limit = mebibytes(c.resources?.limits?.memory);
    const request = mebibytes(c.resources?.requests?.memory);
    if (!(limit >= budgets + UNBUDGETED_MIB)) {
      problems.push(`${where}: memory limit ${c.resources?.limits?.memory} (${limit} MiB) is below --memory_budget_mb + --session_memory_mb + ${UNBUDGETED_MIB} MiB = ${budgets + UNBUDGETED_MIB} MiB`);
    }
    if (request !== limit) {
      problems.push(`${where}: memory request ${c.resources?.requests?.memory} differs from the limit ${c.resources?.limits?.memory}: the node may not have the memory the budgets allow`);
    }
    const preStop = c.lifecycle?.preStop;
    const command = preStop?.exec?.command ?? [];
    const sleep = Number(preStop?.sleep?.seconds ?? (command[0] === "sleep" ? command[1] : 0));
    if (!(sleep > 0)) problems.push(`${where}: no preStop sleep: the pod gets SIGTERM while still in the endpoints`);
    if (!(grace > sleep + delay + drain)) {
      problems.push(`${where}: terminationGracePeriodSeconds ${grace} must exceed preStop sleep ${sleep} s + --shutdown_delay_seconds ${delay} + --drain_seconds ${drain}`);
    }
    const repository = flag(args, "model_repository");
    for (const mount of c.volumeMounts ?? []) {
      const volume = (pod.volumes ?? []).find((v) => v.name === mount.name);
      if (volume?.configMap && mount.mountPath.replace(/\/+$/, "") === repository?.replace(/\/+$/, "")) {
        problems.push(`${where}: ConfigMap volume ${mount.name} mounted at --model_repository itself; mount it at ${repository}/MODEL`);
      }
    }
  }
  for (const v of pod.volumes ?? []) {
    if (v.configMap && !configMaps.has(v.configMap.name)) {
      problems.push(`${nameOf(d)}: volume ${v.name} names ConfigMap ${v.configMap.name}, which is not in the manifests`);
    }
  }
}
for (const s of ofKind("Service")) {
  if (!selectsAPod(s.spec?.selector)) problems.push(`${nameOf(s)}: its selector matches no Deployment's pods`);
}
if (!ofKind("Service").some((s) => s.spec?.clusterIP === "None" && s.spec?.ports?.some((p) => p.name === "grpc"))) {
  problems.push("no headless Service (clusterIP: None) with a grpc port for client-side round_robin");
}
for (const p of ofKind("PodDisruptionBudget")) {
  if (!selectsAPod(p.spec?.selector?.matchLabels)) problems.push(`${nameOf(p)}: its selector matches no Deployment's pods`);
}
for (const h of ofKind("HorizontalPodAutoscaler")) {
  const target = h.spec?.scaleTargetRef;
  const scaled = deployments.find((d) => target?.kind === "Deployment" && d.metadata?.name === target?.name);
  if (!scaled) {
    problems.push(`${nameOf(h)}: scaleTargetRef ${target?.kind}/${target?.name} is not in the manifests`);
  } else if (scaled.spec?.replicas !== undefined) {
    // Every apply would scale it back to that count, past the autoscaler.
    problems.push(`${nameOf(scaled)}: replicas ${scaled.spec.replicas} is set, but ${nameOf(h)} scales it; leave replicas out`);
  }
}

// Sessions across replicas (deploy/k8s-sessions): routing hashes on the
// header the clients send, towards a Service and port that exist.
const AFFINITY_HEADER = "attention-affinity";
const services = ofKind("Service");
const serviceNamed = (host) => services.find((s) => s.metadata?.name === String(host).split(".")[0]);
for (const r of ofKind("DestinationRule")) {
  if (serviceNamed(r.spec?.host) === undefined) {
    problems.push(`${nameOf(r)}: host ${r.spec?.host} is not a Service in the manifests`);
  } else if (serviceNamed(r.spec?.host).spec?.clusterIP === "None") {
    problems.push(`${nameOf(r)}: host ${r.spec?.host} is headless: clients pick pods themselves, the mesh cannot hash`);
  }
  const hash = r.spec?.trafficPolicy?.loadBalancer?.consistentHash;
  if (hash?.httpHeaderName !== AFFINITY_HEADER) {
    problems.push(`${nameOf(r)}: consistentHash.httpHeaderName is ${hash?.httpHeaderName}, not ${AFFINITY_HEADER}`);
  }
  if (hash?.minimumRingSize !== undefined) {
    problems.push(`${nameOf(r)}: consistentHash.minimumRingSize is deprecated in Istio: set consistentHash.ringHash.minimumRingSize`);
  }
}
// Versions the schemas still describe but current API servers no longer
// serve: Gateway API v1.2 (2024) stopped serving v1alpha2 GRPCRoute and
// ReferenceGrant, so applying them fails.
for (const o of objects) {
  if (o.apiVersion === "gateway.networking.k8s.io/v1alpha2" && ["GRPCRoute", "ReferenceGrant"].includes(o.kind)) {
    problems.push(`${nameOf(o)}: apiVersion ${o.apiVersion} is no longer served (Gateway API v1.2 and later): use gateway.networking.k8s.io/v1`);
  }
}
const gateways = new Set(ofKind("Gateway").map((g) => g.metadata?.name));
for (const route of ofKind("GRPCRoute")) {
  for (const parent of route.spec?.parentRefs ?? []) {
    if (!gateways.has(parent.name)) problems.push(`${nameOf(route)}: parentRef ${parent.name} is not a Gateway in the manifests`);
  }
  for (const rule of route.spec?.rules ?? []) {
    for (const backend of rule.backendRefs ?? []) {
      const service = serviceNamed(backend.name);
      if (service === undefined || !service.spec?.ports?.some((p) => p.port === backend.port)) {
        problems.push(`${nameOf(route)}: backendRef ${backend.name}:${backend.port} is not a Service port in the manifests`);
      }
    }
  }
}

// Monitoring (deploy/k8s-monitoring): the ServiceMonitor scrapes a Service
// port that exists, and the PrometheusRule holds deploy/prometheus's rules.
for (const m of ofKind("ServiceMonitor")) {
  const selected = services.filter((s) => selects(m.spec?.selector?.matchLabels, s.metadata?.labels));
  for (const e of m.spec?.endpoints ?? []) {
    if (!selected.some((s) => s.spec?.ports?.some((p) => p.name === e.port))) {
      problems.push(`${nameOf(m)}: no Service it selects has a port named ${e.port}`);
    }
  }
}
const alertsFile = process.env.ATTENTION_ALERTS_FILE;
for (const r of ofKind("PrometheusRule")) {
  if (alertsFile === undefined) continue;
  const { parse } = await import("yaml");
  // Key order aside (kustomize sorts keys).
  const canonical = (v) =>
    Array.isArray(v) ? v.map(canonical)
      : v !== null && typeof v === "object"
        ? Object.fromEntries(Object.keys(v).sort().map((k) => [k, canonical(v[k])]))
        : v;
  const want = JSON.stringify(canonical(parse(readFileSync(alertsFile, "utf8")).groups));
  if (JSON.stringify(canonical(r.spec?.groups)) !== want) {
    problems.push(`${nameOf(r)}: its groups differ from ${alertsFile}`);
  }
}

if (objects.length === 0) problems.push("no objects");
if (problems.length > 0) {
  for (const p of problems) console.error(`k8s: ${p}`);
  process.exit(1);
}
console.log(`k8s: ${objects.length} objects valid: ${objects.map(nameOf).join(", ")}`);
