"""validate.py - checks tqkv's deployment artefacts (run by tests/k8s/run.sh from CTest,
with the Python of the `k8s` package set: deploy/python-env.sh k8s).

  validate.py k8s         render every kustomization with `kubectl kustomize`, validate
                          each object against the Kubernetes API schemas (the strict
                          schemas kubernetes-validate bundles: unknown fields are errors)
                          and, for the CRDs, against strict schemas made from the
                          cloudcoil models of cert-manager and prometheus-operator; then
                          the invariants: among them secure by default (TLS and tokens
                          from Secrets, mounted so that rotation reaches the server; a
                          NetworkPolicy admitting only labelled clients to gRPC/data and
                          only the monitoring namespace to metrics; insecure-dev says what
                          it turns off; hand-off and forwarding on, to peers over TLS with
                          the peer token, in clear only on insecure-dev), and
                          deploy/k8s/trial-secrets.sh's output accepted by the real server
                          (TLS on gRPC and, where on, on the TCP data channels)
  validate.py negative    the checks above must fail: misspelt fields injected into
                          rendered manifests (and into a copy of a source file, then
                          rendered), wrong types, and broken invariants, each expected to
                          be reported with the right path
  validate.py dockerfile  deploy/Dockerfile and .dockerignore
  validate.py grafana     deploy/grafana/tqkv-dashboard.json
  validate.py schemas     makes the CRDs' strict schemas once per venv (run.sh install)

Environment: TQKV_SOURCE_DIR (repo root; default ../..), TQKV_SERVER (a built
tqkv-server: its --help is the list of TQKV_* variables; otherwise the option table in
service/config.c is read; with it the overlays' ConfigMaps are tried on the real server),
KUBECTL (default kubectl), PROMTOOL (default promtool), TQKV_K8S_VERSION (the Kubernetes
version whose schemas are used; default the newest kubernetes-validate bundles).

Every failure is printed as "FAIL <where>: <what>"; the exit status is 1 if any.
"""

import copy
import glob
import http.client
import json
import math
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.abspath(os.environ.get("TQKV_SOURCE_DIR") or os.path.join(here, "..", ".."))
kubectl = os.environ.get("KUBECTL") or "kubectl"
sys.path.insert(0, os.path.join(here, "..", "support"))
from tqkv_server import ServerProcess, ServerStartError  # noqa: E402


class Report:
    """Counts checks and failures; prints each failure (unless quiet: the negative mode)."""

    def __init__(self, quiet=False):
        self.checks = 0
        self.failures = []
        self.quiet = quiet


R = Report()


def fail(where, what):
    R.failures.append(f"{where}: {what}")
    if not R.quiet:
        print(f"FAIL {where}: {what}", flush=True)


def expect(cond, where, what):
    R.checks += 1
    if not cond:
        fail(where, what)
    return bool(cond)


# ---------------------------------------------------------------- helpers


def g(obj, *keys):
    """obj.k1.k2... with None for anything missing (JavaScript's ?.)."""
    for k in keys:
        if isinstance(obj, dict):
            obj = obj.get(k)
        elif isinstance(obj, list) and isinstance(k, int) and -len(obj) <= k < len(obj):
            obj = obj[k]
        else:
            return None
    return obj


def nz(*vals):
    """The first value that is not None (JavaScript's ??)."""
    for v in vals:
        if v is not None:
            return v
    return None


def js(v):
    """A value as JavaScript's String() would print it in a message."""
    if v is None:
        return "undefined"
    if v is True:
        return "true"
    if v is False:
        return "false"
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    if isinstance(v, list):
        return ",".join(js(x) for x in v)
    return str(v)


def num(v):
    """JavaScript's Number(): NaN for what is not a number."""
    if v is None:
        return math.nan
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    s = str(v).strip()
    if s == "":
        return 0.0
    try:
        return float(s)
    except ValueError:
        return math.nan


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v, want):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == want


def tail_lines(text, n, sep=" | "):
    return sep.join(text.strip().split("\n")[-n:])


BYTE_SUFFIX = {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}


def parse_server_bytes(s):
    """tqkv-server byte counts: digits with an optional K/M/G/T (powers of 1024), "i", "B"."""
    m = re.fullmatch(r"(\d+)([KMGT]?)(i?)(B?)", js(s), re.I)
    if not m or (m[3] and not m[2]):
        return None
    return int(m[1]) * 2 ** BYTE_SUFFIX[m[2].upper()]


QUANTITY_MULT = {
    None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18, "m": 1e-3,
}


def parse_quantity(q):
    """Kubernetes resource.Quantity (memory in bytes, cpu in cores), or None."""
    if q is None:
        return None
    m = re.fullmatch(r"([0-9.]+)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?", js(q))
    if not m:
        return None
    try:
        return float(m[1]) * QUANTITY_MULT[m[2]]
    except ValueError:
        return None


def host_port(s):
    m = re.fullmatch(r"(\[[^\]]+\]|[^:]+):(\d+)", js(s)) if s is not None else None
    return {"host": m[1], "port": int(m[2])} if m else None


def selects(selector, labels):
    if not selector or not labels:
        return False
    return len(selector) > 0 and all(labels.get(k) == v for k, v in selector.items())


def sh(cmd, args, **kw):
    """Runs a command; returns stdout. Raises subprocess.CalledProcessError (with output)."""
    return subprocess.run([cmd, *args], check=True, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, **kw).stdout


def err_text(e):
    if isinstance(e, subprocess.CalledProcessError):
        return (e.stdout or "") + (e.stderr or "")
    return str(e)


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def server_env_vars():
    """The TQKV_* variables tqkv-server understands."""
    binary = os.environ.get("TQKV_SERVER")
    if binary and os.path.exists(binary):
        try:
            p = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
            help_text = p.stdout + p.stderr
        except (OSError, subprocess.SubprocessError) as e:
            help_text = str(e)
        found = set(re.findall(r"\[(TQKV_[A-Z0-9_]+)\]", help_text))
        if found:
            return {"vars": found, "from": f"{binary} --help"}
        fail("server", f"{binary} --help lists no [TQKV_*] variables")
    src = os.path.join(root, "service", "config.c")
    if not os.path.exists(src):
        fail("server", "neither TQKV_SERVER nor service/config.c is available to list TQKV_* variables")
        return {"vars": set(), "from": "nothing"}
    found = set(re.findall(r'\{"[a-z0-9-]+",\s*"(TQKV_[A-Z0-9_]+)"', read(src)))
    return {"vars": found, "from": "service/config.c"}


def known_metrics():
    """Metric names the server exposes: the families rendered by service/metrics*.c (the
    registry and its exposition text; with the histogram series suffixes)."""
    src = "".join(read(p) for p in sorted(glob.glob(os.path.join(root, "service", "metrics*.c"))))
    families = {re.sub(r"_$", "", m) for m in re.findall(r'"((?:tqkv|process)_[a-z0-9_]+)', src)}
    known = set()
    for f in families:
        known.add(f)
        for s in ("_bucket", "_sum", "_count"):
            known.add(f + s)
    return known


def check_promql(where, expr, known):
    """Checks a PromQL expression: balanced brackets, only metrics the server exports."""
    depth = 0
    for ch in expr:
        if ch in "({[":
            depth += 1
        if ch in ")}]":
            depth -= 1
        if depth < 0:
            break
    expect(depth == 0, where, f"unbalanced brackets in {expr}")
    stripped = re.sub(r'"[^"]*"', '""', expr)
    for m in re.findall(r"\b((?:tqkv|process)_[a-z0-9_]+)\b", stripped, re.A):
        expect(m in known, where, f"metric {m} is not exported by service/metrics*.c")
    # The tenant label is "tenant"; "namespace" is the Kubernetes label Prometheus attaches.
    expect(not re.search(r"\btqkv_namespace_", stripped, re.A), where,
           "tqkv_namespace_* was renamed tqkv_tenant_*")


def promtool_parse(where, exprs):
    """Parses PromQL with Prometheus' own parser: `promtool check rules` on a rule file
    holding the expressions (Grafana variables replaced by values of the right type).
    promtool has no bare query check; a recording rule per expression is the nearest.
    Returns the number of expressions checked."""
    promtool = os.environ.get("PROMTOOL") or "promtool"
    try:
        sh(promtool, ["--version"])
    except (OSError, subprocess.CalledProcessError):
        fail(where, f"{promtool} not found: install the Debian package prometheus (deploy/install-deps.sh)")
        return 0

    def subst(e):
        e = re.sub(r"\$__rate_interval|\$__interval|\$__range", "5m", e)
        return re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", ".*", e)

    rules = [f"      - record: tqkv:check_{i}\n        expr: {json.dumps(subst(e))}"
             for i, e in enumerate(exprs)]
    d = tempfile.mkdtemp(prefix="tqkv-promql-")
    path = os.path.join(d, "rules.yaml")
    with open(path, "w") as f:
        f.write("groups:\n  - name: check\n    rules:\n" + "\n".join(rules) + "\n")
    try:
        sh(promtool, ["check", "rules", path])
        R.checks += len(exprs)
    except subprocess.CalledProcessError as e:
        fail(where, f"promtool check rules: {tail_lines(err_text(e), 4)}")
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return len(exprs)


# ---------------------------------------------------------------- schema validation
#
# Built-in kinds: kubernetes-validate's "-strict" schemas, the Kubernetes OpenAPI with
# additionalProperties: false on every object (the API server with fieldValidation=Strict
# rejects unknown fields the same way; the plain schemas would let "replica:" through).
# CRDs: the cloudcoil models of cert-manager and prometheus-operator (pydantic models
# generated from the CRDs' openAPIV3Schema), turned into JSON schemas here and made as
# strict: every object with declared properties gets additionalProperties: false;
# optional fields lose their "or null"; open maps (labels, annotations, data) and fields
# the CRD leaves free stay open, as in the CRD.

CRD_MODELS = {
    "cert-manager.io/v1": "cloudcoil.models.cert_manager.v1",
    "monitoring.coreos.com/v1": "cloudcoil.models.prometheus_operator.v1",
}
_validators = {}
_core = {}


def k8s_version():
    import kubernetes_validate.utils as kvu

    want = os.environ.get("TQKV_K8S_VERSION")
    versions = kvu.all_versions()
    if not want:
        return versions[-1]
    want = want.lstrip("v")
    got = [v for v in versions if kvu.major_minor(v) == kvu.major_minor(want)]
    if not got:
        raise SystemExit(f"FAIL schema: TQKV_K8S_VERSION={want}: kubernetes-validate bundles {versions}")
    return got[-1]


