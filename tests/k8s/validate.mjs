// validate.mjs - checks tqkv's deployment artefacts (run by tests/k8s/run.sh from CTest).
//
//   node validate.mjs k8s         render every kustomization with `kubectl kustomize`,
//                                 validate each object against the Kubernetes API schemas
//                                 (kubernetes-models, @kubernetes-models/prometheus-operator,
//                                 @kubernetes-models/cert-manager) plus a strict
//                                 unknown-field check, then the invariants: among them
//                                 secure by default (TLS and tokens from Secrets, mounted
//                                 so that rotation reaches the server; a NetworkPolicy
//                                 admitting only labelled clients to gRPC/data and only the
//                                 monitoring namespace to metrics; insecure-dev says what it
//                                 turns off; hand-off and forwarding on, to peers over
//                                 TLS with the peer token, in clear only on insecure-dev),
//                                 and deploy/k8s/trial-secrets.sh's output
//                                 accepted by the real server (TLS on gRPC and, where on,
//                                 on the TCP data channels)
//   node validate.mjs dockerfile  deploy/Dockerfile and .dockerignore
//   node validate.mjs grafana     deploy/grafana/tqkv-dashboard.json
//
// Environment: TQKV_SOURCE_DIR (repo root; default ../..), TQKV_SERVER (a built
// tqkv-server: its --help is the list of TQKV_* variables; otherwise the option table in
// service/config.c is read), KUBECTL (default kubectl).
//
// Every failure is printed as "FAIL <where>: <what>"; the exit status is 1 if any.
import { execFileSync, spawn } from "node:child_process";
import http from "node:http";
import tls from "node:tls";
import { existsSync, mkdtempSync, readFileSync, rmSync, statSync, writeFileSync } from "node:fs";
import os from "node:os";
import { tmpdir } from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const root = path.resolve(process.env.TQKV_SOURCE_DIR || path.join(here, "..", ".."));
const kubectl = process.env.KUBECTL || "kubectl";

let failures = 0;
let checks = 0;
function fail(where, what) {
  failures++;
  console.log(`FAIL ${where}: ${what}`);
}
function expect(cond, where, what) {
  checks++;
  if (!cond) fail(where, what);
  return !!cond;
}

// ---------------------------------------------------------------- helpers

const BYTE_SUFFIX = { "": 0, K: 10, M: 20, G: 30, T: 40 };
// tqkv-server byte counts: digits with an optional K/M/G/T (powers of 1024), "i", "B".
function parseServerBytes(s) {
  const m = /^(\d+)([KMGT]?)(i?)(B?)$/i.exec(String(s));
  if (!m || (m[3] && !m[2])) return null;
  return Number(m[1]) * 2 ** BYTE_SUFFIX[m[2].toUpperCase()];
}

// Kubernetes resource.Quantity for memory, in bytes.
function parseQuantity(q) {
  const m = /^([0-9.]+)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?$/.exec(String(q));
  if (!m) return null;
  const mult = {
    undefined: 1, Ki: 2 ** 10, Mi: 2 ** 20, Gi: 2 ** 30, Ti: 2 ** 40, Pi: 2 ** 50, Ei: 2 ** 60,
    k: 1e3, M: 1e6, G: 1e9, T: 1e12, P: 1e15, E: 1e18, m: 1e-3,
  }[m[2]];
  return Number(m[1]) * mult;
}

function hostPort(s) {
  const m = /^(\[[^\]]+\]|[^:]+):(\d+)$/.exec(String(s));
  return m ? { host: m[1], port: Number(m[2]) } : null;
}

function selects(selector, labels) {
  if (!selector || !labels) return false;
  const keys = Object.keys(selector);
  return keys.length > 0 && keys.every((k) => labels[k] === selector[k]);
}

function sh(cmd, args, opts = {}) {
  return execFileSync(cmd, args, { encoding: "utf8", stdio: ["ignore", "pipe", "pipe"], ...opts });
}

