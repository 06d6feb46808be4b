#!/usr/bin/env node
// Validates one rendering of the optimus chart, offline:
//
//   node validate.js --set=NAME --manifests=FILE --values=FILE --schema=FILE
//                    --shard-main=server/main.cc --coord-main=coordinator/main.cc
//                    [--flags-out=DIR] [--expect-schema-failure]
//
// 1. YAML: every document parses, with no duplicate keys.
// 2. Kubernetes API: every object validates against its API schema
//    (kubernetes-models; ServiceMonitor from @kubernetes-models/prometheus-operator).
// 3. values.schema.json accepts the merged values (with --expect-schema-failure:
//    rejects them, and nothing else is checked).
// 4. Behaviour: workloads select their own pods, probes hit /healthz on the
//    metrics port the flags open, flag files use only flags the binaries
//    define, shard DaemonSets exist exactly for the enabled kinds and carry the
//    values' nodeSelector/affinity/tolerations, Services, PDBs and
//    ServiceMonitors select something.
// Prints a summary line per value set; exits 1 with every failure listed.
"use strict";

const fs = require("fs");
const path = require("path");

function need(mod) {
  try {
    return require(mod);
  } catch (e) {
    console.error(`validate.js: cannot load '${mod}' (${e.code || e.message}).`);
    console.error("  Install the test's node modules: (cd deploy/helm/tests && npm ci), or run scripts/install_deps.sh");
    process.exit(2);
  }
}
const YAML = need("yaml");
const Ajv = need("ajv");

const args = {};
for (const a of process.argv.slice(2)) {
  const m = /^--([a-z-]+)(?:=(.*))?$/.exec(a);
  if (!m) {
    console.error(`validate.js: bad argument ${a}`);
    process.exit(2);
  }
  args[m[1]] = m[2] === undefined ? true : m[2];
}
for (const k of ["set", "manifests", "values", "schema"]) {
  if (!args[k]) {
    console.error(`validate.js: --${k} is required`);
    process.exit(2);
  }
}
const setName = args.set;
const failures = [];
function fail(msg) {
  failures.push(msg);
}
function check(cond, msg) {
  if (!cond) fail(msg);
  return !!cond;
}
let behaviourChecks = 0;
function expect(cond, msg) {
  behaviourChecks++;
  return check(cond, msg);
}
function finish(summary) {
  if (failures.length) {
    console.error(`FAIL [${setName}]: ${failures.length} problem(s)`);
    for (const f of failures) console.error(`  - ${f}`);
    process.exit(1);
  }
  console.log(summary);
  process.exit(0);
}

// ---- 3. values.schema.json -------------------------------------------------
const values = JSON.parse(fs.readFileSync(args.values, "utf8"));
const schema = JSON.parse(fs.readFileSync(args.schema, "utf8"));
const ajv = new Ajv({ allErrors: true, strict: false });
const validateValues = ajv.compile(schema);
const valuesOk = validateValues(values);
const schemaErrors = (validateValues.errors || []).map(
  (e) => `values${e.instancePath || ""} ${e.message}${e.params && e.params.additionalProperty ? ` '${e.params.additionalProperty}'` : ""}`
);
if (args["expect-schema-failure"]) {
  if (valuesOk) {
    fail("values.schema.json accepted values it should reject");
    finish("");
  }
  finish(`${setName}: values.schema.json rejects the values as expected:\n    ${schemaErrors.join("\n    ")}`);
}
if (!valuesOk) for (const e of schemaErrors) fail(`values.schema.json: ${e}`);

// ---- 1. YAML ------------------------------------------------------------------
const text = fs.readFileSync(args.manifests, "utf8");
const docs = YAML.parseAllDocuments(text, { uniqueKeys: true, prettyErrors: true });
const objects = [];
docs.forEach((d, i) => {
  for (const e of d.errors) fail(`YAML document ${i + 1}: ${e.message}`);
  for (const w of d.warnings) fail(`YAML document ${i + 1}: ${w.message}`);
  const o = d.toJS();
  if (o === null || o === undefined) return;
  const comments = `${d.commentBefore || ""}\n${(d.contents && d.contents.commentBefore) || ""}`;
  const src = (/Source: (\S+)/.exec(comments) || [])[1] || `document ${i + 1}`;
  objects.push({ obj: o, src });
});
check(objects.length > 0, "the chart rendered no objects");