def strict_crd_schema(s):
    if isinstance(s, dict):
        alts = s.get("anyOf")
        if isinstance(alts, list) and len(alts) == 2 and {"type": "null"} in alts:
            other = [a for a in alts if a != {"type": "null"}][0]
            del s["anyOf"]
            s.pop("default", None)
            s.update(other)
        if "properties" in s and "additionalProperties" not in s:
            s["additionalProperties"] = False
        for v in s.values():
            strict_crd_schema(v)
    elif isinstance(s, list):
        for v in s:
            strict_crd_schema(v)
    return s


def crd_schema(api_version, kind):
    """(the strict JSON schema of a CRD kind, where it comes from) or (None, why). Importing
    a cloudcoil models module builds thousands of pydantic classes (prometheus-operator:
    20-40 s here), so each schema is made once per venv and kept under the venv's
    share/tqkv-crd-schemas, keyed by the models package's version."""
    import importlib
    import importlib.metadata

    modname = CRD_MODELS[api_version]
    dist = modname.rsplit(".", 1)[0]
    try:
        ver = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None, f"{dist} is not installed (deploy/python/k8s.txt)"
    source = f"{dist} {ver}"
    cache = os.path.join(sys.prefix, "share", "tqkv-crd-schemas", f"{modname}-{ver}-{kind}.json")
    try:
        with open(cache) as f:
            return json.load(f), source
    except (OSError, ValueError):
        pass
    model = getattr(importlib.import_module(modname), kind, None)
    if model is None or not hasattr(model, "model_json_schema"):
        return None, f"{modname} has no model {kind}"
    schema = strict_crd_schema(model.model_json_schema(by_alias=True, mode="validation"))
    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        tmp = f"{cache}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(schema, f)
        os.replace(tmp, cache)
    except OSError:
        pass
    return schema, source


# The CRD kinds deploy/k8s renders (the `schemas` mode makes their schemas ahead).
CRD_KINDS = (("cert-manager.io/v1", "Certificate"), ("cert-manager.io/v1", "Issuer"),
             ("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule"))


def run_schemas():
    for api_version, kind in CRD_KINDS:
        schema, source = crd_schema(api_version, kind)
        if expect(schema, f"schema {api_version} {kind}", source):
            print(f"schema {api_version} {kind}: from {source}")


def validator_for(api_version, kind):
    """A jsonschema validator for apiVersion/kind, and where its schema comes from; or
    (None, why)."""
    key = (api_version, kind)
    if key in _validators:
        return _validators[key]
    import jsonschema

    res = (None, "no schema")
    if api_version in CRD_MODELS:
        schema, source = crd_schema(api_version, kind)
        res = (jsonschema.Draft202012Validator(schema), source) if schema else (None, source)
    else:
        import importlib.resources

        import kubernetes_validate
        import referencing

        if not _core:
            ver = k8s_version()
            _core["version"] = ver
            _core["dir"] = importlib.resources.files(kubernetes_validate).joinpath(
                "kubernetes-json-schema", f"v{ver}-local-strict")
            defs = json.loads(_core["dir"].joinpath("_definitions.json").read_text())
            _core["registry"] = referencing.Resource.from_contents(defs) @ referencing.Registry()
        api = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
        f = _core["dir"].joinpath(f"{kind.lower()}-{api}.json")
        if f.is_file():
            schema = json.loads(f.read_text())
            reg = referencing.Resource.from_contents(schema) @ _core["registry"]
            res = (jsonschema.Draft202012Validator(schema, registry=reg),
                   f"Kubernetes {_core['version']} (kubernetes-validate, strict)")
        else:
            res = (None, f"no {kind} {api_version} in the Kubernetes {_core['version']} schemas")
    _validators[key] = res
    return res


def schema_errors(obj):
    """([unknown field paths], [other schema errors], schema source) for one object; a
    missing schema is an error."""
    validator, source = validator_for(obj.get("apiVersion"), obj.get("kind"))
    if validator is None:
        return [], [source], source
    unknown, other = [], []
    for e in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path))):
        path = "".join(f"/{p}" for p in e.absolute_path)
        if e.validator == "additionalProperties" and e.validator_value is False and isinstance(e.instance, dict):
            declared = set(e.schema.get("properties", {}))
            pats = list(e.schema.get("patternProperties", {}))
            for k in e.instance:
                if k not in declared and not any(re.search(p, k) for p in pats):
                    unknown.append(f"{path}/{k}")
        else:
            other.append(f"{path or '/'}: {e.message}")
    return unknown, other, source


def validate_schema(label, objs):
    for o in objs:
        where = f"{label} {o.get('kind')}/{g(o, 'metadata', 'name')}"
        unknown, other, source = schema_errors(o)
        if other:
            fail(where, "schema: " + "; ".join(other[:5]) + (f" (+{len(other) - 5} more)" if len(other) > 5 else ""))
        else:
            R.checks += 1
        expect(not unknown, where, f"unknown fields {', '.join(unknown)}")


# ---------------------------------------------------------------- k8s


def render(d, base=None):
    absdir = os.path.join(base or os.path.join(root, "deploy", "k8s"), d)
    try:
        return sh(kubectl, ["kustomize", absdir])
    except (OSError, subprocess.CalledProcessError) as e:
        fail(f"kustomize {d}", tail_lines(getattr(e, "stderr", None) or str(e), 3))
        return None


def parse_docs(text):
    import yaml

    return [d for d in yaml.safe_load_all(text) if d]


def pod_security(where, pod_spec, containers):
    psc = pod_spec.get("securityContext") or {}
    expect(g(psc, "seccompProfile", "type") == "RuntimeDefault", where, "pod seccompProfile RuntimeDefault")
    expect(pod_spec.get("automountServiceAccountToken") is False, where, "automountServiceAccountToken false")
    for c in containers:
        cw = f"{where} container {c.get('name')}"
        sc = c.get("securityContext") or {}
        non_root = nz(sc.get("runAsNonRoot"), psc.get("runAsNonRoot"))
        uid = nz(sc.get("runAsUser"), psc.get("runAsUser"))
        expect(non_root is True, cw, "runAsNonRoot must be true")
        expect(is_num(uid, 65532), cw, f"runAsUser must be 65532 (image user), got {js(uid)}")
        expect(sc.get("readOnlyRootFilesystem") is True, cw, "readOnlyRootFilesystem must be true")
        expect(sc.get("allowPrivilegeEscalation") is False, cw, "allowPrivilegeEscalation must be false")
        expect(sc.get("privileged") is not True, cw, "must not be privileged")
        expect("ALL" in (g(sc, "capabilities", "drop") or []), cw, "capabilities.drop must include ALL")
        expect(not (g(sc, "capabilities", "add") or []), cw, "no added capabilities")
        seccomp = nz(g(sc, "seccompProfile", "type"), g(psc, "seccompProfile", "type"))
        expect(seccomp == "RuntimeDefault", cw, "seccompProfile RuntimeDefault")
        r = c.get("resources") or {}
        for k in ("cpu", "memory"):
            expect(g(r, "requests", k) is not None, cw, f"resources.requests.{k} must be set")
            expect(g(r, "limits", k) is not None, cw, f"resources.limits.{k} must be set")
        # The schema types quantities as int-or-string only: the syntax is checked here.
        for part in ("requests", "limits"):
            for k, v in (r.get(part) or {}).items():
                expect(parse_quantity(v) is not None, cw, f"resources.{part}.{k}={js(v)} is not a Kubernetes quantity")
        rq = parse_quantity(g(r, "requests", "memory"))
        lm = parse_quantity(g(r, "limits", "memory"))
        expect(rq is not None and lm is not None and rq <= lm, cw, "memory request <= limit")


