#!/usr/bin/env node
// Validates one rendering of the optimus chart, offline:
//
//   node validate.js --set=NAME --manifests=FILE --values=FILE --schema=FILE
//                    --shard-main=server/main.cc --coord-main=coordinator/main.cc
//                    [--binaries=optimus-shard,optimus-coord] [--flags-out=DIR]
//                    [--hook-out=FILE] [--expect-schema-failure]
//
// 1. YAML: every document parses, with no duplicate keys.
// 2. Kubernetes API: every object validates against its API schema
//    (kubernetes-models; ServiceMonitor and PrometheusRule from
//    @kubernetes-models/prometheus-operator).
// 3. values.schema.json accepts the merged values (with --expect-schema-failure:
//    rejects them, and nothing else is checked).
// 4. Behaviour: workloads select their own pods, probes hit /healthz on the
//    metrics port the flags open, flag files use only flags the binaries
//    define, shard DaemonSets exist exactly for the enabled kinds and carry the
//    values' nodeSelector/affinity/tolerations, Services, PDBs and
//    ServiceMonitors select something. The PrometheusRule has exactly the
//    enabled alerts, only known fields, `for`/severity/thresholds from values,
//    every selector scoped to the release, and only metrics the binaries
//    (--binaries) export. The NetworkPolicies, evaluated as Kubernetes does,
//    let the shards, the test pod and the listed peers reach their ports and
//    keep other pods out, no rule admits every source, and UCX listens where
//    the policy opens. In etcd mode (coordinator.stateStore etcd): the
//    coordinators are a Deployment of coordinator.replicas advertising their
//    pod IP, behind a Service that routes to the ready leader only, given
//    etcd.endpoints or every member of the chart's etcd StatefulSet (which
//    forms one cluster, is probed on /health without liveness depending on
//    its quorum, and is reachable by the coordinators alone under the
//    NetworkPolicies). The `helm test` pod runs optimusctl status against the
//    coordinator the shards use, with the admin Secret under TLS (its command
//    is written to --hook-out for chart_test.sh to run).
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