// ---- 2. Kubernetes API schemas ----------------------------------------------------
function modelFor(apiVersion, kind) {
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : ["", apiVersion];
  if (group === "monitoring.coreos.com") {
    return need(`@kubernetes-models/prometheus-operator/${group}/${version}/${kind}`)[kind];
  }
  const mod = group ? `kubernetes-models/${group}/${version}/${kind}` : `kubernetes-models/${version}/${kind}`;
  try {
    return require(mod)[kind];
  } catch (e) {
    return null;
  }
}
const dns1123 = /^[a-z0-9]([-a-z0-9]*[a-z0-9])?$/;
const seen = new Set();
const counts = {};
for (const { obj, src } of objects) {
  const id = `${obj.kind || "?"}/${(obj.metadata && obj.metadata.name) || "?"} (${src})`;
  if (!check(obj.apiVersion && obj.kind, `${id}: no apiVersion or kind`)) continue;
  const Model = modelFor(obj.apiVersion, obj.kind);
  if (!check(Model, `${id}: ${obj.apiVersion} ${obj.kind} is not a known Kubernetes API type`)) continue;
  try {
    new Model(obj).validate();
  } catch (e) {
    fail(`${id}: invalid ${obj.apiVersion} ${obj.kind}: ${e.message}`);
  }
  const name = obj.metadata && obj.metadata.name;
  check(name && name.length <= 63 && dns1123.test(name), `${id}: metadata.name '${name}' is not a DNS-1123 label`);
  check(obj.metadata && obj.metadata.namespace, `${id}: no metadata.namespace`);
  const key = `${obj.apiVersion}/${obj.kind}/${name}`;
  check(!seen.has(key), `${id}: rendered twice`);
  seen.add(key);
  counts[obj.kind] = (counts[obj.kind] || 0) + 1;
}

// ---- 4. Behaviour -------------------------------------------------------------------
const byKind = (k) => objects.map((x) => x.obj).filter((o) => o.kind === k);
const matches = (selector, labels) =>
  !!selector && Object.keys(selector).length > 0 && Object.entries(selector).every(([k, v]) => labels && labels[k] === v);