// The TQKV_* variables tqkv-server understands.
function serverEnvVars() {
  const bin = process.env.TQKV_SERVER;
  if (bin && existsSync(bin)) {
    let help = "";
    try {
      help = sh(bin, ["--help"]);
    } catch (e) {
      help = (e.stdout || "") + (e.stderr || "");
    }
    const vars = new Set([...help.matchAll(/\[(TQKV_[A-Z0-9_]+)\]/g)].map((m) => m[1]));
    if (vars.size > 0) return { vars, from: `${bin} --help` };
    fail("server", `${bin} --help lists no [TQKV_*] variables`);
  }
  const src = path.join(root, "service", "config.c");
  if (!existsSync(src)) {
    fail("server", "neither TQKV_SERVER nor service/config.c is available to list TQKV_* variables");
    return { vars: new Set(), from: "nothing" };
  }
  const text = readFileSync(src, "utf8");
  const vars = new Set([...text.matchAll(/\{"[a-z0-9-]+",\s*"(TQKV_[A-Z0-9_]+)"/g)].map((m) => m[1]));
  return { vars, from: "service/config.c" };
}

// Metric names the server exposes: the families rendered by service/metrics.c (with
// the histogram series suffixes).
function knownMetrics() {
  const src = readFileSync(path.join(root, "service", "metrics.c"), "utf8");
  const families = new Set([...src.matchAll(/"((?:tqkv|process)_[a-z0-9_]+)/g)].map((m) => m[1].replace(/_$/, "")));
  const known = new Set();
  for (const f of families) {
    known.add(f);
    for (const s of ["_bucket", "_sum", "_count"]) known.add(f + s);
  }
  return known;
}

// Checks a PromQL expression: balanced brackets, only metrics the server exports.
function checkPromQL(where, expr, known) {
  let depth = 0;
  for (const ch of expr) {
    if ("({[".includes(ch)) depth++;
    if (")}]".includes(ch)) depth--;
    if (depth < 0) break;
  }
  expect(depth === 0, where, `unbalanced brackets in ${expr}`);
  const stripped = expr.replace(/"[^"]*"/g, '""');
  for (const m of stripped.matchAll(/\b((?:tqkv|process)_[a-z0-9_]+)\b/g))
    expect(known.has(m[1]), where, `metric ${m[1]} is not exported by service/metrics.c`);
  // The tenant label is "tenant"; "namespace" is the Kubernetes label Prometheus attaches.
  expect(!/\btqkv_namespace_/.test(stripped), where, "tqkv_namespace_* was renamed tqkv_tenant_*");
}

// Parses PromQL with Prometheus' own parser: `promtool check rules` on a rule file holding
// the expressions (Grafana variables replaced by values of the right type). promtool has
// no bare query check; a recording rule per expression is the nearest. Returns the number
// of expressions checked.
function promtoolParse(where, exprs) {
  const promtool = process.env.PROMTOOL || "promtool";
  try {
    sh(promtool, ["--version"]);
  } catch {
    fail(where, `${promtool} not found: install the Debian package prometheus (deploy/install-deps.sh)`);
    return 0;
  }
  const subst = (e) => e.replace(/\$__rate_interval|\$__interval|\$__range/g, "5m").replace(/\$\{?[A-Za-z_][A-Za-z0-9_]*\}?/g, ".*");
  const rules = exprs.map((e, i) => `      - record: tqkv:check_${i}\n        expr: ${JSON.stringify(subst(e))}`);
  const file = path.join(mkdtempSync(path.join(tmpdir(), "tqkv-promql-")), "rules.yaml");
  writeFileSync(file, `groups:\n  - name: check\n    rules:\n${rules.join("\n")}\n`);
  try {
    sh(promtool, ["check", "rules", file]);
    checks += exprs.length;
  } catch (e) {
    fail(where, `promtool check rules: ${((e.stdout || "") + (e.stderr || "")).trim().split("\n").slice(-4).join(" | ")}`);
  } finally {
    rmSync(path.dirname(file), { recursive: true, force: true });
  }
  return exprs.length;
}

// ---------------------------------------------------------------- schema validation

const MODEL_PACKAGES = {
  "monitoring.coreos.com": "@kubernetes-models/prometheus-operator",
  "cert-manager.io": "@kubernetes-models/cert-manager",
};

async function modelClass(apiVersion, kind) {
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : ["", apiVersion];
  const pkg = MODEL_PACKAGES[group] || "kubernetes-models";
  const spec = group ? `${pkg}/${group}/${version}/${kind}` : `${pkg}/${version}/${kind}`;
  try {
    const mod = await import(spec);
    return mod[kind] || mod.default;
  } catch (e) {
    return null;
  }
}

// Wraps obj so that every property the schema validator reads is recorded. An object
// whose keys the validator enumerated (maps: labels, data, ...) is wholly "read".
function tracked(obj, seen, p = "") {
  if (obj === null || typeof obj !== "object") return obj;
  const rec = { read: new Set(), enumerated: false, obj };
  seen.set(p, rec);
  return new Proxy(obj, {
    get(t, k, r) {
      if (typeof k === "string") rec.read.add(k);
      const v = Reflect.get(t, k, r);
      if (typeof k === "string" && v !== null && typeof v === "object" && Object.hasOwn(t, k))
        return tracked(v, seen, `${p}/${k}`);
      return v;
    },
    has(t, k) {
      if (typeof k === "string") rec.read.add(k);
      return Reflect.has(t, k);
    },
    ownKeys(t) {
      rec.enumerated = true;
      return Reflect.ownKeys(t);
    },
  });
}

// The schemas of the Kubernetes API do not forbid unknown fields (the API server drops
// or, with fieldValidation=Strict, rejects them); a typo like "replica:" would pass the
// plain schema check. Reports every key the validator never looked at.
function unknownFields(Model, obj) {
  const seen = new Map();
  const inst = new Model(JSON.parse(JSON.stringify(obj)));
  const data = JSON.parse(JSON.stringify(inst));
  Model.prototype.validate.call(tracked(data, seen));
  const out = [];
  for (const [p, rec] of seen) {
    if (rec.enumerated || Array.isArray(rec.obj)) continue;
    for (const k of Object.keys(rec.obj)) if (!rec.read.has(k)) out.push(`${p}/${k}`);
  }
  return out;
}

async function validateSchema(label, objs) {
  for (const o of objs) {
    const where = `${label} ${o.kind}/${o.metadata?.name}`;
    const Model = await modelClass(o.apiVersion, o.kind);
    if (!expect(Model, where, `no schema for ${o.apiVersion} ${o.kind}`)) continue;
    try {
      new Model(o).validate();
      checks++;
    } catch (e) {
      fail(where, `schema: ${e.message}`);
      continue;
    }
    const unknown = unknownFields(Model, o);
    expect(unknown.length === 0, where, `unknown fields ${unknown.join(", ")}`);
  }
}

// ---------------------------------------------------------------- k8s

function render(dir) {
  const abs = path.join(root, "deploy", "k8s", dir);
  let out;
  try {
    out = sh(kubectl, ["kustomize", abs]);
  } catch (e) {
    fail(`kustomize ${dir}`, (e.stderr || e.message).trim().split("\n").slice(-3).join(" | "));
    return null;
  }
  return out;
}

async function parseDocs(text) {
  const YAML = (await import("yaml")).default;
  return YAML.parseAllDocuments(text)
    .map((d) => {
      if (d.errors.length) throw new Error(d.errors.map(String).join("; "));
      return d.toJS();
    })
    .filter((o) => o);
}

function podSecurity(where, podSpec, containers) {
  const psc = podSpec.securityContext || {};
  expect(psc.seccompProfile?.type === "RuntimeDefault", where, "pod seccompProfile RuntimeDefault");
  expect(podSpec.automountServiceAccountToken === false, where, "automountServiceAccountToken false");
  for (const c of containers) {
    const cw = `${where} container ${c.name}`;
    const sc = c.securityContext || {};
    const nonRoot = sc.runAsNonRoot ?? psc.runAsNonRoot;
    const uid = sc.runAsUser ?? psc.runAsUser;
    expect(nonRoot === true, cw, "runAsNonRoot must be true");
    expect(uid === 65532, cw, `runAsUser must be 65532 (image user), got ${uid}`);
    expect(sc.readOnlyRootFilesystem === true, cw, "readOnlyRootFilesystem must be true");
    expect(sc.allowPrivilegeEscalation === false, cw, "allowPrivilegeEscalation must be false");
    expect(sc.privileged !== true, cw, "must not be privileged");
    expect((sc.capabilities?.drop || []).includes("ALL"), cw, "capabilities.drop must include ALL");
    expect(!(sc.capabilities?.add || []).length, cw, "no added capabilities");
    const seccomp = sc.seccompProfile?.type ?? psc.seccompProfile?.type;
    expect(seccomp === "RuntimeDefault", cw, "seccompProfile RuntimeDefault");
    const r = c.resources || {};
    for (const k of ["cpu", "memory"]) {
      expect(r.requests?.[k] !== undefined, cw, `resources.requests.${k} must be set`);
      expect(r.limits?.[k] !== undefined, cw, `resources.limits.${k} must be set`);
    }
    const rq = parseQuantity(r.requests?.memory);
    const lm = parseQuantity(r.limits?.memory);
    expect(rq !== null && lm !== null && rq <= lm, cw, "memory request <= limit");
  }
}

function checkServer(variant, objs, envVars) {
  const W = `overlays/${variant}`;
  const byKind = (k) => objs.filter((o) => o.kind === k);
  const sts = byKind("StatefulSet");
  if (!expect(sts.length === 1, W, `exactly one StatefulSet, got ${sts.length}`)) return;
  const ss = sts[0];
  const ws = `${W} StatefulSet/${ss.metadata.name}`;
  expect(ss.metadata.name === "tqkv", ws, "named tqkv");
  expect(ss.spec.replicas === 3, ws, `replicas 3, got ${ss.spec.replicas}`);
  expect(ss.spec.podManagementPolicy === "Parallel", ws, "podManagementPolicy Parallel");
  const podLabels = ss.spec.template.metadata?.labels || {};
  expect(selects(ss.spec.selector?.matchLabels, podLabels), ws, "selector matches the pod labels");
  const pod = ss.spec.template.spec;
  const containers = pod.containers || [];
  podSecurity(ws, pod, [...containers, ...(pod.initContainers || [])]);
  expect(pod.enableServiceLinks === false, ws,
    "enableServiceLinks false (Service 'tqkv' would inject TQKV_* variables)");
  const spread = (pod.topologySpreadConstraints || []).length > 0;
  const anti = !!pod.affinity?.podAntiAffinity;
  expect(spread || anti, ws, "topologySpreadConstraints or podAntiAffinity");
  for (const t of pod.topologySpreadConstraints || [])
    expect(selects(t.labelSelector?.matchLabels, podLabels), ws, `spread on ${t.topologyKey} selects the pods`);

  const c = containers.find((x) => x.name === "tqkv");
  if (!expect(c, ws, "a container named tqkv")) return;
  const cw = `${ws} container tqkv`;
  const ports = Object.fromEntries((c.ports || []).map((p) => [p.name, p.containerPort]));
  expect(ports.grpc === 50051, cw, "port grpc 50051");
  expect(ports.metrics === 9090, cw, "port metrics 9090");
  // The kubelet's gRPC probes cannot speak TLS: HTTP probes on the metrics port, where
  // /readyz follows the KV service's health (503 while draining).
  const probes = { startupProbe: "/livez", livenessProbe: "/livez", readinessProbe: "/readyz" };
  for (const [name, want] of Object.entries(probes)) {
    const p = c[name];
    if (!expect(p?.httpGet, cw, `${name} must be an httpGet probe (gRPC probes cannot do TLS)`)) continue;
    expect(p.httpGet.port === "metrics" || p.httpGet.port === ports.metrics, cw, `${name} on the metrics port`);
    expect(p.httpGet.path === want, cw, `${name} path ${want}`);
    expect((p.httpGet.scheme ?? "HTTP") === "HTTP", cw, `${name} scheme HTTP`);
    expect(!p.grpc && !p.tcpSocket && !p.exec, cw, `${name} has only the httpGet handler`);
  }
  expect(c.readinessProbe?.periodSeconds <= 10, cw, "readiness checked at least every 10 s");

  // ConfigMap(s) given to the container, with kustomize's hash suffix.
  const cms = byKind("ConfigMap");
  const env = {};
  for (const ef of c.envFrom || []) {
    if (!ef.configMapRef) continue;
    const cm = cms.find((m) => m.metadata.name === ef.configMapRef.name);
    if (!expect(cm, cw, `envFrom ConfigMap ${ef.configMapRef.name} is rendered`)) continue;
    expect(/^tqkv-config(-[a-z0-9]+)?$/.test(cm.metadata.name), cw, "ConfigMap is tqkv-config");
    Object.assign(env, cm.data || {});
  }
  for (const e of c.env || []) if (e.value !== undefined) env[e.name] = e.value;
  expect(Object.keys(env).length > 0, cw, "configured from the tqkv-config ConfigMap");
  for (const [k, v] of Object.entries(env)) {
    expect(k.startsWith("TQKV_"), cw, `config key ${k} is not a TQKV_* variable`);
    expect(envVars.vars.has(k), cw, `${k} is not a variable tqkv-server understands (per ${envVars.from})`);
    expect(String(v).length > 0, cw, `${k} is empty (the server rejects empty values)`);
  }
  for (const e of c.env || [])
    expect(e.name.startsWith("TQKV_") ? envVars.vars.has(e.name) : true, cw, `env ${e.name} unknown`);
  // The flags the image adds would override the ConfigMap's listen addresses.
  expect(JSON.stringify(c.command) === JSON.stringify(["/usr/local/bin/tqkv-server"]), cw,
    "command is the bare server (the image ENTRYPOINT's flags would win over TQKV_LISTEN)");
  expect(!(c.args || []).length, cw, "no args: the ConfigMap is the configuration");
  const listen = hostPort(env.TQKV_LISTEN);
  expect(listen && listen.port === ports.grpc, cw, `TQKV_LISTEN port is the grpc port (${env.TQKV_LISTEN})`);
  expect(listen && listen.host === "0.0.0.0", cw, "TQKV_LISTEN on 0.0.0.0 (probes and Services reach the pod IP)");
  if (env.TQKV_DATA_LISTEN !== undefined) {
    const dl = hostPort(env.TQKV_DATA_LISTEN);
    expect(dl && dl.port === ports.data, cw, `TQKV_DATA_LISTEN port is the data container port (${env.TQKV_DATA_LISTEN})`);
    expect(dl && dl.host === "0.0.0.0", cw, "TQKV_DATA_LISTEN on 0.0.0.0 (clients reach the pod IP)");
    expect(ports.data === 50052, cw, "port data 50052 (the NetworkPolicy's data port)");
  }
  const ml = hostPort(env.TQKV_METRICS_LISTEN);
  expect(ml && ml.port === ports.metrics, cw, `TQKV_METRICS_LISTEN port is the metrics port (${env.TQKV_METRICS_LISTEN})`);
  for (const k of ["TQKV_DRAM_CAPACITY", "TQKV_HBM_CAPACITY", "TQKV_MAX_MESSAGE_BYTES", "TQKV_NS_QUOTA"])
    if (env[k] !== undefined) expect(parseServerBytes(env[k]) !== null, cw, `${k}=${env[k]} is not a byte count`);
  for (const k of ["TQKV_KEY_BITS", "TQKV_VALUE_BITS", "TQKV_BOUNDARY_KEY_BITS", "TQKV_BOUNDARY_VALUE_BITS"])
    if (env[k] !== undefined)
      expect(["1", "1.5", "2", "2.5", "3", "3.5", "4"].includes(String(env[k])), cw, `${k}=${env[k]}`);
  for (const k of ["TQKV_THREADS", "TQKV_ENCODER_THREADS", "TQKV_DRAIN_SECONDS", "TQKV_MAX_STREAMS"])
    if (env[k] !== undefined) expect(/^\d+$/.test(String(env[k])), cw, `${k}=${env[k]} is not a number`);

  // Memory limit covers the DRAM tier plus overhead.
  const dram = parseServerBytes(env.TQKV_DRAM_CAPACITY ?? "1G");
  const lim = parseQuantity(c.resources?.limits?.memory);
  const need = dram + Math.max(512 * 2 ** 20, dram / 10);
  expect(lim !== null && lim >= need, cw,
    `memory limit ${c.resources?.limits?.memory} must exceed TQKV_DRAM_CAPACITY ${env.TQKV_DRAM_CAPACITY} + overhead (>= ${(need / 2 ** 30).toFixed(2)}Gi)`);
  const threads = Number(env.TQKV_THREADS || 0);
  const cpuLim = parseQuantity(c.resources?.limits?.cpu);
  expect(!threads || threads <= Math.ceil(cpuLim), cw, `TQKV_THREADS ${threads} <= cpu limit ${cpuLim}`);

  // Graceful shutdown: preStop + drain + margin fit in the grace period.
  const drain = Number(env.TQKV_DRAIN_SECONDS ?? 20);
  const pre = c.lifecycle?.preStop;
  let preSecs = 0;
  if (pre?.exec?.command) {
    const cmd = pre.exec.command;
    preSecs = /sleep$/.test(cmd[0]) ? Number(cmd[1]) : 0;
  } else if (pre?.sleep) preSecs = pre.sleep.seconds;
  const grace = pod.terminationGracePeriodSeconds ?? 30;
  const handoff = env.TQKV_PEERS ? Number(env.TQKV_HANDOFF_SECONDS ?? 10) : 0;
  expect(grace >= drain + preSecs + handoff + 5, ws,
    `terminationGracePeriodSeconds ${grace} < preStop ${preSecs} + TQKV_HANDOFF_SECONDS ${handoff} + TQKV_DRAIN_SECONDS ${drain} + 5 s margin`);
  expect((c.volumeMounts || []).some((m) => m.mountPath === "/tmp"), cw, "writable /tmp (root fs is read-only)");

  // Services.
  const svcs = byKind("Service");
  const headless = svcs.find((s) => s.metadata.name === "tqkv-headless");
  if (expect(headless, W, "Service tqkv-headless")) {
    const hw = `${W} Service/tqkv-headless`;
    expect(headless.spec.clusterIP === "None", hw, "clusterIP None (headless)");
    expect(headless.spec.publishNotReadyAddresses === false, hw, "publishNotReadyAddresses false");
    expect(selects(headless.spec.selector, podLabels), hw, "selects the StatefulSet's pods");
    expect(ss.spec.serviceName === "tqkv-headless", ws, "serviceName tqkv-headless");
    const gp = (headless.spec.ports || []).find((p) => p.name === "grpc");
    expect(gp && (gp.targetPort === "grpc" || gp.targetPort === 50051) && gp.port === 50051, hw, "grpc port 50051 -> grpc");
    if (ports.data !== undefined) {
      const dp = (headless.spec.ports || []).find((p) => p.name === "data");
      expect(dp && (dp.targetPort === "data" || dp.targetPort === ports.data) && dp.port === ports.data, hw,
        `data port ${ports.data} -> data (clients reach each pod's data channel listener)`);
    }
  }
  const svc = svcs.find((s) => s.metadata.name === "tqkv");
  if (expect(svc, W, "Service tqkv")) {
    const sw = `${W} Service/tqkv`;
    expect((svc.spec.type ?? "ClusterIP") === "ClusterIP", sw, "type ClusterIP");
    expect(svc.spec.clusterIP !== "None", sw, "not headless");
    expect(selects(svc.spec.selector, podLabels), sw, "selects the StatefulSet's pods");
    for (const p of svc.spec.ports || []) {
      expect(typeof p.targetPort === "number" || ports[p.targetPort] !== undefined, sw,
        `targetPort ${p.targetPort} is a named container port`);
      expect(p.targetPort !== "data" && p.targetPort !== ports.data, sw,
        "no data channel port on the load-balanced Service (the connection could reach another pod than the channel's)");
    }
  }
  for (const s of svcs)
    for (const p of s.spec.ports || [])
      if (typeof p.targetPort === "string")
        expect(ports[p.targetPort] !== undefined, `${W} Service/${s.metadata.name}`, `targetPort ${p.targetPort} exists`);

  const pdbs = byKind("PodDisruptionBudget");
  if (expect(pdbs.length === 1, W, "one PodDisruptionBudget")) {
    const pw = `${W} PodDisruptionBudget/${pdbs[0].metadata.name}`;
    expect(pdbs[0].spec.maxUnavailable === 1, pw, "maxUnavailable 1");
    expect(selects(pdbs[0].spec.selector?.matchLabels, podLabels), pw, "selects the pods");
  }
  const ns = byKind("Namespace")[0];
  const nsName = ns?.metadata?.name;
  for (const o of objs)
    if (o.kind !== "Namespace")
      expect(o.metadata.namespace === nsName, `${W} ${o.kind}/${o.metadata.name}`, `in namespace ${nsName}`);
  expect(ns?.metadata?.labels?.["pod-security.kubernetes.io/enforce"] === "restricted", W,
    "namespace enforces the restricted Pod Security Standard");

  checkSecurity(variant, objs, ss, c, env, ports, podLabels, nsName);

  // Variant specifics.
  const gpuLim = c.resources?.limits?.["nvidia.com/gpu"];
  if (variant === "gpu") {
    expect(String(gpuLim) === "1", cw, "limits nvidia.com/gpu: 1");
    const gpuReq = c.resources?.requests?.["nvidia.com/gpu"];
    expect(gpuReq === undefined || String(gpuReq) === String(gpuLim), cw, "GPU request equals limit");
    expect(Object.keys(pod.nodeSelector || {}).length > 0, ws, "nodeSelector for GPU nodes");
    expect((pod.tolerations || []).some((t) => t.key === "nvidia.com/gpu"), ws, "tolerates nvidia.com/gpu");
    expect(String(env.TQKV_DEVICE) === "0", cw, "TQKV_DEVICE=0");
    expect(parseServerBytes(env.TQKV_HBM_CAPACITY) > 0, cw, "TQKV_HBM_CAPACITY > 0");
    expect(!env.TQKV_HBM_STANDIN || env.TQKV_HBM_STANDIN === "false", cw, "no HBM stand-in with a real device");
    expect(/cuda/.test(c.image), cw, `a CUDA image (got ${c.image})`);
  } else {
    expect(gpuLim === undefined, cw, "no GPU on the cpu overlay");
    expect(env.TQKV_DEVICE === undefined, cw, "no TQKV_DEVICE on the cpu overlay (built without CUDA it is an error)");
    expect(!/cuda/.test(c.image), cw, `a CPU image (got ${c.image})`);
  }
  return { svcs, ns: nsName, replicas: ss.spec.replicas, env };
}

const SECURE = (variant) => variant !== "insecure-dev";
const TLS_DIR = "/etc/tqkv/tls";

// The volume (and its mount) that holds file path in container c, or {}.
function mountOf(pod, c, file) {
  const m = (c.volumeMounts || []).find((v) => file.startsWith(v.mountPath.replace(/\/$/, "") + "/"));
  const v = m && (pod.volumes || []).find((x) => x.name === m.name);
  return { m, v };
}

// A Secret-backed file: the mount is read-only, not a subPath (subPath mounts never see a
// Secret update, so a rotation would not reach the server), and the key exists.
function checkSecretFile(where, pod, c, file, secretName, key) {
  const { m, v } = mountOf(pod, c, file);
  if (!expect(m && v, where, `${file} is on a mounted volume`)) return;
  expect(v.secret?.secretName === secretName, where, `${file} comes from the Secret ${secretName}`);
  expect(m.readOnly === true, where, `${m.mountPath} mounted readOnly`);
  expect(!m.subPath && !m.subPathExpr, where, `${m.mountPath} not a subPath mount (Secret updates must reach the file)`);
  const name = file.slice(m.mountPath.replace(/\/$/, "").length + 1);
  const items = v.secret?.items;
  expect(!items || items.some((i) => i.key === key && i.path === name), where, `${file} is the Secret's key ${key}`);
  if (!items) expect(name === key, where, `${file} is the Secret's key ${key}`);
  const mode = v.secret?.defaultMode;
  expect(mode === undefined || (mode & 0o007) === 0, where, `${v.name}: no access for others (defaultMode ${mode?.toString(8)})`);
}

function checkNetworkPolicy(W, objs, ports, podLabels, env) {
  const nps = objs.filter((o) => o.kind === "NetworkPolicy" && selects(o.spec.podSelector?.matchLabels, podLabels));
  if (!expect(nps.length === 1, W, `one NetworkPolicy selecting the server pods, got ${nps.length}`)) return;
  const np = nps[0];
  const nw = `${W} NetworkPolicy/${np.metadata.name}`;
  expect((np.spec.policyTypes || []).includes("Ingress"), nw, "policyTypes includes Ingress");
  const clientPorts = [50051, 50052];
  const covered = new Set();
  let peersAdmitted = false;
  for (const [i, r] of (np.spec.ingress || []).entries()) {
    const rw = `${nw} ingress[${i}]`;
    const from = r.from || [];
    const rports = (r.ports || []).map((p) => (typeof p.port === "string" ? ports[p.port] : p.port));
    if (!expect(from.length > 0, rw, "names its sources (a rule without 'from' admits everyone)")) continue;
    if (!expect(rports.length > 0, rw, "names its ports (a rule without 'ports' opens every port)")) continue;
    for (const p of rports) covered.add(p);
    expect(!from.some((f) => f.ipBlock), rw, "no ipBlock sources");
    const toClients = rports.some((p) => clientPorts.includes(p));
    const toMetrics = rports.includes(ports.metrics);
    expect(!(toClients && toMetrics), rw, "client ports and the metrics port in separate rules");
    // The servers' own pods, as peers (hand-off, forwarding): this namespace, gRPC only.
    const peerRule = from.every((f) => !f.namespaceSelector && f.podSelector &&
      !f.podSelector.matchLabels?.["tqkv.io/client"] && selects(f.podSelector.matchLabels, podLabels));
    if (peerRule) {
      expect(rports.length === 1 && rports[0] === ports.grpc, rw, `the peers' rule opens only the gRPC port, got ${rports}`);
      peersAdmitted = true;
    } else if (toClients) {
      expect(rports.every((p) => clientPorts.includes(p)), rw, `client rule opens only gRPC/data ports, got ${rports}`);
      for (const f of from)
        expect(f.podSelector?.matchLabels?.["tqkv.io/client"] === "true", rw,
          "every source is a pod labelled tqkv.io/client=true");
    }
    if (toMetrics) {
      expect(rports.every((p) => p === ports.metrics), rw, "metrics rule opens only the metrics port");
      for (const f of from)
        expect(f.namespaceSelector?.matchLabels?.["kubernetes.io/metadata.name"] === "monitoring", rw,
          "metrics sources are the monitoring namespace only");
    }
  }
  for (const [name, p] of Object.entries(ports))
    expect(covered.has(p), nw, `container port ${name} (${p}) is admitted by a rule (else clients or Prometheus are cut off)`);
  if (env.TQKV_PEERS)
    expect(peersAdmitted, nw, "a rule admits the server pods to gRPC (TQKV_PEERS: hand-off and forwarding)");
  return np;
}

function checkSecurity(variant, objs, ss, c, env, ports, podLabels, nsName) {
  const W = `overlays/${variant}`;
  const cw = `${W} StatefulSet/${ss.metadata.name} container tqkv`;
  const pod = ss.spec.template.spec;
  checkNetworkPolicy(W, objs, ports, podLabels, env);
  expect(!objs.some((o) => o.kind === "Secret"), W, "no Secret in the manifests (secrets are not committed)");
  const note = ss.metadata.annotations?.["tqkv.io/insecure"];
  if (SECURE(variant)) {
    expect(!note, W, "no tqkv.io/insecure annotation on a secure overlay");
    for (const k of ["TQKV_TLS_CERT", "TQKV_TLS_KEY", "TQKV_AUTH_TOKENS"])
      expect(env[k], cw, `${k} set (secure by default)`);
    if (env.TQKV_TLS_CERT) checkSecretFile(cw, pod, c, env.TQKV_TLS_CERT, "tqkv-tls", "tls.crt");
    if (env.TQKV_TLS_KEY) checkSecretFile(cw, pod, c, env.TQKV_TLS_KEY, "tqkv-tls", "tls.key");
    if (env.TQKV_AUTH_TOKENS) checkSecretFile(cw, pod, c, env.TQKV_AUTH_TOKENS, "tqkv-auth", "tokens");
    if (env.TQKV_TLS_CLIENT_CA) checkSecretFile(cw, pod, c, env.TQKV_TLS_CLIENT_CA, "tqkv-tls", "ca.crt");
    // With TLS the data channels are TLS 1.3 too (same certificate and client CA).
    expect(env.TQKV_DATA_LISTEN !== undefined, cw, "TCP data channels on (TLS with the gRPC certificate)");
    // Hand-off on drain and forwarding, over TLS with the peer token (docs/cluster.md).
    const peers = hostPort(env.TQKV_PEERS);
    expect(peers && peers.host === "tqkv-headless" && peers.port === ports.grpc, cw,
      `TQKV_PEERS is the headless Service at the grpc port (hand-off on drain), got ${env.TQKV_PEERS}`);
    expect(Number(env.TQKV_HANDOFF_SECONDS) > 0, cw, `TQKV_HANDOFF_SECONDS > 0, got ${env.TQKV_HANDOFF_SECONDS}`);
    const peerCa = env.TQKV_PEER_CA || env.TQKV_TLS_CLIENT_CA;
    if (expect(peerCa, cw, "TQKV_PEER_CA set: peers are verified against the CA (TLS to peers)"))
      checkSecretFile(cw, pod, c, peerCa, "tqkv-tls", "ca.crt");
    if (expect(env.TQKV_PEER_TOKEN_FILE, cw, "TQKV_PEER_TOKEN_FILE set (the hand-off's token where auth is on)"))
      checkSecretFile(cw, pod, c, env.TQKV_PEER_TOKEN_FILE, "tqkv-auth", "peer-token");
    expect(!env.TQKV_NO_FORWARD || env.TQKV_NO_FORWARD === "false", cw, "forwarding on (TLS carries the callers' tokens)");
  } else {
    for (const k of ["TQKV_TLS_CERT", "TQKV_TLS_KEY", "TQKV_AUTH_TOKENS", "TQKV_PEER_CA", "TQKV_PEER_TOKEN_FILE"])
      expect(!env[k], cw, `${k} not set on insecure-dev (no Secret to mount)`);
    expect(note && /TLS off/.test(note) && /tokens off/.test(note), W,
      `the StatefulSet says what is off (annotation tqkv.io/insecure), got ${note}`);
    expect(ss.spec.template.metadata?.annotations?.["tqkv.io/insecure"] === note, W, "... on the pods too");
    const text = readFileSync(path.join(root, "deploy", "k8s", "overlays", variant, "kustomization.yaml"), "utf8");
    expect(/turns off/i.test(text) && /TLS/.test(text) && /token/i.test(text), W,
      "kustomization.yaml says what it turns off (TLS, tokens)");
    expect(!(pod.volumes || []).some((v) => v.secret), W, "no Secret volumes (none needed)");
  }
  // Peers in clear only where everything is in clear.
  expect(!env.TQKV_PEERS || env.TQKV_TLS_CERT || variant === "insecure-dev", cw,
    "TQKV_PEERS without TQKV_TLS_CERT: hand-off and forwarding would talk to peers in clear (only overlays/insecure-dev may)");
  if (variant === "cert-manager") checkCertManager(W, objs, pod, c, env, nsName);
}

function checkCertManager(W, objs, pod, c, env, nsName) {
  const tls = mountOf(pod, c, env.TQKV_TLS_CERT || TLS_DIR + "/tls.crt").v?.secret?.secretName;
  const certs = objs.filter((o) => o.kind === "Certificate" && o.spec.secretName === tls);
  if (!expect(certs.length === 1, W, `one cert-manager Certificate writing the Secret ${tls}`)) return;
  const cert = certs[0].spec;
  const cw = `${W} Certificate/${certs[0].metadata.name}`;
  const names = cert.dnsNames || [];
  for (const n of [`tqkv.${nsName}.svc`, `*.tqkv-headless.${nsName}.svc`, "*.tqkv-headless"])
    expect(names.includes(n), cw, `dnsNames include ${n} (clients reach the Service and each pod)`);
  expect((cert.usages || []).includes("server auth"), cw, "usages include server auth");
  expect((cert.usages || []).includes("client auth"), cw,
    "usages include client auth (peers present the certificate to each other)");
  const peerName = env.TQKV_PEER_TLS_NAME || hostPort(env.TQKV_PEERS)?.host;
  if (peerName)
    expect(names.includes(peerName), cw, `dnsNames include ${peerName} (the name peers check: TQKV_PEERS)`);
  expect(cert.privateKey?.rotationPolicy === "Always", cw, "privateKey.rotationPolicy Always (a new key at each renewal)");
  const hours = (d) => (/^(\d+)h$/.exec(d || "") || [])[1] * 1;
  expect(hours(cert.renewBefore) > 0 && hours(cert.renewBefore) < hours(cert.duration), cw, "renewBefore < duration");
  const ref = cert.issuerRef || {};
  expect(ref.kind === "ClusterIssuer" || objs.some((o) => o.kind === "Issuer" && o.metadata.name === ref.name), cw,
    `issuerRef ${ref.kind}/${ref.name} is rendered (or a ClusterIssuer)`);
}

function checkBench(objs, replicas) {
  const W = "bench";
  const jobs = objs.filter((o) => o.kind === "Job");
  if (!expect(jobs.length === 1, W, "one Job")) return;
  const job = jobs[0];
  const jw = `${W} Job/${job.metadata.name}`;
  const pod = job.spec.template.spec;
  expect(pod.restartPolicy === "Never" || pod.restartPolicy === "OnFailure", jw, "restartPolicy Never/OnFailure");
  expect(job.spec.activeDeadlineSeconds > 0, jw, "activeDeadlineSeconds bounds the run");
  podSecurity(jw, pod, pod.containers);
  const c = pod.containers[0];
  const argv = [...(c.command || []), ...(c.args || [])];
  expect(/tqkv-bench$/.test(argv[0] || ""), jw, "runs tqkv-bench");
  const flag = (f) => {
    const i = argv.indexOf(f);
    return i >= 0 ? argv[i + 1] : undefined;
  };
  const targets = argv.filter((a, i) => argv[i - 1] === "--target");
  expect(targets.length > 0, jw, "at least one --target");
  for (const t of targets)
    expect(/^(dns:\/\/\/)?(tqkv-\d+\.)?tqkv-headless(\.[a-z0-9.-]+)?:50051$/.test(t), jw,
      `--target ${t} is not the headless Service (or a pod under it) on the gRPC port`);
  const perPod = targets.filter((t) => /tqkv-\d+\./.test(t)).map((t) => Number(/tqkv-(\d+)\./.exec(t)[1]));
  if (perPod.length)
    expect(perPod.length === replicas && perPod.every((n, i) => n === i), jw,
      `one --target per StatefulSet replica (tqkv-0..tqkv-${replicas - 1}), got ${targets.join(" ")}`);
  expect(Number(flag("--duration")) > 0, jw, "--duration N");
  expect(Number(flag("--duration")) < job.spec.activeDeadlineSeconds, jw, "--duration shorter than the deadline");
  expect(flag("--json") === "-", jw, "--json -");
  expect(job.metadata.namespace === "tqkv", jw, "in namespace tqkv (same as the servers)");
  // A client of the secure base: admitted by the NetworkPolicy, verifies TLS, sends a token
  // from a Secret (not written in the manifest), and never sees the server's key.
  expect(job.spec.template.metadata?.labels?.["tqkv.io/client"] === "true", jw,
    "pod labelled tqkv.io/client=true (the NetworkPolicy admits only those)");
  const ca = flag("--tls-ca");
  if (expect(ca, jw, "--tls-ca (the servers speak TLS)")) {
    const { m, v } = mountOf(pod, c, ca);
    expect(m && v?.secret && v.secret.items?.length === 1 && v.secret.items[0].key === "ca.crt", jw,
      `${ca} from a volume holding only ca.crt (not the server's tls.key)`);
  }
  const tok = flag("--token");
  const ref = /^\$\(([A-Z_][A-Z0-9_]*)\)$/.exec(tok || "");
  const ev = ref && (c.env || []).find((e) => e.name === ref[1]);
  expect(ev?.valueFrom?.secretKeyRef?.name === "tqkv-auth", jw,
    `--token from the Secret tqkv-auth through $(VAR) (got ${tok})`);
  expect(!(c.env || []).some((e) => e.value && /token/i.test(e.name)), jw, "no literal token in the manifest");
}

function checkMonitoring(objs, serverSvcs, nsName) {
  const W = "monitoring";
  const sms = objs.filter((o) => o.kind === "ServiceMonitor");
  if (!expect(sms.length === 1, W, "one ServiceMonitor")) return;
  const sm = sms[0];
  const mw = `${W} ServiceMonitor/${sm.metadata.name}`;
  const matched = serverSvcs.filter((s) => selects(sm.spec.selector?.matchLabels, s.metadata.labels));
  expect(matched.length === 1, mw, `selects exactly one Service (got ${matched.map((s) => s.metadata.name)}): one scrape per pod`);
  const names = sm.spec.namespaceSelector?.matchNames;
  expect(!names || names.includes(nsName) || sm.metadata.namespace === nsName, mw, `looks in namespace ${nsName}`);
  for (const ep of sm.spec.endpoints || []) {
    expect(ep.port === "metrics", mw, "endpoint port metrics");
    expect((ep.path ?? "/metrics") === "/metrics", mw, "path /metrics");
    expect(ep.honorLabels !== true, mw,
      "no honorLabels: the tenant label is 'tenant', and honouring exported labels would let a scraped target overwrite namespace/pod");
    if (matched[0]) expect((matched[0].spec.ports || []).some((p) => p.name === ep.port), mw, `Service has port ${ep.port}`);
  }
  const known = knownMetrics();
  const rules = objs.filter((o) => o.kind === "PrometheusRule").flatMap((o) => o.spec.groups.flatMap((g) => g.rules));
  expect(rules.length > 0, W, "a PrometheusRule with alerts");
  for (const r of rules) {
    const rw = `${W} alert ${r.alert}`;
    expect(/^[A-Z][A-Za-z0-9]+$/.test(r.alert || ""), rw, "CamelCase alert name");
    expect(["critical", "warning", "info"].includes(r.labels?.severity), rw, "severity label");
    expect(r.annotations?.summary, rw, "summary annotation");
    checkPromQL(rw, r.expr, known);
  }
  const n = promtoolParse(`${W} PrometheusRule`, rules.map((r) => r.expr));
  console.log(`monitoring: ${n} alert expressions parsed by promtool`);
  for (const [what, re] of [
    ["server errors", /tqkv_requests_total/],
    ["credential reload rejected", /tqkv_credential_reloads_total\{[^}]*rejected/],
    ["file descriptors", /process_open_fds/],
  ])
    expect(rules.some((r) => re.test(r.expr)), W, `an alert on ${what}`);
}


// Starts the real tqkv-server with the overlay's ConfigMap as its environment (listen
// addresses (gRPC, metrics, data channels) moved to loopback port 0 and capacities shrunk by flags, which win over
// variables) and checks that it accepts the configuration, serves /metrics, and stops
// cleanly on SIGTERM. Without a GPU (or a CUDA build) the HBM tier runs as a host
// stand-in.
function runServer(env, args) {
  return new Promise((resolve) => {
    const e = Object.fromEntries(Object.entries(process.env).filter(([k]) => !k.startsWith("TQKV_")));
    const p = spawn(process.env.TQKV_SERVER, args, { env: { ...e, ...env }, stdio: ["ignore", "pipe", "pipe"] });
    let out = "";
    let err = "";
    let done = false;
    const finish = (r) => {
      if (!done) {
        done = true;
        clearTimeout(timer);
        resolve({ ...r, out, err, proc: p });
      }
    };
    const timer = setTimeout(() => finish({ started: false, why: "no 'listening on' line in 60 s" }), 60000);
    p.stdout.on("data", (d) => {
      out += d;
      const m = /metrics on port (\d+)/.exec(out);
      if (/listening on/.test(out) && m) finish({ started: true, metricsPort: Number(m[1]) });
    });
    p.stderr.on("data", (d) => (err += d));
    p.on("exit", (code) => finish({ started: false, why: `exited with ${code}` }));
  });
}

// The data channel port the server logged ("TCP data channels" ... port=N, text or JSON;
// on stderr, possibly just after the listening line).
async function dataChannelPort(r) {
  for (let i = 0; i < 50; i++) {
    const m = /TCP data channels[^\n]*?\bport["=:]+"?(\d+)/.exec(r.err);
    if (m) return Number(m[1]);
    await new Promise((res) => setTimeout(res, 100));
  }
  return 0;
}

function get(port, path) {
  return new Promise((resolve) => {
    http.get({ host: "127.0.0.1", port, path, timeout: 10000 }, (res) => {
      let body = "";
      res.on("data", (d) => (body += d));
      res.on("end", () => resolve({ status: res.statusCode, body }));
    }).on("error", (e) => resolve({ status: 0, body: String(e) }));
  });
}

async function serverAccepts(variant, envIn, trial) {
  const W = `overlays/${variant} ConfigMap with ${process.env.TQKV_SERVER}`;
  // The Secrets' files as trial-secrets.sh makes them, where the pod would mount them.
  let env = { ...envIn };
  if (env.TQKV_TLS_CERT || env.TQKV_AUTH_TOKENS) {
    if (!expect(trial, W, "trial-secrets.sh output to stand in for the Secrets")) return;
    if (env.TQKV_TLS_CERT) env.TQKV_TLS_CERT = trial.cert;
    if (env.TQKV_TLS_KEY) env.TQKV_TLS_KEY = trial.key;
    if (env.TQKV_AUTH_TOKENS) env.TQKV_AUTH_TOKENS = trial.tokens;
    if (env.TQKV_TLS_CLIENT_CA) env.TQKV_TLS_CLIENT_CA = trial.ca;
    if (env.TQKV_PEER_CA) env.TQKV_PEER_CA = trial.ca;
    if (env.TQKV_PEER_TOKEN_FILE) env.TQKV_PEER_TOKEN_FILE = trial.peerToken;
  }
  const args = ["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--dram-capacity", "64M",
    "--threads", "2", "--encoder-threads", "2"];
  if (env.TQKV_DATA_LISTEN) args.push("--data-listen", "127.0.0.1:0");
  if (env.TQKV_HBM_CAPACITY) args.push("--hbm-capacity", "32M");
  let diskDir = null;
  if (env.TQKV_DISK_PATH) {
    // The disk overlay's volume path, redirected to a scratch directory here.
    diskDir = mkdtempSync(path.join(os.tmpdir(), "tqkv-k8s-disk-"));
    env = { ...env, TQKV_DISK_PATH: diskDir, TQKV_DISK_CAPACITY: "64M" };
  }
  let r = await runServer(env, args);
  let note = "";
  if (!r.started && env.TQKV_DEVICE !== undefined && /CUDA|device/i.test(r.err)) {
    const e2 = { ...env, TQKV_HBM_STANDIN: "true" };
    delete e2.TQKV_DEVICE;
    note = " (HBM stand-in: no GPU or no CUDA build here)";
    r = await runServer(e2, args);
  }
  if (!expect(r.started, W, `server did not start: ${r.why}: ${r.err.trim().split("\n").slice(-2).join(" | ")}`)) return;
  const m = await get(r.metricsPort, "/metrics");
  expect(m.status === 200 && /\ntqkv_tier_capacity_bytes\{tier="dram"\} 67108864\n/.test(m.body), W,
    "serves /metrics with the DRAM tier capacity");
  if (env.TQKV_HBM_CAPACITY)
    expect(/\ntqkv_tier_capacity_bytes\{tier="hbm"\} 33554432\n/.test(m.body), W, "HBM tier configured");
  const live = await get(r.metricsPort, "/livez");
  const ready = await get(r.metricsPort, "/readyz");
  expect(live.status === 200 && ready.status === 200, W, `probes /livez ${live.status} /readyz ${ready.status}`);
  expect(/\ntqkv_credential_reloads_total\{file="tokens",result="ok"\} (\d+)\n/.exec(m.body)?.[1] === (env.TQKV_AUTH_TOKENS ? "1" : "0"), W,
    "token file loaded (tqkv_credential_reloads_total)");
  if (env.TQKV_TLS_CERT) {
    const port = Number(/listening on [^\s]*:(\d+)/.exec(r.out)?.[1]);
    const t = await tlsVerifies(port, trial.ca, "tqkv-0.tqkv-headless.tqkv.svc");
    expect(t.ok && t.alpn === "h2", W, `TLS as a client would see it (pod DNS name, trial CA, h2): ${JSON.stringify(t)}`);
    const wrong = await tlsVerifies(port, trial.cert, "tqkv-0.tqkv-headless.tqkv.svc");
    expect(!wrong.ok, W, "a client trusting another CA is refused");
    const peerName = env.TQKV_PEER_TLS_NAME || hostPort(env.TQKV_PEERS)?.host;
    if (peerName) {
      // A peer dials the headless Service's pods and checks this name.
      const p = await tlsVerifies(port, env.TQKV_PEER_CA || trial.ca, peerName);
      expect(p.ok, W, `TLS as a peer would see it (${peerName}, TQKV_PEER_CA): ${JSON.stringify(p)}`);
    }
    if (env.TQKV_DATA_LISTEN) {
      // The data channel listener speaks TLS 1.3 with the same certificate.
      const dataPort = await dataChannelPort(r);
      if (expect(dataPort > 0, W, `a "TCP data channels" log line with the port: ${r.err.trim().split("\n").slice(-2).join(" | ")}`)) {
        const d = await tlsVerifies(dataPort, trial.ca, "tqkv-0.tqkv-headless.tqkv.svc", null);
        expect(d.ok && d.version === "TLSv1.3", W, `TLS 1.3 data channel as a client would see it (pod DNS name, trial CA): ${JSON.stringify(d)}`);
        const dw = await tlsVerifies(dataPort, trial.cert, "tqkv-0.tqkv-headless.tqkv.svc", null);
        expect(!dw.ok, W, "a data channel client trusting another CA is refused");
      }
    }
  }
  const code = await new Promise((resolve) => {
    const t = setTimeout(() => {
      r.proc.kill("SIGKILL");
      resolve("timeout");
    }, 60000);
    r.proc.on("exit", (c) => {
      clearTimeout(t);
      resolve(c);
    });
    r.proc.kill("SIGTERM");
  });
  expect(code === 0, W, `exit status ${code} after SIGTERM`);
  if (diskDir) {
    expect(/\ntqkv_tier_capacity_bytes\{tier="disk"\} 67108864\n/.test(m.body), W, "disk tier configured");
    expect(existsSync(path.join(diskDir, "tqkv-disk.super")), W, "disk tier superblock written");
    rmSync(diskDir, { recursive: true, force: true });
  }
  console.log(`overlays/${variant}: tqkv-server accepted the ConfigMap${note}`);
}

async function runK8s() {
  for (const [tool, args] of [[kubectl, ["version", "--client"]]]) {
    try {
      sh(tool, args);
    } catch {
      fail("tools", `${tool} not found: install kubectl (deploy/install-deps.sh) to render the manifests`);
      return;
    }
  }
  const envVars = serverEnvVars();
  expect(envVars.vars.size >= 10, "server", `too few TQKV_* variables found in ${envVars.from}`);
  console.log(`server variables: ${envVars.vars.size} from ${envVars.from}`);
  let svcs = [];
  let nsName = "tqkv";
  let replicas = 3;
  const trial = trialSecrets();
  const envs = {};
  for (const variant of ["cpu", "gpu", "cert-manager", "insecure-dev", "disk"]) {
    const text = render(`overlays/${variant}`);
    if (!text) continue;
    const objs = await parseDocs(text);
    await validateSchema(`overlays/${variant}`, objs);
    const r = checkServer(variant, objs, envVars);
    if (r && process.env.TQKV_SERVER && existsSync(process.env.TQKV_SERVER) && variant !== "cert-manager")
      await serverAccepts(variant, r.env, trial);
    if (r && variant === "cpu") ({ svcs, ns: nsName, replicas } = r);
    if (r) envs[variant] = r.env;
    console.log(`overlays/${variant}: ${objs.length} objects (${objs.map((o) => o.kind).join(", ")})`);
  }
  // insecure-dev repeats the cpu configuration (behavior: replace) minus TLS and tokens:
  // nothing else may drift.
  if (envs.cpu && envs["insecure-dev"]) {
    const want = { ...envs.cpu };
    for (const k of ["TQKV_TLS_CERT", "TQKV_TLS_KEY", "TQKV_TLS_CLIENT_CA", "TQKV_AUTH_TOKENS"]) delete want[k];
    for (const k of ["TQKV_PEER_CA", "TQKV_PEER_TOKEN_FILE", "TQKV_PEER_TLS_NAME"]) delete want[k];
    const got = { ...envs["insecure-dev"] };
    for (const k of new Set([...Object.keys(want), ...Object.keys(got)]))
      expect(want[k] === got[k], "overlays/insecure-dev", `${k}=${got[k]} differs from the cpu overlay's ${want[k]} (only TLS and tokens may, for clients and peers)`);
  }
  // disk is the secure base (behavior: merge) plus the disk tier: nothing else may drift.
  if (envs.cpu && envs.disk) {
    const got = envs.disk;
    for (const k of new Set([...Object.keys(envs.cpu), ...Object.keys(got)]))
      if (!k.startsWith("TQKV_DISK_"))
        expect(envs.cpu[k] === got[k], "overlays/disk", `${k}=${got[k]} differs from the cpu overlay's ${envs.cpu[k]} (only TQKV_DISK_* may)`);
    for (const k of ["TQKV_DISK_PATH", "TQKV_DISK_CAPACITY"]) expect(got[k], "overlays/disk", `${k} set`);
  }
  const bench = render("bench");
  if (bench) {
    const objs = await parseDocs(bench);
    await validateSchema("bench", objs);
    checkBench(objs, replicas);
  }
  const mon = render("monitoring");
  if (mon) {
    const objs = await parseDocs(mon);
    await validateSchema("monitoring", objs);
    checkMonitoring(objs, svcs, nsName);
  }
  // The base alone must render too (overlays build on it).
  render("base");
  if (trial) rmSync(trial.dir, { recursive: true, force: true });
}

// Runs deploy/k8s/trial-secrets.sh into a temporary directory and checks what it made:
// the certificate verifies against its CA and names the Services and the pods; the token
// file has an admin and a bench token. Returns the paths (the server test uses them).
function trialSecrets() {
  const W = "deploy/k8s/trial-secrets.sh";
  const dir = mkdtempSync(path.join(tmpdir(), "tqkv-trial-"));
  const out = path.join(dir, "s");
  try {
    sh("bash", [path.join(root, "deploy", "k8s", "trial-secrets.sh"), "--out", out]);
  } catch (e) {
    fail(W, `failed: ${((e.stdout || "") + (e.stderr || "")).trim().split("\n").slice(-3).join(" | ")}`);
    return null;
  }
  const f = (n) => path.join(out, n);
  for (const n of ["ca.crt", "tls.crt", "tls.key", "tokens", "bench-token", "admin-token", "peer-token"])
    expect(existsSync(f(n)), W, `writes ${n}`);
  expect((statSync(f("tls.key")).mode & 0o077) === 0 && (statSync(out).mode & 0o077) === 0, W,
    "key and directory readable by the owner only");
  try {
    sh("openssl", ["verify", "-CAfile", f("ca.crt"), f("tls.crt")]);
    checks++;
  } catch (e) {
    fail(W, `tls.crt does not verify against ca.crt: ${(e.stdout || "") + (e.stderr || "")}`);
  }
  let san = "";
  try {
    san = sh("openssl", ["x509", "-in", f("tls.crt"), "-noout", "-ext", "subjectAltName"]);
  } catch {}
  for (const n of ["DNS:tqkv.tqkv.svc", "DNS:*.tqkv-headless.tqkv.svc", "DNS:*.tqkv-headless", "DNS:tqkv,",
    "DNS:tqkv-headless,"])
    expect(san.includes(n), W, `certificate names ${n.replace(/,$/, "")}`);
  let eku = "";
  try {
    eku = sh("openssl", ["x509", "-in", f("tls.crt"), "-noout", "-ext", "extendedKeyUsage"]);
  } catch {}
  expect(/Server Authentication/.test(eku) && /Client Authentication/.test(eku), W,
    `certificate for server and client use (peers present it to each other): ${eku.trim()}`);
  const lines = readFileSync(f("tokens"), "utf8").split("\n").filter((l) => l && !l.startsWith("#"));
  const bench = readFileSync(f("bench-token"), "utf8").trim();
  const peer = readFileSync(f("peer-token"), "utf8").trim();
  expect(lines.length === 3 && lines.some((l) => l === `${bench} rw bench`) && lines.some((l) => l === `${peer} rw *`),
    W, "tokens: an admin token, the bench token (rw on bench) and the peer token (rw on *)");
  expect(/^[0-9a-f]{64}$/.test(peer) && peer !== bench, W, "the peer token is its own 256-bit random hex");
  expect(/^[0-9a-f]{64}$/.test(bench), W, "tokens are 256-bit random hex");
  console.log(`trial-secrets.sh: certificate, key and tokens made in ${out}`);
  return { dir, cert: f("tls.crt"), key: f("tls.key"), ca: f("ca.crt"), tokens: f("tokens"), bench,
    peerToken: f("peer-token") };
}

// A TLS handshake with the server as a client in the cluster makes it: the pod's DNS name
// (tqkv-0.tqkv-headless.tqkv.svc) verified against the trial CA, ALPN h2.
function tlsVerifies(port, ca, servername, alpn = ["h2"]) {
  return new Promise((resolve) => {
    const o = { host: "127.0.0.1", port, ca: readFileSync(ca), servername };
    if (alpn) o.ALPNProtocols = alpn;
    const sock = tls.connect(o);
    const done = (r) => {
      sock.destroy();
      resolve(r);
    };
    sock.setTimeout(10000, () => done({ ok: false, why: "timeout" }));
    sock.on("secureConnect", () =>
      done({ ok: sock.authorized, why: sock.authorizationError, alpn: sock.alpnProtocol, version: sock.getProtocol() }));
    sock.on("error", (e) => done({ ok: false, why: String(e) }));
  });
}

// ---------------------------------------------------------------- Dockerfile

function runDockerfile() {
  const W = "deploy/Dockerfile";
  const file = path.join(root, "deploy", "Dockerfile");
  if (!expect(existsSync(file), W, "exists")) return;
  const text = readFileSync(file, "utf8").replace(/\\\n/g, " ");
  const lines = text.split("\n").map((l) => l.trim()).filter((l) => l && !l.startsWith("#"));
  const stages = lines.filter((l) => /^FROM\s/i.test(l));
  expect(stages.length >= 2, W, "multi-stage (build and runtime)");
  const args = Object.fromEntries(
    lines.filter((l) => /^ARG\s/i.test(l)).map((l) => {
      const [k, v] = l.replace(/^ARG\s+/i, "").split("=");
      return [k.trim(), v?.trim().replace(/^"|"$/g, "")];
    }));
  expect(args.BUILD_BASE === "debian:12" || /debian:12/.test(args.BUILD_BASE || ""), W, "BUILD_BASE defaults to debian:12");
  expect(/debian:12/.test(args.RUNTIME_BASE || ""), W, "RUNTIME_BASE defaults to a debian:12 image");
  expect("TQKV_CUDA" in args, W, "ARG TQKV_CUDA selects the CUDA build");
  expect(/^FROM\s+\$\{?BUILD_BASE\}?\s+AS\s+build/i.test(stages[0] || ""), W, "first stage FROM ${BUILD_BASE} AS build");
  expect(/^FROM\s+\$\{?RUNTIME_BASE\}?/i.test(stages[stages.length - 1] || ""), W, "last stage FROM ${RUNTIME_BASE}");
  // Every COPY source (outside --from) exists in the build context and is not ignored.
  const ignore = existsSync(path.join(root, ".dockerignore"))
    ? readFileSync(path.join(root, ".dockerignore"), "utf8").split("\n").map((l) => l.trim()).filter((l) => l && !l.startsWith("#"))
    : [];
  expect(ignore.length > 0, ".dockerignore", "exists and is not empty");
  const ignored = (rel) => {
    let res = false;
    for (const pat of ignore) {
      const neg = pat.startsWith("!");
      const p = (neg ? pat.slice(1) : pat).replace(/\/$/, "").replace(/^\//, "");
      const re = new RegExp("^" + p.replace(/[.+^${}()|[\]\\]/g, "\\$&").replace(/\*\*/g, "\u0000").replace(/\*/g, "[^/]*").replace(/\u0000/g, ".*") + "(/.*)?$");
      if (re.test(rel)) res = !neg;
    }
    return res;
  };
  for (const l of lines.filter((x) => /^COPY\s/i.test(x) && !/--from=/i.test(x))) {
    const parts = l.replace(/^COPY\s+/i, "").split(/\s+/).filter((p) => !p.startsWith("--"));
    const srcs = parts.slice(0, -1);
    for (const s of srcs) {
      const rel = s.replace(/^\.\//, "").replace(/\/$/, "");
      if (rel === "." || rel === "") continue;
      expect(existsSync(path.join(root, rel)), W, `COPY source ${s} does not exist`);
      expect(!ignored(rel), W, `COPY source ${s} is excluded by .dockerignore`);
    }
  }
  for (const must of ["CMakeLists.txt", "kernels", "cache", "proto", "transport", "service", "deploy/install-deps.sh"])
    expect(!ignored(must), ".dockerignore", `must not exclude ${must}`);
  for (const junk of ["build", "build-asan", ".git", "tests/k8s/node_modules"])
    expect(ignored(junk), ".dockerignore", `should exclude ${junk}`);
  // Runtime stage: only runtime libraries, non-root user, the entrypoint.
  const rt = text.slice(text.search(/^FROM\s+\$\{?RUNTIME_BASE/im));
  for (const lib of ["libgrpc29", "libprotobuf-c1", "libjemalloc2", "libmicrohttpd12", "libzstd1", "liburing2", "ca-certificates"])
    expect(new RegExp(`\\b${lib}\\b`).test(rt), W, `runtime stage installs ${lib}`);
  expect(!/-dev\b/.test(rt.replace(/--no-install-recommends/g, "")), W, "runtime stage installs no -dev package");
  expect(/^USER\s+65532(:65532)?\s*$/m.test(rt), W, "runtime USER 65532");
  const ep = /^ENTRYPOINT\s+(\[.*\])\s*$/m.exec(rt);
  if (expect(ep, W, "exec-form ENTRYPOINT")) {
    let argv = [];
    try {
      argv = JSON.parse(ep[1]);
    } catch {
      fail(W, "ENTRYPOINT is not a JSON array");
    }
    expect(argv[0] === "/usr/local/bin/tqkv-server", W, "ENTRYPOINT runs /usr/local/bin/tqkv-server (the path the StatefulSet uses)");
    const f = (k) => argv[argv.indexOf(k) + 1];
    expect(f("--listen") === "0.0.0.0:50051", W, "--listen 0.0.0.0:50051");
    expect(f("--metrics-listen") === "0.0.0.0:9090", W, "--metrics-listen 0.0.0.0:9090");
  }
  expect(/^EXPOSE\s+.*\b50051\b/m.test(rt) && /^EXPOSE\s+.*\b9090\b/m.test(rt), W, "EXPOSE 50051 and 9090");
  expect(/tqkv-bench/.test(rt), W, "ships tqkv-bench (the bench Job runs it from this image)");
  expect(/-DTQKV_CUDA=\$\{?TQKV_CUDA\}?/.test(text), W, "passes TQKV_CUDA to cmake");
  // Runtime packages exist in Debian 12 (when apt-cache is there to ask).
  let apt = true;
  try {
    sh("apt-cache", ["--version"]);
  } catch {
    apt = false;
  }
  if (apt) {
    const pk = /apt-get install[^&;]*/g;
    const names = new Set();
    for (const m of rt.matchAll(pk))
      for (const w of m[0].split(/\s+/).slice(2)) if (/^[a-z0-9][a-z0-9.+-]+$/.test(w)) names.add(w);
    let out = "";
    try {
      out = sh("apt-cache", ["show", "--no-all-versions", ...names]);
    } catch (e) {
      out = e.stdout || "";
    }
    for (const n of names)
      expect(new RegExp(`^Package: ${n.replace(/[.+]/g, "\\$&")}$`, "m").test(out), W,
        `runtime package ${n} is not known to apt-cache`);
  }
}

// ---------------------------------------------------------------- Grafana

function runGrafana() {
  const W = "deploy/grafana/tqkv-dashboard.json";
  const file = path.join(root, "deploy", "grafana", "tqkv-dashboard.json");
  if (!expect(existsSync(file), W, "exists")) return;
  let d;
  try {
    d = JSON.parse(readFileSync(file, "utf8"));
  } catch (e) {
    fail(W, `not JSON: ${e.message}`);
    return;
  }
  const known = knownMetrics();
  expect(typeof d.title === "string" && d.title.length > 0, W, "title");
  expect(typeof d.uid === "string" && d.uid.length > 0 && d.uid.length <= 40, W, "uid (<= 40 chars)");
  expect(Number.isInteger(d.schemaVersion), W, "schemaVersion");
  const vars = (d.templating?.list || []).map((v) => v.name);
  expect(vars.includes("datasource"), W, "a datasource variable");
  const panels = [];
  const walk = (ps) => {
    for (const p of ps || []) {
      panels.push(p);
      walk(p.panels);
    }
  };
  walk(d.panels);
  expect(panels.length >= 8, W, `at least 8 panels, got ${panels.length}`);
  const ids = new Set();
  const exprs = [];
  for (const p of panels) {
    const pw = `${W} panel "${p.title}"`;
    expect(Number.isInteger(p.id) && !ids.has(p.id), pw, "unique integer id");
    ids.add(p.id);
    const g = p.gridPos;
    expect(g && [g.x, g.y, g.w, g.h].every(Number.isInteger) && g.x + g.w <= 24, pw, "gridPos within 24 columns");
    if (p.type === "row") continue;
    expect((p.targets || []).length > 0, pw, "has queries");
    for (const t of p.targets || []) {
      expect(typeof t.expr === "string" && t.expr.length > 0, pw, "target has a PromQL expr");
      expect(t.datasource?.uid === "${datasource}", pw, "target uses the datasource variable");
      exprs.push(t.expr);
      checkPromQL(pw, t.expr, known);
    }
  }
  const all = exprs.join("\n");
  for (const [what, re] of [
    ["hit rate by tier", /tqkv_tier_hits_total/],
    ["hit rate by tenant", /sum by \(tenant\) \(rate\(tqkv_tenant_hits_total/],
    ["GB/s", /tqkv_bytes_sent_total/],
    ["BF16-equivalent GB/s", /tqkv_bf16_equivalent_bytes_delivered_total/],
    ["latency p50", /histogram_quantile\(0\.5,/],
    ["latency p99", /histogram_quantile\(0\.99,/],
    ["evictions", /tqkv_tier_evictions_total/],
    ["demotions", /tqkv_tier_demotions_total/],
    ["tier usage", /tqkv_tier_bytes/],
    ["compression ratio of summed bytes held", /sum\(tqkv_store_bf16_bytes\{[^}]*\}\) \/ clamp_min\(sum\(tqkv_store_page_bytes/],
    ["compression ratio of summed bytes delivered", /sum\(rate\(tqkv_bf16_equivalent_bytes_delivered_total\{[^}]*\}\[[^\]]*\]\)\) \/ clamp_min\(sum\(rate\(tqkv_bytes_sent_total/],
    ["process CPU", /process_cpu_seconds_total/],
    ["process memory", /process_resident_memory_bytes/],
    ["credential reloads", /tqkv_credential_reloads_total/],
    ["errors by code", /tqkv_requests_total\{[^}]*code!="OK"/],
  ])
    expect(re.test(all), W, `a panel for ${what}`);
  // Ratios are ratios of sums: no avg() over pods of a per-pod ratio.
  for (const e of exprs) expect(!/\bavg\s*(by\s*\([^)]*\)\s*)?\(/.test(e), W, `no average of per-pod values: ${e}`);
  const n = promtoolParse(W, exprs);
  console.log(`grafana: ${n} panel queries parsed by promtool`);
}

// ---------------------------------------------------------------- main

const what = process.argv[2] || "k8s";
const t0 = Date.now();
if (what === "k8s") await runK8s();
else if (what === "dockerfile") runDockerfile();
else if (what === "grafana") runGrafana();
else {
  console.log(`usage: node validate.mjs k8s|dockerfile|grafana`);
  process.exit(2);
}
console.log(`${what}: ${checks} checks, ${failures} failures (${Date.now() - t0} ms)`);
process.exit(failures ? 1 : 0);