const componentOf = (w) => w.spec.template.metadata.labels["app.kubernetes.io/component"];
const allWorkloads = [...byKind("DaemonSet"), ...byKind("StatefulSet"), ...byKind("Deployment")];
const podLabels = allWorkloads.map((w) => w.spec.template.metadata.labels);
// The optimus processes (flag files, /healthz and /readyz); the chart's etcd
// is checked on its own below.
const workloads = allWorkloads.filter((w) => componentOf(w) !== "etcd");
const coordSets = allWorkloads.filter((w) => componentOf(w) === "coordinator");
const etcdSets = allWorkloads.filter((w) => componentOf(w) === "etcd");
const coordStore = values.coordinator.stateStore || "file";
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
    // Arguments beside the flag file: flags the binary defines, expanding
    // (as Kubernetes does) only $(VAR)s the container's env sets.
    for (const a of (c.args || []).filter((x) => x !== flagArg)) {
      const m = /^--([a-z_0-9]+)=/.exec(a);
      if (!expect(m, `${id}: argument '${a}' is not --name=value`)) continue;
      if (known) expect(known.has(m[1]), `${id}: flag --${m[1]} on the command line is not defined by ${c.name}`);
      for (const v of a.matchAll(/\$\(([A-Za-z_0-9]+)\)/g)) {
        expect((c.env || []).some((e) => e.name === v[1]), `${id}: ${a} expands $(${v[1]}), which the container's env does not set`);
      }
    }
    if (c.name === "optimus-shard") {
      // The node is the failure domain a chunk's backup is placed outside of.
      const node = (c.env || []).find((e) => e.name === "OPTIMUS_NODE_NAME");
      expect(node && node.valueFrom && node.valueFrom.fieldRef && node.valueFrom.fieldRef.fieldPath === "spec.nodeName" &&
        (c.args || []).includes("--failure_domain=$(OPTIMUS_NODE_NAME)"),
        `${id}: optimus-shard is not given its node as --failure_domain`);
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
      expect(/^[^:,]+:[0-9]+(,[^:,]+:[0-9]+)*$/.test(flags.coordinator || ""), `${id}: --coordinator='${flags.coordinator}' is not HOST:PORT[,HOST:PORT...]`);
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
const sts = coordSets;
if (values.coordinator.enabled) {
  if (expect(coordSets.length === 1, `coordinator.enabled is true but ${coordSets.length} coordinator workloads rendered`) &&
      coordStore === "file") {
    const s = coordSets[0];
    expect(s.kind === "StatefulSet", `coordinator.stateStore file: the coordinator is a ${s.kind}, want a StatefulSet with its volume`);
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
    expect(etcdSets.length === 0, "coordinator.stateStore file but an etcd StatefulSet rendered");
  } else if (coordSets.length === 1) {
    // ---- etcd mode: a leader and standbys over etcd ----
    const s = coordSets[0];
    const ns = s.metadata.namespace;
    const want = values.coordinator.replicas || 2;
    expect(s.kind === "Deployment", `coordinator.stateStore etcd: the coordinator is a ${s.kind}, want a Deployment`);
    expect(s.spec.replicas === want, `the coordinator Deployment runs ${s.spec.replicas} pods, want ${want} (coordinator.replicas, default 2 in etcd mode)`);
    const c = s.spec.template.spec.containers[0];
    // Where it listens once it leads: its own pod IP.
    expect((c.args || []).includes(`--advertise_address=$(POD_IP):${values.coordinator.port}`),
      `the coordinator does not advertise $(POD_IP):${values.coordinator.port}: ${(c.args || []).join(" ")}`);
    const podIp = (c.env || []).find((e) => e.name === "POD_IP");
    expect(podIp && podIp.valueFrom && podIp.valueFrom.fieldRef && podIp.valueFrom.fieldRef.fieldPath === "status.podIP",
      "POD_IP is not the pod's IP (fieldRef status.podIP)");
    // The Service sends calls to the ready pod only: the leader.
    const svc = byKind("Service").find((x) => x.spec.clusterIP !== "None" && matches(x.spec.selector, s.spec.template.metadata.labels));
    expect(svc && !svc.spec.publishNotReadyAddresses, "no coordinator Service that routes to ready pods only (the leader)");
    expect(!byKind("Service").some((x) => x.spec.clusterIP === "None" && matches(x.spec.selector, s.spec.template.metadata.labels)),
      "etcd mode renders a headless Service for the coordinators: clients would reach standbys");
    const f = parseFlags(flagFiles["coordinator.flags"] || "");
    expect(f.state_dir === undefined, `etcd mode but --state_dir=${f.state_dir} set`);
    const prefix = values.etcd.prefix || `/optimus/${ns}/`;
    expect((f.etcd_prefix || "").startsWith(prefix), `--etcd_prefix=${f.etcd_prefix}, want ${prefix}...`);
    const eps = (f.etcd_endpoints || "").split(",");
    if (values.etcd.endpoints) {
      expect(f.etcd_endpoints === values.etcd.endpoints, `--etcd_endpoints=${f.etcd_endpoints}, values say ${values.etcd.endpoints}`);
      expect(etcdSets.length === 0, "etcd.endpoints is set but the chart's own etcd rendered too");
    } else if (expect(etcdSets.length === 1 && etcdSets[0].kind === "StatefulSet", `no etcd StatefulSet for etcd mode without etcd.endpoints (${etcdSets.length} rendered)`)) {
      const es = etcdSets[0];
      const ev = values.etcd.statefulSet;
      const eid = `StatefulSet ${es.metadata.name}`;
      expect(es.spec.replicas === ev.replicas, `${eid}: ${es.spec.replicas} members, values say ${ev.replicas}`);
      expect(matches(es.spec.selector.matchLabels, es.spec.template.metadata.labels), `${eid}: spec.selector does not select its own pods`);
      expect(es.spec.podManagementPolicy === "Parallel", `${eid}: members must start together (podManagementPolicy Parallel) to elect a leader`);
      const hs = byKind("Service").find((x) => x.metadata.name === es.spec.serviceName);
      expect(hs && hs.spec.clusterIP === "None" && hs.spec.publishNotReadyAddresses === true && matches(hs.spec.selector, es.spec.template.metadata.labels),
        `${eid}: serviceName ${es.spec.serviceName} is not a headless Service publishing its not-ready members`);
      // The coordinator is given every member by its stable name.
      const wantEps = [...Array(ev.replicas).keys()].map((i) => `${es.metadata.name}-${i}.${es.spec.serviceName}.${ns}.svc:${ev.clientPort}`);
      expect(deepEqual(eps, wantEps), `--etcd_endpoints=${f.etcd_endpoints}, want every member: ${wantEps.join(",")}`);
      const ec = es.spec.template.spec.containers[0];
      const arg = (name) => ((ec.args || []).find((a) => a.startsWith(`--${name}=`)) || "").slice(name.length + 3);
      const initial = arg("initial-cluster").split(",").filter(Boolean);
      expect(initial.length === ev.replicas && initial.every((m, i) =>
        m === `${es.metadata.name}-${i}=http://${es.metadata.name}-${i}.${es.spec.serviceName}.${ns}.svc:${ev.peerPort}`),
        `${eid}: --initial-cluster does not name every member at its peer port: ${initial.join(",")}`);
      expect(arg("name") === "$(POD_NAME)" && (ec.env || []).some((e) => e.name === "POD_NAME" && e.valueFrom && e.valueFrom.fieldRef.fieldPath === "metadata.name"),
        `${eid}: a member is not named after its pod`);
      const portByName = {};
      for (const p of ec.ports || []) portByName[p.name] = p.containerPort;
      expect(portByName.client === ev.clientPort && portByName.peer === ev.peerPort && portByName.metrics === ev.metricsPort,
        `${eid}: container ports ${JSON.stringify(portByName)} differ from values`);
      expect(arg("listen-metrics-urls").endsWith(`:${ev.metricsPort}`), `${eid}: /health is not served on the metrics port ${ev.metricsPort}`);
      const rp = ec.readinessProbe && ec.readinessProbe.httpGet;
      const lp = ec.livenessProbe && ec.livenessProbe.httpGet;
      expect(rp && rp.path === "/health" && (rp.port === "metrics" || rp.port === ev.metricsPort), `${eid}: readiness is not /health on the metrics port`);
      // Liveness must not depend on the quorum: /health fails without one.
      expect(lp && lp.path !== "/health", `${eid}: liveness probe missing or on /health (which fails whenever the quorum is lost)`);
      expect(ec.resources && ec.resources.requests && ec.resources.limits, `${eid}: no resource requests and limits`);
      if (ev.persistence.enabled) {
        const vct = (es.spec.volumeClaimTemplates || [])[0];
        expect(vct && vct.spec.resources.requests.storage === ev.persistence.size &&
          (ec.volumeMounts || []).some((m) => m.name === vct.metadata.name),
          `${eid}: no mounted volume claim template of etcd.statefulSet.persistence.size`);
      }
      if (values.podDisruptionBudget.etcd && values.podDisruptionBudget.etcd.enabled) {
        expect(byKind("PodDisruptionBudget").some((p) => matches(p.spec.selector.matchLabels, es.spec.template.metadata.labels)),
          `${eid}: no PodDisruptionBudget`);
      }
    }
  }
} else {
  expect(coordSets.length === 0 && etcdSets.length === 0, "coordinator.enabled is false but a coordinator or etcd workload rendered");
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
for (const w of allWorkloads) {
  const sa = w.spec.template.spec.serviceAccountName;
  if (values.serviceAccount.create) {
    expect(byKind("ServiceAccount").some((x) => x.metadata.name === sa), `${w.kind} ${w.metadata.name} uses ServiceAccount ${sa}, which is not rendered`);
  }
}
expect(!objects.some((x) => /^(Cluster)?Role(Binding)?$/.test(x.obj.kind)), "the chart renders RBAC, but the processes never call the Kubernetes API");

// ---- PrometheusRule: the alerts of values metrics.prometheusRule -------------------------
// The CRD's schema accepts unknown keys: a misspelt `for:` or `expr:` would
// pass it, so the keys are checked here (strict_fields.py skips custom resources).
const ruleKeys = {
  spec: ["groups"],
  group: ["name", "interval", "rules", "limit", "partial_response_strategy"],
  rule: ["alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"],
};
function strictKeys(obj, allowed, where) {
  if (!obj || typeof obj !== "object") return;
  for (const k of Object.keys(obj)) {
    expect(allowed.includes(k), `${where}: unknown field '${k}' (the PrometheusRule CRD has ${allowed.join(", ")})`);
  }
}
// Metric names the real binaries export (string literals in optimus-coord /
// optimus-shard), so that a rule on a renamed or misspelt metric fails here
// instead of never firing.
let exportedMetrics = null;
if (args.binaries) {
  exportedMetrics = new Set();
  for (const bin of args.binaries.split(",")) {
    const text = fs.readFileSync(bin).toString("latin1");
    for (const m of text.matchAll(/optimus_(?:coord|shard)_[a-z0-9_]+/g)) exportedMetrics.add(m[0]);
  }
}
const alertOf = {
  OptimusCoordinatorAbsent: "coordinatorAbsent",
  OptimusShardDown: "shardDown",
  OptimusReplicasDegraded: "replicasDegraded",
  OptimusReplicasOutOfSync: "replicasOutOfSync",
  OptimusCheckpointFailing: "checkpointFailing",
  OptimusCheckpointBehind: "checkpointBehind",
  OptimusStepLatencyHigh: "stepLatency",
};
const prValues = values.metrics.prometheusRule || {};
const promRules = byKind("PrometheusRule");
expect(promRules.length === (prValues.enabled ? 1 : 0),
  `metrics.prometheusRule.enabled is ${!!prValues.enabled} but ${promRules.length} PrometheusRules rendered`);
for (const pr of promRules) {
  const id = `PrometheusRule ${pr.metadata.name}`;
  for (const [k, v] of Object.entries(prValues.labels || {})) expect(pr.metadata.labels[k] === v, `${id}: label ${k}=${v} from values missing`);
  strictKeys(pr.spec, ruleKeys.spec, `${id} spec`);
  const sel = (prValues.selector || "").replace(/\{\{\s*\.Release\.Namespace\s*\}\}/g, pr.metadata.namespace).trim();
  const seenAlerts = new Set();
  for (const g of pr.spec.groups || []) {
    strictKeys(g, ruleKeys.group, `${id} group ${g.name}`);
    expect(Array.isArray(g.rules) && g.rules.length > 0, `${id} group ${g.name} has no rules`);
    for (const r of g.rules || []) {
      const rid = `${id} alert ${r.alert}`;
      strictKeys(r, ruleKeys.rule, rid);
      if (typeof r.expr !== "string") continue; // the schema check above reports it
      const key = alertOf[r.alert];
      if (!expect(key, `${rid}: not an alert the chart defines`)) continue;
      expect(!seenAlerts.has(r.alert), `${rid}: rendered twice`);
      seenAlerts.add(r.alert);
      const av = prValues.alerts[key];
      expect(av.enabled, `${rid} rendered although metrics.prometheusRule.alerts.${key}.enabled is false`);
      expect(r.for === av.for, `${rid}: for ${r.for}, values say ${av.for}`);
      expect(r.labels && r.labels.severity === av.severity, `${rid}: severity ${(r.labels || {}).severity}, values say ${av.severity}`);
      for (const [k, v] of Object.entries(prValues.alertLabels || {})) expect(r.labels[k] === v, `${rid}: alert label ${k}=${v} from values missing`);
      expect(r.annotations && r.annotations.summary && r.annotations.description, `${rid}: no summary or description`);
      // PromQL shape: balanced brackets, and every metric selector carries the release's matchers.
      const depth = { "(": 0, "{": 0, "[": 0 };
      const close = { ")": "(", "}": "{", "]": "[" };
      let balanced = true;
      for (const ch of r.expr.replace(/"(?:[^"\\]|\\.)*"/g, '""')) {
        if (ch in depth) depth[ch]++;
        else if (ch in close && --depth[close[ch]] < 0) balanced = false;
      }
      expect(balanced && Object.values(depth).every((d) => d === 0), `${rid}: unbalanced brackets in ${r.expr}`);
      const metrics = [...r.expr.matchAll(/\b(optimus_[a-z0-9_]+)(\{[^}]*\})?/g)];
      expect(metrics.length > 0, `${rid}: uses no optimus metric`);
      for (const [, name, matchers] of metrics) {
        if (sel) expect(matchers && matchers.includes(sel), `${rid}: ${name} is not scoped by the selector ${sel}`);
        if (exportedMetrics) {
          const base = name.replace(/_(bucket|sum|count)$/, "");
          expect(exportedMetrics.has(name) || exportedMetrics.has(base),
            `${rid}: metric ${name} is not exported by optimus-coord or optimus-shard`);
        }
      }
      if (key === "stepLatency") {
        expect(r.expr.includes(`histogram_quantile(${av.quantile},`) && r.expr.includes(`[${av.window}]`) &&
          new RegExp(`> ${String(av.thresholdSeconds).replace(".", "\\.")}$`).test(r.expr.trim()),
          `${rid}: expr does not use quantile ${av.quantile}, window ${av.window} and threshold ${av.thresholdSeconds} from values`);
      }
      if (key === "checkpointBehind") expect(r.expr.trim().endsWith(`> ${av.steps}`), `${rid}: threshold is not ${av.steps} steps`);
    }
  }
  const shardsOn = values.dpu.enabled || values.host.enabled;
  for (const [alert, key] of Object.entries(alertOf)) {
    const wanted = prValues.alerts[key].enabled && (key === "stepLatency" ? shardsOn : values.coordinator.enabled);
    expect(seenAlerts.has(alert) === !!wanted, `${id}: alert ${alert} ${wanted ? "missing" : "rendered"} (alerts.${key}.enabled=${prValues.alerts[key].enabled})`);
  }
}