def check_server(variant, objs, env_vars):
    W = f"overlays/{variant}"

    def by_kind(k):
        return [o for o in objs if o.get("kind") == k]

    sts = by_kind("StatefulSet")
    if not expect(len(sts) == 1, W, f"exactly one StatefulSet, got {len(sts)}"):
        return None
    ss = sts[0]
    spec = ss.get("spec") or {}
    ws = f"{W} StatefulSet/{g(ss, 'metadata', 'name')}"
    expect(g(ss, "metadata", "name") == "tqkv", ws, "named tqkv")
    expect(is_num(spec.get("replicas"), 3), ws, f"replicas 3, got {js(spec.get('replicas'))}")
    expect(spec.get("podManagementPolicy") == "Parallel", ws, "podManagementPolicy Parallel")
    pod_labels = g(spec, "template", "metadata", "labels") or {}
    expect(selects(g(spec, "selector", "matchLabels"), pod_labels), ws, "selector matches the pod labels")
    pod = g(spec, "template", "spec") or {}
    containers = pod.get("containers") or []
    pod_security(ws, pod, containers + (pod.get("initContainers") or []))
    expect(pod.get("enableServiceLinks") is False, ws,
           "enableServiceLinks false (Service 'tqkv' would inject TQKV_* variables)")
    spread = len(pod.get("topologySpreadConstraints") or []) > 0
    anti = bool(g(pod, "affinity", "podAntiAffinity"))
    expect(spread or anti, ws, "topologySpreadConstraints or podAntiAffinity")
    for t in pod.get("topologySpreadConstraints") or []:
        expect(selects(g(t, "labelSelector", "matchLabels"), pod_labels), ws,
               f"spread on {js(t.get('topologyKey'))} selects the pods")

    c = next((x for x in containers if x.get("name") == "tqkv"), None)
    if not expect(c, ws, "a container named tqkv"):
        return None
    cw = f"{ws} container tqkv"
    ports = {p.get("name"): p.get("containerPort") for p in c.get("ports") or []}
    expect(is_num(ports.get("grpc"), 50051), cw, "port grpc 50051")
    expect(is_num(ports.get("metrics"), 9090), cw, "port metrics 9090")
    # The kubelet's gRPC probes cannot speak TLS: HTTP probes on the metrics port, where
    # /readyz follows the KV service's health (503 while draining).
    probes = {"startupProbe": "/livez", "livenessProbe": "/livez", "readinessProbe": "/readyz"}
    for name, want in probes.items():
        p = c.get(name)
        if not expect(g(p, "httpGet"), cw, f"{name} must be an httpGet probe (gRPC probes cannot do TLS)"):
            continue
        hg = p["httpGet"]
        expect(hg.get("port") == "metrics" or hg.get("port") == ports.get("metrics"), cw, f"{name} on the metrics port")
        expect(hg.get("path") == want, cw, f"{name} path {want}")
        expect(nz(hg.get("scheme"), "HTTP") == "HTTP", cw, f"{name} scheme HTTP")
        expect(not p.get("grpc") and not p.get("tcpSocket") and not p.get("exec"), cw,
               f"{name} has only the httpGet handler")
    period = g(c, "readinessProbe", "periodSeconds")
    expect(isinstance(period, (int, float)) and period <= 10, cw, "readiness checked at least every 10 s")

    # ConfigMap(s) given to the container, with kustomize's hash suffix.
    cms = by_kind("ConfigMap")
    env = {}
    for ef in c.get("envFrom") or []:
        if not ef.get("configMapRef"):
            continue
        ref = g(ef, "configMapRef", "name")
        cm = next((m for m in cms if g(m, "metadata", "name") == ref), None)
        if not expect(cm, cw, f"envFrom ConfigMap {js(ref)} is rendered"):
            continue
        expect(re.fullmatch(r"tqkv-config(-[a-z0-9]+)?", g(cm, "metadata", "name") or ""), cw, "ConfigMap is tqkv-config")
        env.update(cm.get("data") or {})
    for e in c.get("env") or []:
        if "value" in e and e["value"] is not None:
            env[e.get("name")] = e["value"]
    expect(len(env) > 0, cw, "configured from the tqkv-config ConfigMap")
    for k, v in env.items():
        expect(str(k).startswith("TQKV_"), cw, f"config key {k} is not a TQKV_* variable")
        expect(k in env_vars["vars"], cw, f"{k} is not a variable tqkv-server understands (per {env_vars['from']})")
        expect(len(js(v)) > 0, cw, f"{k} is empty (the server rejects empty values)")
    for e in c.get("env") or []:
        n = e.get("name") or ""
        expect(n in env_vars["vars"] if n.startswith("TQKV_") else True, cw, f"env {n} unknown")
    # The flags the image adds would override the ConfigMap's listen addresses.
    expect(c.get("command") == ["/usr/local/bin/tqkv-server"], cw,
           "command is the bare server (the image ENTRYPOINT's flags would win over TQKV_LISTEN)")
    expect(not (c.get("args") or []), cw, "no args: the ConfigMap is the configuration")
    listen = host_port(env.get("TQKV_LISTEN"))
    expect(listen and listen["port"] == ports.get("grpc"), cw,
           f"TQKV_LISTEN port is the grpc port ({js(env.get('TQKV_LISTEN'))})")
    expect(listen and listen["host"] == "0.0.0.0", cw, "TQKV_LISTEN on 0.0.0.0 (probes and Services reach the pod IP)")
    if env.get("TQKV_DATA_LISTEN") is not None:
        dl = host_port(env["TQKV_DATA_LISTEN"])
        expect(dl and dl["port"] == ports.get("data"), cw,
               f"TQKV_DATA_LISTEN port is the data container port ({env['TQKV_DATA_LISTEN']})")
        expect(dl and dl["host"] == "0.0.0.0", cw, "TQKV_DATA_LISTEN on 0.0.0.0 (clients reach the pod IP)")
        expect(is_num(ports.get("data"), 50052), cw, "port data 50052 (the NetworkPolicy's data port)")
    ml = host_port(env.get("TQKV_METRICS_LISTEN"))
    expect(ml and ml["port"] == ports.get("metrics"), cw,
           f"TQKV_METRICS_LISTEN port is the metrics port ({js(env.get('TQKV_METRICS_LISTEN'))})")
    for k in ("TQKV_DRAM_CAPACITY", "TQKV_HBM_CAPACITY", "TQKV_MAX_MESSAGE_BYTES", "TQKV_NS_QUOTA"):
        if env.get(k) is not None:
            expect(parse_server_bytes(env[k]) is not None, cw, f"{k}={js(env[k])} is not a byte count")
    for k in ("TQKV_KEY_BITS", "TQKV_VALUE_BITS", "TQKV_BOUNDARY_KEY_BITS", "TQKV_BOUNDARY_VALUE_BITS"):
        if env.get(k) is not None:
            expect(js(env[k]) in ("1", "1.5", "2", "2.5", "3", "3.5", "4"), cw, f"{k}={js(env[k])}")
    for k in ("TQKV_THREADS", "TQKV_ENCODER_THREADS", "TQKV_DRAIN_SECONDS", "TQKV_MAX_STREAMS"):
        if env.get(k) is not None:
            expect(re.fullmatch(r"\d+", js(env[k])), cw, f"{k}={js(env[k])} is not a number")

    # Memory limit covers the DRAM tier plus overhead.
    limits = g(c, "resources", "limits") or {}
    dram = parse_server_bytes(nz(env.get("TQKV_DRAM_CAPACITY"), "1G")) or 0
    lim = parse_quantity(limits.get("memory"))
    need = dram + max(512 * 2**20, dram / 10)
    expect(lim is not None and lim >= need, cw,
           f"memory limit {js(limits.get('memory'))} must exceed TQKV_DRAM_CAPACITY "
           f"{js(env.get('TQKV_DRAM_CAPACITY'))} + overhead (>= {need / 2**30:.2f}Gi)")
    threads = num(env.get("TQKV_THREADS") or 0)
    cpu_lim = parse_quantity(limits.get("cpu"))
    expect(not threads or (cpu_lim is not None and threads <= math.ceil(cpu_lim)), cw,
           f"TQKV_THREADS {js(threads)} <= cpu limit {js(cpu_lim)}")

    # Graceful shutdown: preStop + drain + margin fit in the grace period.
    drain = num(nz(env.get("TQKV_DRAIN_SECONDS"), 20))
    pre = g(c, "lifecycle", "preStop")
    pre_secs = 0.0
    if g(pre, "exec", "command"):
        cmd = pre["exec"]["command"]
        pre_secs = num(cmd[1] if len(cmd) > 1 else None) if re.search(r"sleep$", str(cmd[0])) else 0.0
    elif g(pre, "sleep"):
        pre_secs = num(g(pre, "sleep", "seconds"))
    grace = nz(pod.get("terminationGracePeriodSeconds"), 30)
    handoff = num(nz(env.get("TQKV_HANDOFF_SECONDS"), 10)) if env.get("TQKV_PEERS") else 0.0
    expect(num(grace) >= drain + pre_secs + handoff + 5, ws,
           f"terminationGracePeriodSeconds {js(grace)} < preStop {js(pre_secs)} + TQKV_HANDOFF_SECONDS "
           f"{js(handoff)} + TQKV_DRAIN_SECONDS {js(drain)} + 5 s margin")
    expect(any(m.get("mountPath") == "/tmp" for m in c.get("volumeMounts") or []), cw,
           "writable /tmp (root fs is read-only)")

    # Services.
    svcs = by_kind("Service")
    headless = next((s for s in svcs if g(s, "metadata", "name") == "tqkv-headless"), None)
    if expect(headless, W, "Service tqkv-headless"):
        hw = f"{W} Service/tqkv-headless"
        hs = headless.get("spec") or {}
        expect(hs.get("clusterIP") == "None", hw, "clusterIP None (headless)")
        expect(hs.get("publishNotReadyAddresses") is False, hw, "publishNotReadyAddresses false")
        expect(selects(hs.get("selector"), pod_labels), hw, "selects the StatefulSet's pods")
        expect(spec.get("serviceName") == "tqkv-headless", ws, "serviceName tqkv-headless")
        gp = next((p for p in hs.get("ports") or [] if p.get("name") == "grpc"), None)
        expect(gp and (gp.get("targetPort") == "grpc" or is_num(gp.get("targetPort"), 50051))
               and is_num(gp.get("port"), 50051), hw, "grpc port 50051 -> grpc")
        if ports.get("data") is not None:
            dp = next((p for p in hs.get("ports") or [] if p.get("name") == "data"), None)
            expect(dp and (dp.get("targetPort") == "data" or dp.get("targetPort") == ports["data"])
                   and dp.get("port") == ports["data"], hw,
                   f"data port {js(ports['data'])} -> data (clients reach each pod's data channel listener)")
    svc = next((s for s in svcs if g(s, "metadata", "name") == "tqkv"), None)
    if expect(svc, W, "Service tqkv"):
        sw = f"{W} Service/tqkv"
        sp = svc.get("spec") or {}
        expect(nz(sp.get("type"), "ClusterIP") == "ClusterIP", sw, "type ClusterIP")
        expect(sp.get("clusterIP") != "None", sw, "not headless")
        expect(selects(sp.get("selector"), pod_labels), sw, "selects the StatefulSet's pods")
        for p in sp.get("ports") or []:
            tp = p.get("targetPort")
            expect(is_int(tp) or ports.get(tp) is not None, sw, f"targetPort {js(tp)} is a named container port")
            expect(tp != "data" and (tp is None or tp != ports.get("data")), sw,
                   "no data channel port on the load-balanced Service (the connection could reach another pod than the channel's)")
    for s in svcs:
        for p in g(s, "spec", "ports") or []:
            if isinstance(p.get("targetPort"), str):
                expect(ports.get(p["targetPort"]) is not None, f"{W} Service/{g(s, 'metadata', 'name')}",
                       f"targetPort {p['targetPort']} exists")

    pdbs = by_kind("PodDisruptionBudget")
    if expect(len(pdbs) == 1, W, "one PodDisruptionBudget"):
        pw = f"{W} PodDisruptionBudget/{g(pdbs[0], 'metadata', 'name')}"
        expect(is_num(g(pdbs[0], "spec", "maxUnavailable"), 1), pw, "maxUnavailable 1")
        expect(selects(g(pdbs[0], "spec", "selector", "matchLabels"), pod_labels), pw, "selects the pods")
    nss = by_kind("Namespace")
    ns = nss[0] if nss else None
    ns_name = g(ns, "metadata", "name")
    for o in objs:
        if o.get("kind") != "Namespace":
            expect(g(o, "metadata", "namespace") == ns_name, f"{W} {o.get('kind')}/{g(o, 'metadata', 'name')}",
                   f"in namespace {js(ns_name)}")
    expect(g(ns, "metadata", "labels", "pod-security.kubernetes.io/enforce") == "restricted", W,
           "namespace enforces the restricted Pod Security Standard")

    check_security(variant, objs, ss, c, env, ports, pod_labels, ns_name)

    # Variant specifics.
    gpu_lim = limits.get("nvidia.com/gpu")
    if variant == "gpu":
        expect(js(gpu_lim) == "1", cw, "limits nvidia.com/gpu: 1")
        gpu_req = g(c, "resources", "requests", "nvidia.com/gpu")
        expect(gpu_req is None or js(gpu_req) == js(gpu_lim), cw, "GPU request equals limit")
        expect(len(pod.get("nodeSelector") or {}) > 0, ws, "nodeSelector for GPU nodes")
        expect(any(t.get("key") == "nvidia.com/gpu" for t in pod.get("tolerations") or []), ws,
               "tolerates nvidia.com/gpu")
        expect(js(env.get("TQKV_DEVICE")) == "0", cw, "TQKV_DEVICE=0")
        expect((parse_server_bytes(env.get("TQKV_HBM_CAPACITY")) or 0) > 0, cw, "TQKV_HBM_CAPACITY > 0")
        expect(not env.get("TQKV_HBM_STANDIN") or env.get("TQKV_HBM_STANDIN") == "false", cw,
               "no HBM stand-in with a real device")
        expect(re.search(r"cuda", js(c.get("image"))), cw, f"a CUDA image (got {js(c.get('image'))})")
    else:
        expect(gpu_lim is None, cw, "no GPU on the cpu overlay")
        expect(env.get("TQKV_DEVICE") is None, cw,
               "no TQKV_DEVICE on the cpu overlay (built without CUDA it is an error)")
        expect(not re.search(r"cuda", js(c.get("image"))), cw, f"a CPU image (got {js(c.get('image'))})")
    return {"svcs": svcs, "ns": ns_name, "replicas": spec.get("replicas"), "env": env}