function deepEqual(a, b) {
  return JSON.stringify(canon(a)) === JSON.stringify(canon(b));
}
function canon(v) {
  if (Array.isArray(v)) return v.map(canon);
  if (v && typeof v === "object") {
    const out = {};
    for (const k of Object.keys(v).sort()) out[k] = canon(v[k]);
    return out;
  }
  return v;
}
function definedFlags(file) {
  if (!file) return null;
  const src = fs.readFileSync(file, "utf8");
  const names = new Set(["flagfile"]);
  for (const m of src.matchAll(/ABSL_FLAG\(\s*[^,]+,\s*([a-z_0-9]+)\s*,/g)) names.add(m[1]);
  return names;
}
const shardFlags = definedFlags(args["shard-main"]);
const coordFlags = definedFlags(args["coord-main"]);
function parseFlags(text) {
  const flags = {};
  for (const line of text.split("\n")) {
    const t = line.trim();
    if (!t || t.startsWith("#")) continue;
    const m = /^--([a-z_0-9]+)(?:=(.*))?$/.exec(t);
    if (!m) {
      fail(`flag file line '${t}' is not --name=value`);
      continue;
    }
    flags[m[1]] = m[2] === undefined ? "true" : m[2];
  }
  return flags;
}

const configMaps = byKind("ConfigMap");
const flagFiles = {};
for (const cm of configMaps) for (const [k, v] of Object.entries(cm.data || {})) flagFiles[k] = v;
if (args["flags-out"]) {
  // The flag files as the pods see them, for the caller to run through the binaries.
  fs.mkdirSync(args["flags-out"], { recursive: true });
  for (const [k, v] of Object.entries(flagFiles)) fs.writeFileSync(path.join(args["flags-out"], k), v);
}

const workloads = [...byKind("DaemonSet"), ...byKind("StatefulSet")];
const podLabels = workloads.map((w) => w.spec.template.metadata.labels);
for (const w of workloads) {
  const id = `${w.kind} ${w.metadata.name}`;
  const tmpl = w.spec.template;
  expect(matches(w.spec.selector.matchLabels, tmpl.metadata.labels), `${id}: spec.selector does not select its own pods`);
  for (const c of tmpl.spec.containers) {
    const flagArg = (c.args || []).find((a) => a.startsWith("--flagfile=/etc/optimus/"));
    if (!expect(flagArg, `${id}: container ${c.name} does not read a flag file from /etc/optimus`)) continue;
    const fileName = path.basename(flagArg.split("=")[1]);
    const ftext = flagFiles[fileName];
    if (!expect(ftext !== undefined, `${id}: flag file ${fileName} is not in the ConfigMap`)) continue;
    const vol = tmpl.spec.volumes.find((v) => v.configMap && (v.configMap.items || []).some((i) => i.path === fileName));
    expect(vol && (c.volumeMounts || []).some((m) => m.name === vol.name && m.mountPath === "/etc/optimus"),
      `${id}: ${fileName} is not mounted at /etc/optimus`);
    const flags = parseFlags(ftext);
    const known = c.name === "optimus-shard" ? shardFlags : coordFlags;
    if (known) {
      for (const f of Object.keys(flags)) expect(known.has(f), `${id}: flag --${f} in ${fileName} is not defined by ${c.name}`);
    }
    const ck = values.checkpoints;
    if (ck && ck.enabled) {
      expect(flags.checkpoint_dir === ck.mountPath, `${id}: --checkpoint_dir=${flags.checkpoint_dir}, want the shared volume at ${ck.mountPath}`);
      const mount = (c.volumeMounts || []).find((m) => m.mountPath === ck.mountPath);
      const vol = mount && tmpl.spec.volumes.find((v) => v.name === mount.name);
      const claim = vol && vol.persistentVolumeClaim && vol.persistentVolumeClaim.claimName;
      const pvc = byKind("PersistentVolumeClaim").find((x) => x.metadata.name === claim);
      expect(claim && (ck.existingClaim ? claim === ck.existingClaim : pvc && pvc.spec.accessModes.includes("ReadWriteMany")),
        `${id}: ${ck.mountPath} is not the shared ReadWriteMany checkpoint claim (got ${claim})`);
    } else {
      expect(flags.checkpoint_dir === undefined, `${id}: --checkpoint_dir set although checkpoints.enabled is false`);
    }
    const metricsPort = Number(flags.metrics_port);
    expect(metricsPort > 0, `${id}: ${fileName} does not turn on --metrics_port, so /healthz does not exist`);
    const portByName = {};
    for (const p of c.ports || []) portByName[p.name] = p.containerPort;
    // Liveness must not depend on the coordinator (/healthz answers from the
    // process's own state); readiness does (/readyz).
    for (const [probeName, path] of [["livenessProbe", "/healthz"], ["readinessProbe", "/readyz"]]) {
      const probe = c[probeName];
      if (!expect(probe && probe.httpGet, `${id}: ${c.name} has no HTTP ${probeName}`)) continue;
      expect(probe.httpGet.path === path, `${id}: ${probeName} path is ${probe.httpGet.path}, not ${path}`);
      const port = typeof probe.httpGet.port === "string" ? portByName[probe.httpGet.port] : probe.httpGet.port;
      expect(port === metricsPort, `${id}: ${probeName} port ${port} is not --metrics_port=${metricsPort}`);
    }
    const ann = tmpl.metadata.annotations || {};
    if (values.metrics.podAnnotations) {
      expect(ann["prometheus.io/scrape"] === "true" && Number(ann["prometheus.io/port"]) === metricsPort,
        `${id}: prometheus.io annotations do not point at the metrics port ${metricsPort}`);
    }
    expect(c.resources && c.resources.requests && c.resources.limits, `${id}: ${c.name} has no resource requests and limits`);
    if (c.name === "optimus-shard") {
      const kind = flags.kind;
      expect(w.metadata.name.endsWith(`-shard-${kind}`), `${id}: runs --kind=${kind}`);
      const kv = values[kind];
      expect(Number(flags.memory_limit_mb) === kv.memoryLimitMb, `${id}: --memory_limit_mb=${flags.memory_limit_mb}, values say ${kv.memoryLimitMb}`);
      expect(/^[^:]+:[0-9]+$/.test(flags.coordinator || ""), `${id}: --coordinator='${flags.coordinator}' is not HOST:PORT`);
      if (values.coordinator.enabled) {
        const svc = byKind("Service").find((s) => flags.coordinator === `${s.metadata.name}.${s.metadata.namespace}.svc:${values.coordinator.port}`);
        expect(svc && svc.spec.clusterIP !== "None", `${id}: --coordinator=${flags.coordinator} is not the coordinator Service`);
      } else {
        expect(flags.coordinator === values.coordinatorAddress, `${id}: --coordinator=${flags.coordinator}, values say ${values.coordinatorAddress}`);
      }
      expect(deepEqual(tmpl.spec.nodeSelector || {}, kv.nodeSelector || {}), `${id}: nodeSelector ${JSON.stringify(tmpl.spec.nodeSelector)} differs from values ${kind}.nodeSelector`);
      expect(deepEqual(tmpl.spec.tolerations || [], kv.tolerations || []), `${id}: tolerations differ from values ${kind}.tolerations`);
      expect(deepEqual(tmpl.spec.affinity || {}, kv.affinity || {}), `${id}: affinity differs from values ${kind}.affinity`);
      expect(!!tmpl.spec.hostNetwork === !!kv.hostNetwork, `${id}: hostNetwork is ${!!tmpl.spec.hostNetwork}, values say ${!!kv.hostNetwork}`);
      if (kv.hostNetwork) expect(tmpl.spec.dnsPolicy === "ClusterFirstWithHostNet", `${id}: hostNetwork without dnsPolicy ClusterFirstWithHostNet cannot resolve the coordinator`);
      const rdmaLimit = c.resources.limits[kv.rdma.resourceName];
      if (kv.rdma.enabled) {
        expect(Number(rdmaLimit) === kv.rdma.count, `${id}: RDMA resource ${kv.rdma.resourceName} not requested`);
        expect(((c.securityContext.capabilities || {}).add || []).includes("IPC_LOCK"), `${id}: RDMA without IPC_LOCK`);
      } else {
        expect(rdmaLimit === undefined, `${id}: requests RDMA resource although ${kind}.rdma.enabled is false`);
      }
      if (kind === "dpu") {
        expect(tmpl.spec.nodeSelector && tmpl.spec.nodeSelector["kubernetes.io/arch"] === "arm64", `${id}: DPU shards are not pinned to arm64 nodes`);
      }
    }
  }
}

// Shard DaemonSets exist exactly for the enabled kinds.
for (const kind of ["dpu", "host"]) {
  const ds = byKind("DaemonSet").filter((d) => d.metadata.name.endsWith(`-shard-${kind}`));
  if (values[kind].enabled) {
    expect(ds.length === 1, `${kind}.enabled is true but ${ds.length} ${kind} shard DaemonSets rendered`);
    const pdb = byKind("PodDisruptionBudget").find((p) => ds[0] && matches(p.spec.selector.matchLabels, ds[0].spec.template.metadata.labels));
    if (values.podDisruptionBudget.shards.enabled) expect(pdb, `${kind} shards have no PodDisruptionBudget`);
  } else {
    expect(ds.length === 0, `${kind}.enabled is false but a ${kind} shard DaemonSet rendered`);
    expect(!(flagFiles[`shard-${kind}.flags`]), `${kind}.enabled is false but its flag file rendered`);
  }
}
const sts = byKind("StatefulSet");
if (values.coordinator.enabled) {
  if (expect(sts.length === 1, `coordinator.enabled is true but ${sts.length} StatefulSets rendered`)) {
    const s = sts[0];
    expect(s.spec.replicas === 1, "the coordinator StatefulSet must run exactly one replica");
    expect(byKind("Service").some((x) => x.metadata.name === s.spec.serviceName && x.spec.clusterIP === "None"),
      `StatefulSet serviceName ${s.spec.serviceName} is not a headless Service of the release`);
    if (values.coordinator.persistence.enabled) {
      const vct = (s.spec.volumeClaimTemplates || [])[0];
      expect(vct && vct.spec.resources.requests.storage === values.coordinator.persistence.size,
        "the coordinator has no PersistentVolumeClaim template of coordinator.persistence.size");
      expect(s.spec.template.spec.containers[0].volumeMounts.some((m) => vct && m.name === vct.metadata.name && m.mountPath === values.coordinator.persistence.mountPath),
        "the coordinator's claim is not mounted at coordinator.persistence.mountPath");
    }
    const coordFlagsFile = parseFlags(flagFiles["coordinator.flags"] || "");
    const mount = values.coordinator.persistence.mountPath.replace(/\/$/, "");
    expect((coordFlagsFile.state_dir || "").startsWith(`${mount}/`),
      `--state_dir=${coordFlagsFile.state_dir} is not on the coordinator's volume (${mount}): its state would not survive a restart`);
  }
} else {
  expect(sts.length === 0, "coordinator.enabled is false but a StatefulSet rendered");
}

// Every Service and PDB selects some pod of the release; ServiceMonitors select a Service with their port.
for (const s of byKind("Service")) {
  expect(podLabels.some((l) => matches(s.spec.selector, l)), `Service ${s.metadata.name} selects no pod of the release`);
}
for (const p of byKind("PodDisruptionBudget")) {
  expect(podLabels.some((l) => matches(p.spec.selector.matchLabels, l)), `PodDisruptionBudget ${p.metadata.name} selects no pod of the release`);
}
const serviceMonitors = byKind("ServiceMonitor");
expect((serviceMonitors.length > 0) === !!values.metrics.serviceMonitor.enabled,
  `metrics.serviceMonitor.enabled is ${values.metrics.serviceMonitor.enabled} but ${serviceMonitors.length} ServiceMonitors rendered`);
for (const m of serviceMonitors) {
  const svcs = byKind("Service").filter((s) => matches(m.spec.selector.matchLabels, s.metadata.labels) &&
    !(m.spec.selector.matchExpressions || []).some((e) => e.operator === "DoesNotExist" && s.metadata.labels[e.key] !== undefined));
  expect(svcs.length === 1, `ServiceMonitor ${m.metadata.name} selects ${svcs.length} Services, want 1`);
  for (const ep of m.spec.endpoints) {
    expect(svcs.every((s) => s.spec.ports.some((p) => p.name === ep.port)), `ServiceMonitor ${m.metadata.name}: port ${ep.port} not on the selected Service`);
    expect(ep.path === "/metrics", `ServiceMonitor ${m.metadata.name} scrapes ${ep.path}, not /metrics`);
  }
}
// The ServiceAccount the pods use exists (or is named by the user), with no RBAC.
for (const w of workloads) {
  const sa = w.spec.template.spec.serviceAccountName;
  if (values.serviceAccount.create) {
    expect(byKind("ServiceAccount").some((x) => x.metadata.name === sa), `${w.kind} ${w.metadata.name} uses ServiceAccount ${sa}, which is not rendered`);
  }
}
expect(!objects.some((x) => /^(Cluster)?Role(Binding)?$/.test(x.obj.kind)), "the chart renders RBAC, but the processes never call the Kubernetes API");

const countText = Object.keys(counts).sort().map((k) => `${k} ${counts[k]}`).join(", ");
finish(`${setName}: ${objects.length} objects valid against the Kubernetes API schemas (${countText}); ` +
  `values match values.schema.json; YAML parses with unique keys; ${behaviourChecks} behaviour checks passed`);