// ---- NetworkPolicies: who reaches which port -------------------------------------------------
function selectorMatches(sel, labels) {
  if (!sel) return false;
  labels = labels || {};
  for (const [k, v] of Object.entries(sel.matchLabels || {})) if (labels[k] !== v) return false;
  for (const e of sel.matchExpressions || []) {
    const has = Object.prototype.hasOwnProperty.call(labels, e.key);
    if (e.operator === "In" && !(has && e.values.includes(labels[e.key]))) return false;
    if (e.operator === "NotIn" && has && e.values.includes(labels[e.key])) return false;
    if (e.operator === "Exists" && !has) return false;
    if (e.operator === "DoesNotExist" && has) return false;
  }
  return true;
}
// A source: {labels, namespace, nsLabels} for a pod, {ip} for an address.
function peerAdmits(peer, src, policyNs) {
  if (peer.ipBlock) {
    if (!src.ip) return false;
    if (peer.ipBlock.cidr.includes(":") || src.ip.includes(":")) return peer.ipBlock.cidr.split("/")[0] === src.ip;
    const [net, bits] = peer.ipBlock.cidr.split("/");
    const toInt = (a) => a.split(".").reduce((x, o) => x * 256 + Number(o), 0);
    const mask = Number(bits) === 0 ? 0 : 2 ** 32 - 2 ** (32 - Number(bits));
    return (toInt(src.ip) & mask) >>> 0 === (toInt(net) & mask) >>> 0;
  }
  if (!src.labels) return false;
  const nsOk = peer.namespaceSelector ? selectorMatches(peer.namespaceSelector, src.nsLabels) : src.namespace === policyNs;
  const podOk = peer.podSelector ? selectorMatches(peer.podSelector, src.labels) : true;
  return nsOk && podOk;
}
function portAdmits(ports, port) {
  if (!ports || ports.length === 0) return true;
  return ports.some((p) => (p.protocol || "TCP") === "TCP" &&
    (p.port === undefined || (p.endPort ? port >= p.port && port <= p.endPort : p.port === port)));
}
const policies = byKind("NetworkPolicy");
// Whether src reaches a pod with these labels on this TCP port (Kubernetes
// semantics: open when no policy selects the pod, else the union of the rules).
function reaches(src, podLabels, ns, port) {
  const selecting = policies.filter((p) => p.metadata.namespace === ns && selectorMatches(p.spec.podSelector, podLabels) &&
    (p.spec.policyTypes || ["Ingress"]).includes("Ingress"));
  if (selecting.length === 0) return true;
  return selecting.some((p) => (p.spec.ingress || []).some((r) =>
    portAdmits(r.ports, port) && (r.from === undefined || r.from.length === 0 || r.from.some((peer) => peerAdmits(peer, src, ns)))));
}
function ruleWithPeer(podLabels, ns, port, peer) {
  return policies.some((p) => p.metadata.namespace === ns && selectorMatches(p.spec.podSelector, podLabels) &&
    (p.spec.ingress || []).some((r) => portAdmits(r.ports, port) && (r.from || []).some((f) => deepEqual(f, peer))));
}
const np = values.networkPolicy || {};
expect((policies.length > 0) === !!np.enabled, `networkPolicy.enabled is ${!!np.enabled} but ${policies.length} NetworkPolicies rendered`);
for (const p of policies) {
  for (const [i, r] of (p.spec.ingress || []).entries()) {
    expect(Array.isArray(r.from) && r.from.length > 0, `NetworkPolicy ${p.metadata.name}: ingress rule ${i} has no 'from', so it admits every source`);
  }
}
if (np.enabled) {
  const nsOf = (o) => o.metadata.namespace;
  const stranger = (ns) => ({ labels: { app: "stranger" }, namespace: ns, nsLabels: { "kubernetes.io/metadata.name": ns } });
  const outsider = { labels: { app: "stranger", "optimus.dev/role": "worker" }, namespace: "elsewhere", nsLabels: { "kubernetes.io/metadata.name": "elsewhere" } };
  const hookPod = objects.map((x) => x.obj).find((o) => o.kind === "Pod" && (o.metadata.annotations || {})["helm.sh/hook"] === "test");
  const shardSets = byKind("DaemonSet").filter((d) => d.metadata.name.includes("-shard-"));
  const range = (values.shard.ucxTcpPortRange || "").split("-").map(Number);
  const dataPort = range.length === 2 ? range[0] : 40123; // any port when no range is set
  const cidrIp = (c) => (c.includes(":") ? c.split("/")[0] : c.split("/")[0].replace(/\.0$/, ".7"));
  // A source that a peer of values admits (null for selectors by expression).
  const srcForPeer = (peer, ns) => {
    if (peer.ipBlock) return { ip: cidrIp(peer.ipBlock.cidr) };
    const sels = [peer.podSelector, peer.namespaceSelector].filter(Boolean);
    if (sels.some((x) => (x.matchExpressions || []).length)) return null;
    return {
      labels: (peer.podSelector && peer.podSelector.matchLabels) || { app: "any" },
      namespace: peer.namespaceSelector ? "peer-namespace" : ns,
      nsLabels: peer.namespaceSelector ? peer.namespaceSelector.matchLabels || {} : { "kubernetes.io/metadata.name": ns },
    };
  };
  const srcOfSet = (d) => (d.spec.template.spec.hostNetwork
    ? (np.hostNetworkCIDRs || []).length ? { ip: cidrIp(np.hostNetworkCIDRs[0]) } : null
    : { labels: d.spec.template.metadata.labels, namespace: nsOf(d), nsLabels: { "kubernetes.io/metadata.name": nsOf(d) } });
  for (const s of sts) {
    const labels = s.spec.template.metadata.labels;
    const ns = nsOf(s);
    const grpc = values.coordinator.port;
    const metricsPort = values.coordinator.metricsPort;
    for (const d of shardSets) {
      const src = srcOfSet(d);
      expect(src && reaches(src, labels, ns, grpc), `NetworkPolicy: the ${d.metadata.name} shards cannot reach the coordinator's gRPC port ${grpc}`);
    }
    if (hookPod) expect(reaches({ labels: hookPod.metadata.labels, namespace: ns, nsLabels: {} }, labels, ns, grpc), "NetworkPolicy: the helm test pod cannot reach the coordinator's gRPC port");
    for (const peer of [...(np.workers || []), ...(np.coordinatorClients || [])]) {
      expect(ruleWithPeer(labels, ns, grpc, peer), `NetworkPolicy: the coordinator's gRPC port does not admit ${JSON.stringify(peer)} from values`);
      const src = srcForPeer(peer, ns);
      if (src) expect(reaches(src, labels, ns, grpc), `NetworkPolicy: ${JSON.stringify(peer)} cannot reach the coordinator's gRPC port`);
    }
    for (const peer of np.metrics || []) expect(ruleWithPeer(labels, ns, metricsPort, peer), `NetworkPolicy: the coordinator's metrics port does not admit ${JSON.stringify(peer)}`);
    for (const [port, peers] of [[grpc, [...(np.workers || []), ...(np.coordinatorClients || [])]], [metricsPort, np.metrics || []]]) {
      for (const src of [stranger(ns), outsider]) {
        const listed = peers.some((p) => peerAdmits(p, src, ns));
        expect(reaches(src, labels, ns, port) === listed,
          `NetworkPolicy: a pod ${JSON.stringify(src.labels)} of namespace ${src.namespace} ${listed ? "cannot reach" : "reaches"} the coordinator on port ${port}`);
      }
    }
  }
  for (const es of etcdSets) {
    const labels = es.spec.template.metadata.labels;
    const ns = nsOf(es);
    const ev = values.etcd.statefulSet;
    for (const s of coordSets) {
      expect(reaches({ labels: s.spec.template.metadata.labels, namespace: ns, nsLabels: {} }, labels, ns, ev.clientPort),
        `NetworkPolicy: the coordinators cannot reach etcd's client port ${ev.clientPort}`);
    }
    expect(reaches({ labels, namespace: ns, nsLabels: {} }, labels, ns, ev.peerPort), `NetworkPolicy: etcd members cannot reach each other's peer port ${ev.peerPort}`);
    for (const d of shardSets) {
      const src = srcOfSet(d);
      if (src) expect(!reaches(src, labels, ns, ev.clientPort), `NetworkPolicy: the ${d.metadata.name} shards reach etcd, which only the coordinators use`);
    }
    for (const src of [stranger(ns), outsider]) {
      for (const port of [ev.clientPort, ev.peerPort]) {
        expect(!reaches(src, labels, ns, port), `NetworkPolicy: a pod ${JSON.stringify(src.labels)} of namespace ${src.namespace} reaches etcd on port ${port}`);
      }
    }
  }
  for (const d of shardSets) {
    const labels = d.spec.template.metadata.labels;
    const ns = nsOf(d);
    if (d.spec.template.spec.hostNetwork) continue; // a NetworkPolicy does not apply to hostNetwork pods
    for (const other of shardSets) {
      const src = srcOfSet(other);
      expect(src && reaches(src, labels, ns, dataPort), `NetworkPolicy: ${other.metadata.name} cannot reach ${d.metadata.name}'s data plane (port ${dataPort})`);
    }
    for (const peer of np.workers || []) expect(ruleWithPeer(labels, ns, dataPort, peer), `NetworkPolicy: ${d.metadata.name}'s data plane does not admit worker ${JSON.stringify(peer)}`);
    for (const peer of np.metrics || []) expect(ruleWithPeer(labels, ns, values.shard.metricsPort, peer), `NetworkPolicy: ${d.metadata.name}'s metrics port does not admit ${JSON.stringify(peer)}`);
    const allPorts = range.length !== 2;
    for (const [port, peers] of [[dataPort, np.workers || []], [values.shard.metricsPort, [...(np.metrics || []), ...(allPorts ? np.workers || [] : [])]]]) {
      for (const src of [stranger(ns), outsider]) {
        const listed = peers.some((p) => peerAdmits(p, src, ns));
        expect(reaches(src, labels, ns, port) === listed,
          `NetworkPolicy: a pod ${JSON.stringify(src.labels)} of namespace ${src.namespace} ${listed ? "cannot reach" : "reaches"} ${d.metadata.name} on port ${port}`);
      }
    }
    // A source each worker peer describes reaches the data plane: with a port
    // range, on its ends and not next to them.
    for (const peer of np.workers || []) {
      const src = srcForPeer(peer, ns);
      if (!src) continue;
      expect(reaches(src, labels, ns, dataPort), `NetworkPolicy: worker ${JSON.stringify(peer)} cannot reach ${d.metadata.name}'s data plane`);
      if (range.length === 2) {
        expect(reaches(src, labels, ns, range[1]) && !reaches(src, labels, ns, range[0] - 1) && !reaches(src, labels, ns, range[1] + 1),
          `NetworkPolicy: ${d.metadata.name}'s data plane is not limited to shard.ucxTcpPortRange ${values.shard.ucxTcpPortRange}`);
      }
    }
  }
}
// The shards' UCX tcp ports: what the NetworkPolicy opens is what UCX listens on.
for (const d of byKind("DaemonSet")) {
  const c = d.spec.template.spec.containers[0];
  const env = (c.env || []).find((e) => e.name === "UCX_TCP_PORT_RANGE");
  expect((env && env.value) === (values.shard.ucxTcpPortRange || undefined),
    `DaemonSet ${d.metadata.name}: UCX_TCP_PORT_RANGE is ${env && env.value}, values shard.ucxTcpPortRange say '${values.shard.ucxTcpPortRange}'`);
}