def secure(variant):
    return variant != "insecure-dev"


TLS_DIR = "/etc/tqkv/tls"


def mount_of(pod, c, file):
    """The volume (and its mount) that holds file path in container c, or (None, None)."""
    m = next((v for v in c.get("volumeMounts") or []
              if js(file).startswith(re.sub(r"/$", "", v.get("mountPath") or "") + "/")), None)
    v = next((x for x in pod.get("volumes") or [] if x.get("name") == m.get("name")), None) if m else None
    return m, v


def check_secret_file(where, pod, c, file, secret_name, key):
    """A Secret-backed file: the mount is read-only, not a subPath (subPath mounts never see
    a Secret update, so a rotation would not reach the server), and the key exists."""
    m, v = mount_of(pod, c, file)
    if not expect(m and v, where, f"{file} is on a mounted volume"):
        return
    expect(g(v, "secret", "secretName") == secret_name, where, f"{file} comes from the Secret {secret_name}")
    expect(m.get("readOnly") is True, where, f"{m.get('mountPath')} mounted readOnly")
    expect(not m.get("subPath") and not m.get("subPathExpr"), where,
           f"{m.get('mountPath')} not a subPath mount (Secret updates must reach the file)")
    name = file[len(re.sub(r"/$", "", m.get("mountPath"))) + 1:]
    items = g(v, "secret", "items")
    expect(not items or any(i.get("key") == key and i.get("path") == name for i in items), where,
           f"{file} is the Secret's key {key}")
    if not items:
        expect(name == key, where, f"{file} is the Secret's key {key}")
    mode = g(v, "secret", "defaultMode")
    expect(mode is None or (is_int(mode) and (mode & 0o007) == 0), where,
           f"{v.get('name')}: no access for others (defaultMode {oct(mode)[2:] if is_int(mode) else js(mode)})")


def check_network_policy(W, objs, ports, pod_labels, env):
    nps = [o for o in objs if o.get("kind") == "NetworkPolicy"
           and selects(g(o, "spec", "podSelector", "matchLabels"), pod_labels)]
    if not expect(len(nps) == 1, W, f"one NetworkPolicy selecting the server pods, got {len(nps)}"):
        return None
    np_ = nps[0]
    nw = f"{W} NetworkPolicy/{g(np_, 'metadata', 'name')}"
    expect("Ingress" in (g(np_, "spec", "policyTypes") or []), nw, "policyTypes includes Ingress")
    client_ports = [50051, 50052]
    covered = set()
    peers_admitted = False
    for i, r in enumerate(g(np_, "spec", "ingress") or []):
        rw = f"{nw} ingress[{i}]"
        frm = r.get("from") or []
        rports = [ports.get(p.get("port")) if isinstance(p.get("port"), str) else p.get("port")
                  for p in r.get("ports") or []]
        if not expect(len(frm) > 0, rw, "names its sources (a rule without 'from' admits everyone)"):
            continue
        if not expect(len(rports) > 0, rw, "names its ports (a rule without 'ports' opens every port)"):
            continue
        covered.update(rports)
        expect(not any(f.get("ipBlock") for f in frm), rw, "no ipBlock sources")
        to_clients = any(p in client_ports for p in rports)
        to_metrics = ports.get("metrics") in rports
        expect(not (to_clients and to_metrics), rw, "client ports and the metrics port in separate rules")
        # The servers' own pods, as peers (hand-off, forwarding): this namespace, gRPC only.
        peer_rule = all(not f.get("namespaceSelector") and f.get("podSelector")
                        and not g(f, "podSelector", "matchLabels", "tqkv.io/client")
                        and selects(g(f, "podSelector", "matchLabels"), pod_labels) for f in frm)
        if peer_rule:
            expect(len(rports) == 1 and rports[0] == ports.get("grpc"), rw,
                   f"the peers' rule opens only the gRPC port, got {js(rports)}")
            peers_admitted = True
        elif to_clients:
            expect(all(p in client_ports for p in rports), rw, f"client rule opens only gRPC/data ports, got {js(rports)}")
            for f in frm:
                expect(g(f, "podSelector", "matchLabels", "tqkv.io/client") == "true", rw,
                       "every source is a pod labelled tqkv.io/client=true")
        if to_metrics:
            expect(all(p == ports.get("metrics") for p in rports), rw, "metrics rule opens only the metrics port")
            for f in frm:
                expect(g(f, "namespaceSelector", "matchLabels", "kubernetes.io/metadata.name") == "monitoring", rw,
                       "metrics sources are the monitoring namespace only")
    for name, p in ports.items():
        expect(p in covered, nw, f"container port {name} ({js(p)}) is admitted by a rule (else clients or Prometheus are cut off)")
    if env.get("TQKV_PEERS"):
        expect(peers_admitted, nw, "a rule admits the server pods to gRPC (TQKV_PEERS: hand-off and forwarding)")
    return np_


def check_security(variant, objs, ss, c, env, ports, pod_labels, ns_name):
    W = f"overlays/{variant}"
    cw = f"{W} StatefulSet/{g(ss, 'metadata', 'name')} container tqkv"
    pod = g(ss, "spec", "template", "spec") or {}
    check_network_policy(W, objs, ports, pod_labels, env)
    expect(not any(o.get("kind") == "Secret" for o in objs), W, "no Secret in the manifests (secrets are not committed)")
    note = g(ss, "metadata", "annotations", "tqkv.io/insecure")
    if secure(variant):
        expect(not note, W, "no tqkv.io/insecure annotation on a secure overlay")
        for k in ("TQKV_TLS_CERT", "TQKV_TLS_KEY", "TQKV_AUTH_TOKENS"):
            expect(env.get(k), cw, f"{k} set (secure by default)")
        if env.get("TQKV_TLS_CERT"):
            check_secret_file(cw, pod, c, env["TQKV_TLS_CERT"], "tqkv-tls", "tls.crt")
        if env.get("TQKV_TLS_KEY"):
            check_secret_file(cw, pod, c, env["TQKV_TLS_KEY"], "tqkv-tls", "tls.key")
        if env.get("TQKV_AUTH_TOKENS"):
            check_secret_file(cw, pod, c, env["TQKV_AUTH_TOKENS"], "tqkv-auth", "tokens")
        if env.get("TQKV_TLS_CLIENT_CA"):
            check_secret_file(cw, pod, c, env["TQKV_TLS_CLIENT_CA"], "tqkv-tls", "ca.crt")
        # With TLS the data channels are TLS 1.3 too (same certificate and client CA).
        expect(env.get("TQKV_DATA_LISTEN") is not None, cw, "TCP data channels on (TLS with the gRPC certificate)")
        # Hand-off on drain and forwarding, over TLS with the peer token (docs/cluster.md).
        peers = host_port(env.get("TQKV_PEERS"))
        expect(peers and peers["host"] == "tqkv-headless" and peers["port"] == ports.get("grpc"), cw,
               f"TQKV_PEERS is the headless Service at the grpc port (hand-off on drain), got {js(env.get('TQKV_PEERS'))}")
        expect(num(env.get("TQKV_HANDOFF_SECONDS")) > 0, cw,
               f"TQKV_HANDOFF_SECONDS > 0, got {js(env.get('TQKV_HANDOFF_SECONDS'))}")
        peer_ca = env.get("TQKV_PEER_CA") or env.get("TQKV_TLS_CLIENT_CA")
        if expect(peer_ca, cw, "TQKV_PEER_CA set: peers are verified against the CA (TLS to peers)"):
            check_secret_file(cw, pod, c, peer_ca, "tqkv-tls", "ca.crt")
        if expect(env.get("TQKV_PEER_TOKEN_FILE"), cw, "TQKV_PEER_TOKEN_FILE set (the hand-off's token where auth is on)"):
            check_secret_file(cw, pod, c, env["TQKV_PEER_TOKEN_FILE"], "tqkv-auth", "peer-token")
        expect(not env.get("TQKV_NO_FORWARD") or env.get("TQKV_NO_FORWARD") == "false", cw,
               "forwarding on (TLS carries the callers' tokens)")
    else:
        for k in ("TQKV_TLS_CERT", "TQKV_TLS_KEY", "TQKV_AUTH_TOKENS", "TQKV_PEER_CA", "TQKV_PEER_TOKEN_FILE"):
            expect(not env.get(k), cw, f"{k} not set on insecure-dev (no Secret to mount)")
        expect(note and re.search(r"TLS off", note) and re.search(r"tokens off", note), W,
               f"the StatefulSet says what is off (annotation tqkv.io/insecure), got {js(note)}")
        expect(g(ss, "spec", "template", "metadata", "annotations", "tqkv.io/insecure") == note, W, "... on the pods too")
        try:
            text = read(os.path.join(root, "deploy", "k8s", "overlays", variant, "kustomization.yaml"))
        except OSError:
            text = ""
        expect(re.search(r"turns off", text, re.I) and re.search(r"TLS", text) and re.search(r"token", text, re.I), W,
               "kustomization.yaml says what it turns off (TLS, tokens)")
        expect(not any(v.get("secret") for v in pod.get("volumes") or []), W, "no Secret volumes (none needed)")
    # Peers in clear only where everything is in clear.
    expect(not env.get("TQKV_PEERS") or env.get("TQKV_TLS_CERT") or variant == "insecure-dev", cw,
           "TQKV_PEERS without TQKV_TLS_CERT: hand-off and forwarding would talk to peers in clear (only overlays/insecure-dev may)")
    if variant == "cert-manager":
        check_cert_manager(W, objs, pod, c, env, ns_name)