// ---- `helm test`: optimusctl status against the coordinator the shards use -------------------
const hooks = byKind("Pod").filter((p) => (p.metadata.annotations || {})["helm.sh/hook"] === "test");
expect(hooks.length === (values.tests.enabled ? 1 : 0), `tests.enabled is ${values.tests.enabled} but ${hooks.length} helm test pods rendered`);
for (const h of hooks) {
  const id = `test pod ${h.metadata.name}`;
  expect(h.spec.restartPolicy === "Never", `${id}: restartPolicy ${h.spec.restartPolicy}, a test pod must run once`);
  const c = h.spec.containers[0];
  const cmd = [...(c.command || []), ...(c.args || [])];
  expect(cmd[0] === "/usr/local/bin/optimusctl" && cmd[cmd.length - 1] === "status", `${id}: does not run optimusctl ... status: ${cmd.join(" ")}`);
  if (sts[0]) expect(c.image === sts[0].spec.template.spec.containers[0].image, `${id}: image ${c.image} is not the coordinator image (which has optimusctl)`);
  const coordArg = cmd.find((a) => a.startsWith("--coordinator="));
  const shardCoord = Object.entries(flagFiles).filter(([k]) => k.startsWith("shard-")).map(([, v]) => parseFlags(v).coordinator);
  const want = values.coordinator.enabled
    ? `${byKind("Service").find((s) => s.spec.clusterIP !== "None" && s.metadata.name.endsWith("-coord")).metadata.name}.${h.metadata.namespace}.svc:${values.coordinator.port}`
    : values.coordinatorAddress;
  expect(coordArg === `--coordinator=${want}`, `${id}: ${coordArg}, want --coordinator=${want}`);
  for (const a of shardCoord) expect(`--coordinator=${a}` === coordArg, `${id}: checks ${coordArg} but the shards register with ${a}`);
  const tlsArg = cmd.find((a) => a.startsWith("--tls_dir="));
  if (values.tls.enabled) {
    const dir = tlsArg && tlsArg.split("=")[1];
    const mount = (c.volumeMounts || []).find((m) => m.mountPath === dir);
    const vol = mount && h.spec.volumes.find((v) => v.name === mount.name);
    expect(!cmd.includes("--insecure_plaintext"), `${id}: --insecure_plaintext although tls.enabled`);
    expect(vol && vol.secret && vol.secret.secretName === values.tls.adminSecret,
      `${id}: tls.enabled but --tls_dir (${dir}) is not the admin Secret ${values.tls.adminSecret}`);
  } else {
    expect(cmd.includes("--insecure_plaintext") && !tlsArg, `${id}: tls.enabled is false but optimusctl does not run --insecure_plaintext`);
  }
  if (args["hook-out"]) fs.writeFileSync(args["hook-out"], cmd.join("\n") + "\n");
}

const countText = Object.keys(counts).sort().map((k) => `${k} ${counts[k]}`).join(", ");
finish(`${setName}: ${objects.length} objects valid against the Kubernetes API schemas (${countText}); ` +
  `values match values.schema.json; YAML parses with unique keys; ${behaviourChecks} behaviour checks passed`);