def check_cert_manager(W, objs, pod, c, env, ns_name):
    _, vol = mount_of(pod, c, env.get("TQKV_TLS_CERT") or TLS_DIR + "/tls.crt")
    tls_secret = g(vol, "secret", "secretName")
    certs = [o for o in objs if o.get("kind") == "Certificate" and g(o, "spec", "secretName") == tls_secret]
    if not expect(len(certs) == 1, W, f"one cert-manager Certificate writing the Secret {js(tls_secret)}"):
        return
    cert = certs[0].get("spec") or {}
    cw = f"{W} Certificate/{g(certs[0], 'metadata', 'name')}"
    names = cert.get("dnsNames") or []
    for n in (f"tqkv.{ns_name}.svc", f"*.tqkv-headless.{ns_name}.svc", "*.tqkv-headless"):
        expect(n in names, cw, f"dnsNames include {n} (clients reach the Service and each pod)")
    expect("server auth" in (cert.get("usages") or []), cw, "usages include server auth")
    expect("client auth" in (cert.get("usages") or []), cw,
           "usages include client auth (peers present the certificate to each other)")
    peer_name = env.get("TQKV_PEER_TLS_NAME") or g(host_port(env.get("TQKV_PEERS")), "host")
    if peer_name:
        expect(peer_name in names, cw, f"dnsNames include {peer_name} (the name peers check: TQKV_PEERS)")
    expect(g(cert, "privateKey", "rotationPolicy") == "Always", cw,
           "privateKey.rotationPolicy Always (a new key at each renewal)")

    def hours(d):
        m = re.fullmatch(r"(\d+)h", d or "") if isinstance(d, str) or d is None else None
        return int(m[1]) if m else math.nan

    expect(hours(cert.get("renewBefore")) > 0 and hours(cert.get("renewBefore")) < hours(cert.get("duration")), cw,
           "renewBefore < duration")
    ref = cert.get("issuerRef") or {}
    expect(ref.get("kind") == "ClusterIssuer" or any(o.get("kind") == "Issuer" and g(o, "metadata", "name") == ref.get("name")
                                                     for o in objs), cw,
           f"issuerRef {js(ref.get('kind'))}/{js(ref.get('name'))} is rendered (or a ClusterIssuer)")


def check_bench(objs, replicas):
    W = "bench"
    jobs = [o for o in objs if o.get("kind") == "Job"]
    if not expect(len(jobs) == 1, W, "one Job"):
        return
    job = jobs[0]
    jspec = job.get("spec") or {}
    jw = f"{W} Job/{g(job, 'metadata', 'name')}"
    pod = g(jspec, "template", "spec") or {}
    expect(pod.get("restartPolicy") in ("Never", "OnFailure"), jw, "restartPolicy Never/OnFailure")
    deadline = jspec.get("activeDeadlineSeconds")
    expect(num(deadline) > 0 if deadline is not None else False, jw, "activeDeadlineSeconds bounds the run")
    containers = pod.get("containers") or []
    pod_security(jw, pod, containers)
    if not expect(containers, jw, "a container"):
        return
    c = containers[0]
    argv = [str(a) for a in (c.get("command") or []) + (c.get("args") or [])]
    expect(re.search(r"tqkv-bench$", argv[0] if argv else ""), jw, "runs tqkv-bench")

    def flag(f):
        if f in argv:
            i = argv.index(f)
            return argv[i + 1] if i + 1 < len(argv) else None
        return None

    targets = [a for i, a in enumerate(argv) if i > 0 and argv[i - 1] == "--target"]
    expect(len(targets) > 0, jw, "at least one --target")
    for t in targets:
        expect(re.fullmatch(r"(dns:///)?(tqkv-\d+\.)?tqkv-headless(\.[a-z0-9.-]+)?:50051", t), jw,
               f"--target {t} is not the headless Service (or a pod under it) on the gRPC port")
    per_pod = [int(re.search(r"tqkv-(\d+)\.", t)[1]) for t in targets if re.search(r"tqkv-\d+\.", t)]
    if per_pod:
        expect(len(per_pod) == replicas and all(n == i for i, n in enumerate(per_pod)), jw,
               f"one --target per StatefulSet replica (tqkv-0..tqkv-{js(num(replicas) - 1)}), got {' '.join(targets)}")
    duration = num(flag("--duration"))
    expect(duration > 0, jw, "--duration N")
    expect(duration < num(deadline), jw, "--duration shorter than the deadline")
    expect(flag("--json") == "-", jw, "--json -")
    expect(g(job, "metadata", "namespace") == "tqkv", jw, "in namespace tqkv (same as the servers)")
    # A client of the secure base: admitted by the NetworkPolicy, verifies TLS, sends a
    # token from a Secret (not written in the manifest), and never sees the server's key.
    expect(g(jspec, "template", "metadata", "labels", "tqkv.io/client") == "true", jw,
           "pod labelled tqkv.io/client=true (the NetworkPolicy admits only those)")
    ca = flag("--tls-ca")
    if expect(ca, jw, "--tls-ca (the servers speak TLS)"):
        m, v = mount_of(pod, c, ca)
        items = g(v, "secret", "items") or []
        expect(m and g(v, "secret") and len(items) == 1 and items[0].get("key") == "ca.crt", jw,
               f"{ca} from a volume holding only ca.crt (not the server's tls.key)")
    tok = flag("--token")
    ref = re.fullmatch(r"\$\(([A-Z_][A-Z0-9_]*)\)", tok or "")
    ev = next((e for e in c.get("env") or [] if e.get("name") == ref[1]), None) if ref else None
    expect(g(ev, "valueFrom", "secretKeyRef", "name") == "tqkv-auth", jw,
           f"--token from the Secret tqkv-auth through $(VAR) (got {js(tok)})")
    expect(not any(e.get("value") and re.search(r"token", e.get("name") or "", re.I) for e in c.get("env") or []), jw,
           "no literal token in the manifest")


def check_monitoring(objs, server_svcs, ns_name):
    W = "monitoring"
    sms = [o for o in objs if o.get("kind") == "ServiceMonitor"]
    if not expect(len(sms) == 1, W, "one ServiceMonitor"):
        return
    sm = sms[0]
    smspec = sm.get("spec") or {}
    mw = f"{W} ServiceMonitor/{g(sm, 'metadata', 'name')}"
    matched = [s for s in server_svcs if selects(g(smspec, "selector", "matchLabels"), g(s, "metadata", "labels"))]
    expect(len(matched) == 1, mw,
           f"selects exactly one Service (got {','.join(g(s, 'metadata', 'name') for s in matched)}): one scrape per pod")
    names = g(smspec, "namespaceSelector", "matchNames")
    expect(not names or ns_name in names or g(sm, "metadata", "namespace") == ns_name, mw, f"looks in namespace {js(ns_name)}")
    for ep in smspec.get("endpoints") or []:
        expect(ep.get("port") == "metrics", mw, "endpoint port metrics")
        expect(nz(ep.get("path"), "/metrics") == "/metrics", mw, "path /metrics")
        expect(ep.get("honorLabels") is not True, mw,
               "no honorLabels: the tenant label is 'tenant', and honouring exported labels would let a scraped target overwrite namespace/pod")
        if matched:
            expect(any(p.get("name") == ep.get("port") for p in g(matched[0], "spec", "ports") or []), mw,
                   f"Service has port {js(ep.get('port'))}")
    known = known_metrics()
    rules = [r for o in objs if o.get("kind") == "PrometheusRule"
             for grp in g(o, "spec", "groups") or [] for r in grp.get("rules") or []]
    expect(len(rules) > 0, W, "a PrometheusRule with alerts")
    for r in rules:
        rw = f"{W} alert {js(r.get('alert'))}"
        expect(re.fullmatch(r"[A-Z][A-Za-z0-9]+", r.get("alert") or ""), rw, "CamelCase alert name")
        expect(g(r, "labels", "severity") in ("critical", "warning", "info"), rw, "severity label")
        expect(g(r, "annotations", "summary"), rw, "summary annotation")
        check_promql(rw, js(r.get("expr")), known)
    n = promtool_parse(f"{W} PrometheusRule", [js(r.get("expr")) for r in rules])
    if not R.quiet:
        print(f"monitoring: {n} alert expressions parsed by promtool")
    for what, rx in (("server errors", r"tqkv_requests_total"),
                     ("credential reload rejected", r"tqkv_credential_reloads_total\{[^}]*rejected"),
                     ("file descriptors", r"process_open_fds")):
        expect(any(re.search(rx, js(r.get("expr"))) for r in rules), W, f"an alert on {what}")


# The real server with an overlay's ConfigMap as its environment.


def run_server(env, args):
    """Starts the server (tests/support's ServerProcess) with the overlay's TQKV_* variables
    as its only ones; ok when it printed 'listening on' and its metrics port (60 s). "err":
    its stderr when it did not start."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("TQKV_")}
    base.update({k: js(v) for k, v in env.items()})
    try:
        s = ServerProcess(os.environ["TQKV_SERVER"], args, env=base, start_timeout=60,
                          want_metrics=True, drain_stdout=True)
    except ServerStartError as e:
        return {"started": False, "why": e.why, "err": e.stderr}
    if not s.metrics_port:
        s.kill()
        s.close()
        return {"started": False, "why": "no 'metrics on port' line", "err": s.stderr_text()}
    return {"started": True, "metrics_port": s.metrics_port, "srv": s, "err": ""}


def data_channel_port(s):
    """The data channel port the server logged ("TCP data channels" ... port=N, text or
    JSON; on stderr, possibly just after the listening line): waits for the line (5 s)."""
    m = s.wait_stderr(r'TCP data channels.*?\bport["=:]+"?(\d+)', 5)
    return int(m[1]) if m else 0


def http_get(port, path):
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", path)
        r = conn.getresponse()
        body = r.read().decode("utf-8", "replace")
        conn.close()
        return r.status, body
    except (OSError, http.client.HTTPException) as e:
        return 0, str(e)


def tls_verifies(port, ca, servername, alpn=("h2",)):
    """A TLS handshake with the server as a client in the cluster makes it: the pod's DNS
    name (tqkv-0.tqkv-headless.tqkv.svc) verified against the trial CA, ALPN h2."""
    try:
        ctx = ssl.create_default_context(cafile=ca)
        # The CA file is the only trust anchor: a leaf in it does not count as one.
        ctx.verify_flags &= ~getattr(ssl, "VERIFY_X509_PARTIAL_CHAIN", 0)
        if alpn:
            ctx.set_alpn_protocols(list(alpn))
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            with ctx.wrap_socket(raw, server_hostname=servername) as s:
                return {"ok": True, "alpn": s.selected_alpn_protocol(), "version": s.version()}
    except (OSError, ssl.SSLError, ValueError) as e:
        return {"ok": False, "why": str(e)}


def server_accepts(variant, env_in, trial):
    """Starts the real tqkv-server with the overlay's ConfigMap as its environment (listen
    addresses (gRPC, metrics, data channels) moved to loopback port 0 and capacities shrunk
    by flags, which win over variables) and checks that it accepts the configuration,
    serves /metrics, and stops cleanly on SIGTERM. Without a GPU (or a CUDA build) the HBM
    tier runs as a host stand-in."""
    W = f"overlays/{variant} ConfigMap with {os.environ.get('TQKV_SERVER')}"
    # The Secrets' files as trial-secrets.sh makes them, where the pod would mount them.
    env = dict(env_in)
    if env.get("TQKV_TLS_CERT") or env.get("TQKV_AUTH_TOKENS"):
        if not expect(trial, W, "trial-secrets.sh output to stand in for the Secrets"):
            return
        for k, t in (("TQKV_TLS_CERT", "cert"), ("TQKV_TLS_KEY", "key"), ("TQKV_AUTH_TOKENS", "tokens"),
                     ("TQKV_TLS_CLIENT_CA", "ca"), ("TQKV_PEER_CA", "ca"), ("TQKV_PEER_TOKEN_FILE", "peer_token")):
            if env.get(k):
                env[k] = trial[t]
    args = ["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--dram-capacity", "64M",
            "--threads", "2", "--encoder-threads", "2"]
    if env.get("TQKV_DATA_LISTEN"):
        args += ["--data-listen", "127.0.0.1:0"]
    if env.get("TQKV_HBM_CAPACITY"):
        args += ["--hbm-capacity", "32M"]
    disk_dir = None
    if env.get("TQKV_DISK_PATH"):
        # The disk overlay's volume path, redirected to a scratch directory here.
        disk_dir = tempfile.mkdtemp(prefix="tqkv-k8s-disk-")
        env.update(TQKV_DISK_PATH=disk_dir, TQKV_DISK_CAPACITY="64M")
    try:
        _server_accepts(variant, W, env, args, trial, disk_dir)
    finally:
        if disk_dir:
            shutil.rmtree(disk_dir, ignore_errors=True)


def _server_accepts(variant, W, env, args, trial, disk_dir):
    r = run_server(env, args)
    note = ""
    if not r["started"] and env.get("TQKV_DEVICE") is not None and re.search(r"CUDA|device", r["err"], re.I):
        e2 = dict(env, TQKV_HBM_STANDIN="true")
        del e2["TQKV_DEVICE"]
        note = " (HBM stand-in: no GPU or no CUDA build here)"
        r = run_server(e2, args)
    if not expect(r["started"], W, f"server did not start: {r.get('why')}: {tail_lines(r['err'], 2)}"):
        return
    s = r["srv"]
    try:
        status, body = http_get(r["metrics_port"], "/metrics")
        expect(status == 200 and re.search(r'\ntqkv_tier_capacity_bytes\{tier="dram"\} 67108864\n', body), W,
               "serves /metrics with the DRAM tier capacity")
        if env.get("TQKV_HBM_CAPACITY"):
            expect(re.search(r'\ntqkv_tier_capacity_bytes\{tier="hbm"\} 33554432\n', body), W, "HBM tier configured")
        live, _ = http_get(r["metrics_port"], "/livez")
        ready, _ = http_get(r["metrics_port"], "/readyz")
        expect(live == 200 and ready == 200, W, f"probes /livez {live} /readyz {ready}")
        m = re.search(r'\ntqkv_credential_reloads_total\{file="tokens",result="ok"\} (\d+)\n', body)
        expect((m[1] if m else None) == ("1" if env.get("TQKV_AUTH_TOKENS") else "0"), W,
               "token file loaded (tqkv_credential_reloads_total)")
        if env.get("TQKV_TLS_CERT"):
            port = s.port
            pod_name = "tqkv-0.tqkv-headless.tqkv.svc"
            t = tls_verifies(port, trial["ca"], pod_name)
            expect(t["ok"] and t.get("alpn") == "h2", W,
                   f"TLS as a client would see it (pod DNS name, trial CA, h2): {json.dumps(t)}")
            wrong = tls_verifies(port, trial["cert"], pod_name)
            expect(not wrong["ok"], W, "a client trusting another CA is refused")
            peer_name = env.get("TQKV_PEER_TLS_NAME") or g(host_port(env.get("TQKV_PEERS")), "host")
            if peer_name:
                # A peer dials the headless Service's pods and checks this name.
                p = tls_verifies(port, env.get("TQKV_PEER_CA") or trial["ca"], peer_name)
                expect(p["ok"], W, f"TLS as a peer would see it ({peer_name}, TQKV_PEER_CA): {json.dumps(p)}")
            if env.get("TQKV_DATA_LISTEN"):
                # The data channel listener speaks TLS 1.3 with the same certificate.
                dport = data_channel_port(s)
                if expect(dport > 0, W, f'a "TCP data channels" log line with the port: {tail_lines(s.stderr_text(), 2)}'):
                    d = tls_verifies(dport, trial["ca"], pod_name, None)
                    expect(d["ok"] and d.get("version") == "TLSv1.3", W,
                           f"TLS 1.3 data channel as a client would see it (pod DNS name, trial CA): {json.dumps(d)}")
                    dw = tls_verifies(dport, trial["cert"], pod_name, None)
                    expect(not dw["ok"], W, "a data channel client trusting another CA is refused")
    finally:
        code = s.stop(timeout=60)
    expect(code == 0, W, f"exit status {code} after SIGTERM")
    if disk_dir:
        expect(re.search(r'\ntqkv_tier_capacity_bytes\{tier="disk"\} 67108864\n', body), W, "disk tier configured")
        expect(os.path.exists(os.path.join(disk_dir, "tqkv-disk.super")), W, "disk tier superblock written")
    print(f"overlays/{variant}: tqkv-server accepted the ConfigMap{note}")


VARIANTS = ("cpu", "gpu", "cert-manager", "insecure-dev", "disk")


def run_k8s():
    try:
        sh(kubectl, ["version", "--client"])
    except (OSError, subprocess.CalledProcessError):
        fail("tools", f"{kubectl} not found: install kubectl (deploy/install-deps.sh) to render the manifests")
        return
    env_vars = server_env_vars()
    expect(len(env_vars["vars"]) >= 10, "server", f"too few TQKV_* variables found in {env_vars['from']}")
    print(f"server variables: {len(env_vars['vars'])} from {env_vars['from']}")
    svcs, ns_name, replicas = [], "tqkv", 3
    trial = trial_secrets()
    envs = {}
    server = os.environ.get("TQKV_SERVER")
    try:
        for variant in VARIANTS:
            text = render(f"overlays/{variant}")
            if not text:
                continue
            objs = parse_docs(text)
            validate_schema(f"overlays/{variant}", objs)
            r = check_server(variant, objs, env_vars)
            if r and server and os.path.exists(server) and variant != "cert-manager":
                server_accepts(variant, r["env"], trial)
            if r and variant == "cpu":
                svcs, ns_name, replicas = r["svcs"], r["ns"], r["replicas"]
            if r:
                envs[variant] = r["env"]
            print(f"overlays/{variant}: {len(objs)} objects ({', '.join(js(o.get('kind')) for o in objs)})")
        # insecure-dev repeats the cpu configuration (behavior: replace) minus TLS and
        # tokens: nothing else may drift.
        if "cpu" in envs and "insecure-dev" in envs:
            want = dict(envs["cpu"])
            for k in ("TQKV_TLS_CERT", "TQKV_TLS_KEY", "TQKV_TLS_CLIENT_CA", "TQKV_AUTH_TOKENS",
                      "TQKV_PEER_CA", "TQKV_PEER_TOKEN_FILE", "TQKV_PEER_TLS_NAME"):
                want.pop(k, None)
            got = envs["insecure-dev"]
            for k in sorted(set(want) | set(got)):
                expect(want.get(k) == got.get(k), "overlays/insecure-dev",
                       f"{k}={js(got.get(k))} differs from the cpu overlay's {js(want.get(k))} "
                       "(only TLS and tokens may, for clients and peers)")
        # disk is the secure base (behavior: merge) plus the disk tier: nothing else may drift.
        if "cpu" in envs and "disk" in envs:
            cpu, got = envs["cpu"], envs["disk"]
            for k in sorted(set(cpu) | set(got)):
                if not k.startswith("TQKV_DISK_"):
                    expect(cpu.get(k) == got.get(k), "overlays/disk",
                           f"{k}={js(got.get(k))} differs from the cpu overlay's {js(cpu.get(k))} (only TQKV_DISK_* may)")
            for k in ("TQKV_DISK_PATH", "TQKV_DISK_CAPACITY"):
                expect(got.get(k), "overlays/disk", f"{k} set")
        bench = render("bench")
        if bench:
            objs = parse_docs(bench)
            validate_schema("bench", objs)
            check_bench(objs, replicas)
        mon = render("monitoring")
        if mon:
            objs = parse_docs(mon)
            validate_schema("monitoring", objs)
            check_monitoring(objs, svcs, ns_name)
        # The base alone must render too (overlays build on it).
        render("base")
    finally:
        if trial:
            shutil.rmtree(trial["dir"], ignore_errors=True)


def trial_secrets():
    """Runs deploy/k8s/trial-secrets.sh into a temporary directory and checks what it made:
    the certificate verifies against its CA and names the Services and the pods; the token
    file has an admin, a bench and a peer token. Returns the paths (the server test uses
    them)."""
    W = "deploy/k8s/trial-secrets.sh"
    d = tempfile.mkdtemp(prefix="tqkv-trial-")
    out = os.path.join(d, "s")
    try:
        sh("bash", [os.path.join(root, "deploy", "k8s", "trial-secrets.sh"), "--out", out])
    except (OSError, subprocess.CalledProcessError) as e:
        fail(W, f"failed: {tail_lines(err_text(e), 3)}")
        shutil.rmtree(d, ignore_errors=True)
        return None

    def f(n):
        return os.path.join(out, n)

    names = ("ca.crt", "tls.crt", "tls.key", "tokens", "bench-token", "admin-token", "peer-token")
    present = [expect(os.path.exists(f(n)), W, f"writes {n}") for n in names]
    if not all(present):
        shutil.rmtree(d, ignore_errors=True)
        return None
    expect((os.stat(f("tls.key")).st_mode & 0o077) == 0 and (os.stat(out).st_mode & 0o077) == 0, W,
           "key and directory readable by the owner only")
    try:
        sh("openssl", ["verify", "-CAfile", f("ca.crt"), f("tls.crt")])
        R.checks += 1
    except (OSError, subprocess.CalledProcessError) as e:
        fail(W, f"tls.crt does not verify against ca.crt: {err_text(e)}")
    try:
        san = sh("openssl", ["x509", "-in", f("tls.crt"), "-noout", "-ext", "subjectAltName"])
    except (OSError, subprocess.CalledProcessError):
        san = ""
    for n in ("DNS:tqkv.tqkv.svc", "DNS:*.tqkv-headless.tqkv.svc", "DNS:*.tqkv-headless", "DNS:tqkv,",
              "DNS:tqkv-headless,"):
        expect(n in san, W, f"certificate names {n.rstrip(',')}")
    try:
        eku = sh("openssl", ["x509", "-in", f("tls.crt"), "-noout", "-ext", "extendedKeyUsage"])
    except (OSError, subprocess.CalledProcessError):
        eku = ""
    expect("Server Authentication" in eku and "Client Authentication" in eku, W,
           f"certificate for server and client use (peers present it to each other): {eku.strip()}")
    lines = [ln for ln in read(f("tokens")).split("\n") if ln and not ln.startswith("#")]
    bench = read(f("bench-token")).strip()
    peer = read(f("peer-token")).strip()
    expect(len(lines) == 3 and f"{bench} rw bench" in lines and f"{peer} rw *" in lines, W,
           "tokens: an admin token, the bench token (rw on bench) and the peer token (rw on *)")
    expect(re.fullmatch(r"[0-9a-f]{64}", peer) and peer != bench, W, "the peer token is its own 256-bit random hex")
    expect(re.fullmatch(r"[0-9a-f]{64}", bench), W, "tokens are 256-bit random hex")
    print(f"trial-secrets.sh: certificate, key and tokens made in {out}")
    return {"dir": d, "cert": f("tls.crt"), "key": f("tls.key"), "ca": f("ca.crt"), "tokens": f("tokens"),
            "bench": bench, "peer_token": f("peer-token")}


# ---------------------------------------------------------------- negative


def run_negative():
    """The checks must fail where they should: each case breaks a copy of the rendered
    manifests (or of a source file, then renders the copy) and expects a failure whose
    text contains the given fragment. A case the validator lets through is a FAIL."""
    env_vars = server_env_vars()
    rendered = {}
    for d in ("overlays/cpu", "overlays/cert-manager", "overlays/insecure-dev", "bench", "monitoring"):
        text = render(d)
        if not text:
            return
        rendered[d] = parse_docs(text)

    def find(objs, kind, name=None):
        return next(o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name))

    def container(o):
        return o["spec"]["template"]["spec"]["containers"][0]

    def cm(objs):
        return find(objs, "ConfigMap")["data"]

    def np_rule0(objs):
        return find(objs, "NetworkPolicy")["spec"]["ingress"][0]

    # (name, rendered dir, mutation, checker, fragment expected in a failure)
    S, I = "schema", "invariants"
    cases = [
        ("misspelt StatefulSet spec field", "overlays/cpu",
         lambda o: find(o, "StatefulSet")["spec"].update(replica=3), S, "unknown fields /spec/replica"),
        ("misspelt container securityContext field", "overlays/cpu",
         lambda o: container(find(o, "StatefulSet"))["securityContext"].update(runAsNonRot=True), S,
         "unknown fields /spec/template/spec/containers/0/securityContext/runAsNonRot"),
        ("misspelt metadata field", "overlays/cpu",
         lambda o: find(o, "Service", "tqkv")["metadata"].update(label={"a": "b"}), S, "unknown fields /metadata/label"),
        ("misspelt NetworkPolicy rule field", "overlays/cpu",
         lambda o: np_rule0(o).update(form=[]), S, "unknown fields /spec/ingress/0/form"),
        ("misspelt ConfigMap top-level field", "overlays/cpu",
         lambda o: find(o, "ConfigMap").update(datas={}), S, "unknown fields /datas"),
        ("replicas as a string", "overlays/cpu",
         lambda o: find(o, "StatefulSet")["spec"].update(replicas="3"), S, "/spec/replicas: '3' is not of type"),
        ("misspelt Certificate field", "overlays/cert-manager",
         lambda o: find(o, "Certificate", "tqkv-tls")["spec"]["privateKey"].update(rotationPolicie="Always"), S,
         "unknown fields /spec/privateKey/rotationPolicie"),
        ("Certificate usage not in the CRD's enum", "overlays/cert-manager",
         lambda o: find(o, "Certificate", "tqkv-tls")["spec"]["usages"].append("server-auth"), S,
         "'server-auth' is not one of"),
        ("misspelt Issuer field", "overlays/cert-manager",
         lambda o: find(o, "Issuer", "tqkv-ca")["spec"].update(cA={}), S, "unknown fields /spec/cA"),
        ("misspelt ServiceMonitor endpoint field", "monitoring",
         lambda o: find(o, "ServiceMonitor")["spec"]["endpoints"][0].update(honourLabels=True), S,
         "unknown fields /spec/endpoints/0/honourLabels"),
        ("misspelt PrometheusRule rule field", "monitoring",
         lambda o: find(o, "PrometheusRule")["spec"]["groups"][0]["rules"][0].update(fro="5m"), S,
         "unknown fields /spec/groups/0/rules/0/fro"),
        ("misspelt Job field", "bench",
         lambda o: find(o, "Job")["spec"].update(activeDeadline=5), S, "unknown fields /spec/activeDeadline"),
        ("two replicas", "overlays/cpu",
         lambda o: find(o, "StatefulSet")["spec"].update(replicas=2), I, "replicas 3, got 2"),
        ("root user", "overlays/cpu",
         lambda o: container(find(o, "StatefulSet"))["securityContext"].update(runAsUser=0), I,
         "runAsUser must be 65532 (image user), got 0"),
        ("memory limit under the DRAM tier", "overlays/cpu",
         lambda o: container(find(o, "StatefulSet"))["resources"]["limits"].update(memory="1Gi"), I,
         "must exceed TQKV_DRAM_CAPACITY"),
        ("a quantity that is not one", "overlays/cpu",
         lambda o: container(find(o, "StatefulSet"))["resources"]["requests"].update(cpu="lots"), I,
         "resources.requests.cpu=lots is not a Kubernetes quantity"),
        ("a variable the server does not know", "overlays/cpu",
         lambda o: cm(o).update(TQKV_NO_SUCH_VARIABLE="1"), I, "TQKV_NO_SUCH_VARIABLE is not a variable tqkv-server understands"),
        ("TLS key on a subPath mount", "overlays/cpu",
         lambda o: [m.update(subPath="tls.key") for m in container(find(o, "StatefulSet"))["volumeMounts"]
                    if m["mountPath"].startswith("/etc/tqkv/tls")], I, "not a subPath mount"),
        ("a NetworkPolicy rule without sources", "overlays/cpu",
         lambda o: np_rule0(o).pop("from"), I, "names its sources"),
        ("no TLS on a secure overlay", "overlays/cpu",
         lambda o: cm(o).pop("TQKV_TLS_CERT"), I, "TQKV_TLS_CERT set (secure by default)"),
        ("insecure-dev without its annotation", "overlays/insecure-dev",
         lambda o: find(o, "StatefulSet")["metadata"]["annotations"].pop("tqkv.io/insecure"), I,
         "the StatefulSet says what is off"),
        ("Certificate without client auth", "overlays/cert-manager",
         lambda o: find(o, "Certificate", "tqkv-tls")["spec"]["usages"].remove("client auth"), I,
         "usages include client auth"),
        ("bench token written in the manifest", "bench",
         lambda o: container(find(o, "Job"))["env"].append({"name": "BENCH_TOKEN_LITERAL", "value": "abc"}), I,
         "no literal token in the manifest"),
        ("honorLabels on the ServiceMonitor", "monitoring",
         lambda o: find(o, "ServiceMonitor")["spec"]["endpoints"][0].update(honorLabels=True), I, "no honorLabels"),
    ]
    global R

    def failures_of(d, checker, objs):
        global R
        outer, R = R, Report(quiet=True)
        try:
            if checker == S:
                validate_schema(d, objs)
            elif d == "bench":
                check_bench(objs, 3)
            elif d == "monitoring":
                check_monitoring(objs, [find(rendered["overlays/cpu"], "Service", "tqkv"),
                                        find(rendered["overlays/cpu"], "Service", "tqkv-headless")], "tqkv")
            else:
                check_server(d.split("/")[1], objs, env_vars)
        finally:
            got, R = R.failures, outer
        return got

    caught = 0
    baseline = {}
    for name, d, mutate, checker, fragment in cases:
        # The control: the unbroken manifests do not get this failure.
        if (d, checker) not in baseline:
            baseline[(d, checker)] = failures_of(d, checker, copy.deepcopy(rendered[d]))
        expect(not [f for f in baseline[(d, checker)] if fragment in f], f"negative {name}",
               f"the unbroken {d} already fails with {fragment!r}")
        objs = copy.deepcopy(rendered[d])
        try:
            mutate(objs)
        except (KeyError, StopIteration, IndexError, ValueError) as e:
            fail(f"negative {name}", f"could not inject the fault ({d} changed? {e!r})")
            continue
        got = failures_of(d, checker, objs)
        hit = [f for f in got if fragment in f]
        if expect(hit, f"negative {name}", f"no failure containing {fragment!r} (got {got[:3]})"):
            caught += 1
            print(f"negative {name}: FAIL as expected: {hit[0]}")
    # The same end to end: a misspelt field in a copy of a source file survives kustomize
    # and is reported.
    import yaml

    tmp = tempfile.mkdtemp(prefix="tqkv-k8s-neg-")
    try:
        k8s = os.path.join(tmp, "k8s")
        shutil.copytree(os.path.join(root, "deploy", "k8s"), k8s)
        src = os.path.join(k8s, "base", "statefulset.yaml")
        with open(src) as fh:
            doc = yaml.safe_load(fh)
        doc["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 60
        with open(src, "w") as fh:
            yaml.safe_dump(doc, fh)
        text = render("overlays/cpu", base=k8s)
        if text:
            outer, R = R, Report(quiet=True)
            try:
                validate_schema("copy of overlays/cpu", parse_docs(text))
            finally:
                got, R = R.failures, outer
            fragment = "unknown fields /spec/template/spec/terminationGracePeriodSecond"
            if expect(any(fragment in f for f in got), "negative source copy",
                      f"base/statefulset.yaml with a misspelt field rendered and validated without {fragment!r} (got {got[:3]})"):
                caught += 1
                print(f"negative source copy: FAIL as expected: {[f for f in got if fragment in f][0]}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"negative: {caught} of {len(cases) + 1} broken manifests reported")


# ---------------------------------------------------------------- Dockerfile


def docker_ignored(patterns, rel):
    res = False
    for pat in patterns:
        neg = pat.startswith("!")
        p = re.sub(r"^/", "", re.sub(r"/$", "", pat[1:] if neg else pat))
        rx = re.sub(r"[.+^${}()|\[\]\\]", lambda m: "\\" + m[0], p)
        rx = rx.replace("**", "\0").replace("*", "[^/]*").replace("\0", ".*")
        if re.fullmatch(rx + "(/.*)?", rel):
            res = not neg
    return res


def run_dockerfile():
    W = "deploy/Dockerfile"
    path = os.path.join(root, "deploy", "Dockerfile")
    if not expect(os.path.exists(path), W, "exists"):
        return
    text = read(path).replace("\\\n", " ")
    lines = [ln.strip() for ln in text.split("\n")]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    stages = [ln for ln in lines if re.match(r"FROM\s", ln, re.I)]
    expect(len(stages) >= 2, W, "multi-stage (build and runtime)")
    args = {}
    for ln in lines:
        if re.match(r"ARG\s", ln, re.I):
            parts = re.sub(r"^ARG\s+", "", ln, flags=re.I).split("=")
            args[parts[0].strip()] = re.sub(r'^"|"$', "", parts[1].strip()) if len(parts) > 1 else None
    bb = args.get("BUILD_BASE") or ""
    expect(bb == "debian:12" or "debian:12" in bb, W, "BUILD_BASE defaults to debian:12")
    expect("debian:12" in (args.get("RUNTIME_BASE") or ""), W, "RUNTIME_BASE defaults to a debian:12 image")
    expect("TQKV_CUDA" in args, W, "ARG TQKV_CUDA selects the CUDA build")
    expect(re.match(r"FROM\s+\$\{?BUILD_BASE\}?\s+AS\s+build", stages[0] if stages else "", re.I), W,
           "first stage FROM ${BUILD_BASE} AS build")
    expect(re.match(r"FROM\s+\$\{?RUNTIME_BASE\}?", stages[-1] if stages else "", re.I), W, "last stage FROM ${RUNTIME_BASE}")
    # Every COPY source (outside --from) exists in the build context and is not ignored.
    di = os.path.join(root, ".dockerignore")
    ignore = [ln.strip() for ln in read(di).split("\n")] if os.path.exists(di) else []
    ignore = [ln for ln in ignore if ln and not ln.startswith("#")]
    expect(len(ignore) > 0, ".dockerignore", "exists and is not empty")
    for ln in lines:
        if not re.match(r"COPY\s", ln, re.I) or re.search(r"--from=", ln, re.I):
            continue
        parts = [p for p in re.split(r"\s+", re.sub(r"^COPY\s+", "", ln, flags=re.I)) if p and not p.startswith("--")]
        for s in parts[:-1]:
            rel = re.sub(r"/$", "", re.sub(r"^\./", "", s))
            if rel in (".", ""):
                continue
            expect(os.path.exists(os.path.join(root, rel)), W, f"COPY source {s} does not exist")
            expect(not docker_ignored(ignore, rel), W, f"COPY source {s} is excluded by .dockerignore")
    for must in ("CMakeLists.txt", "kernels", "cache", "proto", "transport", "service", "deploy/install-deps.sh"):
        expect(not docker_ignored(ignore, must), ".dockerignore", f"must not exclude {must}")
    for junk in ("build", "build-asan", ".git", "tests/k8s/__pycache__"):
        expect(docker_ignored(ignore, junk), ".dockerignore", f"should exclude {junk}")
    # Runtime stage: only runtime libraries, non-root user, the entrypoint.
    m = re.search(r"^FROM\s+\$\{?RUNTIME_BASE", text, re.I | re.M)
    rt = text[m.start():] if m else text[-1:]
    for lib in ("libgrpc29", "libprotobuf-c1", "libjemalloc2", "libmicrohttpd12", "libzstd1", "liburing2", "ca-certificates"):
        expect(re.search(rf"\b{re.escape(lib)}\b", rt), W, f"runtime stage installs {lib}")
    expect(not re.search(r"-dev\b", rt.replace("--no-install-recommends", "")), W, "runtime stage installs no -dev package")
    expect(re.search(r"^USER\s+65532(:65532)?\s*$", rt, re.M), W, "runtime USER 65532")
    ep = re.search(r"^ENTRYPOINT\s+(\[.*\])\s*$", rt, re.M)
    if expect(ep, W, "exec-form ENTRYPOINT"):
        argv = []
        try:
            argv = json.loads(ep[1])
        except ValueError:
            fail(W, "ENTRYPOINT is not a JSON array")
        expect(argv[:1] == ["/usr/local/bin/tqkv-server"], W,
               "ENTRYPOINT runs /usr/local/bin/tqkv-server (the path the StatefulSet uses)")

        def f(k):
            i = argv.index(k) if k in argv else -1
            return argv[i + 1] if i + 1 < len(argv) else None

        expect(f("--listen") == "0.0.0.0:50051", W, "--listen 0.0.0.0:50051")
        expect(f("--metrics-listen") == "0.0.0.0:9090", W, "--metrics-listen 0.0.0.0:9090")
    expect(re.search(r"^EXPOSE\s+.*\b50051\b", rt, re.M) and re.search(r"^EXPOSE\s+.*\b9090\b", rt, re.M), W,
           "EXPOSE 50051 and 9090")
    expect("tqkv-bench" in rt, W, "ships tqkv-bench (the bench Job runs it from this image)")
    expect(re.search(r"-DTQKV_CUDA=\$\{?TQKV_CUDA\}?", text), W, "passes TQKV_CUDA to cmake")
    # Runtime packages exist in Debian 12 (when apt-cache is there to ask).
    if shutil.which("apt-cache"):
        names = []
        for m in re.finditer(r"apt-get install[^&;]*", rt):
            for w in re.split(r"\s+", m[0])[2:]:
                if re.fullmatch(r"[a-z0-9][a-z0-9.+-]+", w) and w not in names:
                    names.append(w)
        p = subprocess.run(["apt-cache", "show", "--no-all-versions", *names], capture_output=True, text=True)
        for n in names:
            expect(re.search(rf"^Package: {re.escape(n)}$", p.stdout, re.M), W, f"runtime package {n} is not known to apt-cache")


# ---------------------------------------------------------------- Grafana


def run_grafana():
    W = "deploy/grafana/tqkv-dashboard.json"
    path = os.path.join(root, "deploy", "grafana", "tqkv-dashboard.json")
    if not expect(os.path.exists(path), W, "exists"):
        return
    try:
        d = json.loads(read(path))
    except ValueError as e:
        fail(W, f"not JSON: {e}")
        return
    known = known_metrics()
    expect(isinstance(d.get("title"), str) and len(d["title"]) > 0, W, "title")
    expect(isinstance(d.get("uid"), str) and 0 < len(d["uid"]) <= 40, W, "uid (<= 40 chars)")
    expect(is_int(d.get("schemaVersion")), W, "schemaVersion")
    variables = [v.get("name") for v in g(d, "templating", "list") or []]
    expect("datasource" in variables, W, "a datasource variable")
    panels = []

    def walk(ps):
        for p in ps or []:
            panels.append(p)
            walk(p.get("panels"))

    walk(d.get("panels"))
    expect(len(panels) >= 8, W, f"at least 8 panels, got {len(panels)}")
    ids = set()
    exprs = []
    for p in panels:
        pw = f'{W} panel "{js(p.get("title"))}"'
        pid = p.get("id")
        expect(is_int(pid) and pid not in ids, pw, "unique integer id")
        ids.add(pid)
        gp = p.get("gridPos")
        expect(isinstance(gp, dict) and all(is_int(gp.get(k)) for k in "xywh") and gp["x"] + gp["w"] <= 24, pw,
               "gridPos within 24 columns")
        if p.get("type") == "row":
            continue
        expect(len(p.get("targets") or []) > 0, pw, "has queries")
        for t in p.get("targets") or []:
            expect(isinstance(t.get("expr"), str) and len(t["expr"]) > 0, pw, "target has a PromQL expr")
            expect(g(t, "datasource", "uid") == "${datasource}", pw, "target uses the datasource variable")
            exprs.append(js(t.get("expr")))
            check_promql(pw, js(t.get("expr")), known)
    everything = "\n".join(exprs)
    for what, rx in (
        ("hit rate by tier", r"tqkv_tier_hits_total"),
        ("hit rate by tenant", r"sum by \(tenant\) \(rate\(tqkv_tenant_hits_total"),
        ("GB/s", r"tqkv_bytes_sent_total"),
        ("BF16-equivalent GB/s", r"tqkv_bf16_equivalent_bytes_delivered_total"),
        ("latency p50", r"histogram_quantile\(0\.5,"),
        ("latency p99", r"histogram_quantile\(0\.99,"),
        ("evictions", r"tqkv_tier_evictions_total"),
        ("demotions", r"tqkv_tier_demotions_total"),
        ("tier usage", r"tqkv_tier_bytes"),
        ("compression ratio of summed bytes held", r"sum\(tqkv_store_bf16_bytes\{[^}]*\}\) / clamp_min\(sum\(tqkv_store_page_bytes"),
        ("compression ratio of summed bytes delivered",
         r"sum\(rate\(tqkv_bf16_equivalent_bytes_delivered_total\{[^}]*\}\[[^\]]*\]\)\) / clamp_min\(sum\(rate\(tqkv_bytes_sent_total"),
        ("process CPU", r"process_cpu_seconds_total"),
        ("process memory", r"process_resident_memory_bytes"),
        ("credential reloads", r"tqkv_credential_reloads_total"),
        ("errors by code", r'tqkv_requests_total\{[^}]*code!="OK"'),
    ):
        expect(re.search(rx, everything), W, f"a panel for {what}")
    # Ratios are ratios of sums: no avg() over pods of a per-pod ratio.
    for e in exprs:
        expect(not re.search(r"\bavg\s*(by\s*\([^)]*\)\s*)?\(", e), W, f"no average of per-pod values: {e}")
    n = promtool_parse(W, exprs)
    print(f"grafana: {n} panel queries parsed by promtool")


# ---------------------------------------------------------------- main


def main():
    what = sys.argv[1] if len(sys.argv) > 1 else "k8s"
    modes = {"k8s": run_k8s, "negative": run_negative, "dockerfile": run_dockerfile, "grafana": run_grafana,
             "schemas": run_schemas}
    if what not in modes or len(sys.argv) > 2:
        print("usage: validate.py k8s|negative|dockerfile|grafana|schemas")
        return 2
    t0 = time.monotonic()
    modes[what]()
    print(f"{what}: {R.checks} checks, {len(R.failures)} failures ({round((time.monotonic() - t0) * 1000)} ms)")
    return 1 if R.failures else 0


if __name__ == "__main__":
    sys.exit(main())
