"""Render and validate charts/kvfabric offline: the real `helm` binary (`make install` puts it in the
venv), built-in kinds checked by kubernetes-validate in strict mode, custom resources by the CRD
schemas in schemas/ (strict about unknown fields). Nothing here talks to a Kubernetes API server."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvfabric"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
KUBERNETES_VERSION = "1.33.0"
MONITOR_APIS = ("monitoring.coreos.com/v1/ServiceMonitor", "monitoring.coreos.com/v1/PodMonitor")

# (apiVersion, kind) -> schema file, for every custom resource the chart may render.
CRD_SCHEMAS = {
    ("ray.io/v1", "RayCluster"): "ray.io/raycluster_v1.json",
    ("ray.io/v1", "RayJob"): "ray.io/rayjob_v1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com/servicemonitor_v1.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com/podmonitor_v1.json",
    ("cert-manager.io/v1", "Certificate"): "cert-manager.io/certificate_v1.json",
    ("cert-manager.io/v1", "Issuer"): "cert-manager.io/issuer_v1.json",
}

# Every optional feature on: cert-manager, both monitors, GCS fault tolerance, autoscaling, two
# worker groups, a PVC per pod for the SSD tier, config keys in every section.
ALL_FEATURES: dict[str, Any] = {
    "image": {"repository": "registry.example.com/ml/kvfabric", "tag": "0.1.0-cu128"},
    "imagePullSecrets": [{"name": "regcred"}],
    "autoscaling": {"enabled": True},
    "gcsFaultTolerance": {"enabled": True, "redisAddress": "redis.infra.svc:6379",
                          "redisPasswordSecret": {"name": "redis-auth", "key": "password"},
                          "externalStorageNamespace": "kvfabric-prod"},
    "ssd": {"type": "ephemeralVolume", "ephemeralVolume": {"storageClassName": "local-nvme", "size": "900Gi"}},
    "tls": {"existingSecret": "", "certManager": {"enabled": True}},
    "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
                "podMonitor": {"enabled": True}},
    "workerGroups": [
        {"name": "h100", "gpus": 8, "replicas": 2, "minReplicas": 1, "maxReplicas": 4,
         "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}},
        {"name": "l4", "gpus": 1, "replicas": 0, "minReplicas": 0, "maxReplicas": 8,
         "resources": {"requests": {"cpu": "4", "memory": "32Gi"}, "limits": {"cpu": "4", "memory": "32Gi"}},
         "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
             {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["l4"]}]}]}}}},
    ],
    "config": {"kv": {"ram_gib": 64, "ssd_gib": 800.5, "block_size": 32, "o_direct": False},
               "transport": {"kind": "quic", "max_payload_bytes": 67108864, "connect_timeout_s": 2.5},
               "cluster": {"directory_shards": 4, "heartbeat_s": 1, "lease_s": 6},
               "tenancy": {"required": True, "shared": [["team-a", "team-b"]]}},
}


@cache
def helm() -> str:
    """The helm binary: the venv's (make install) or one on PATH. Missing helm fails, never skips."""
    venv_helm = Path(sys.executable).parent / "helm"
    found = str(venv_helm) if venv_helm.is_file() else shutil.which("helm")
    if found is None:
        pytest.fail(f"helm not found in {venv_helm.parent} or on PATH: run `make install`")
    return found


@dataclass(frozen=True, slots=True)
class HelmResult:
    returncode: int
    stdout: str
    stderr: str

    @property
    def objects(self) -> list[dict[str, Any]]:
        assert self.returncode == 0, self.stderr
        return [doc for doc in yaml.safe_load_all(self.stdout) if doc]


def run_helm(*args: str, values: dict[str, Any] | None = None, tmp: Path | None = None) -> HelmResult:
    cmd = [helm(), *args]
    if values is not None:
        assert tmp is not None, "values need a folder for the values file"
        path = tmp / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        cmd += ["-f", str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    return HelmResult(out.returncode, out.stdout, out.stderr)


def template(tmp: Path, values: dict[str, Any] | None = None, *, release: str = "kvf",
             api_versions: tuple[str, ...] = (), extra: tuple[str, ...] = ()) -> HelmResult:
    args = ["template", release, str(CHART), "--namespace", "ml", "--kube-version", KUBERNETES_VERSION, *extra]
    for api in api_versions:
        args += ["--api-versions", api]
    return run_helm(*args, values=values if values is not None else {}, tmp=tmp)


def render(tmp: Path, values: dict[str, Any] | None = None, **kw: Any) -> list[dict[str, Any]]:
    return template(tmp, values, **kw).objects


@cache
def crd_validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    schema = json.loads((SCHEMAS / CRD_SCHEMAS[(api_version, kind)]).read_text())
    return jsonschema.Draft7Validator(schema)


def validate(obj: dict[str, Any]) -> None:
    """Raise if `obj` is not a valid object of its kind. A kind with no schema is an error."""
    key = (obj["apiVersion"], obj["kind"])
    if key in CRD_SCHEMAS:
        errors = sorted(crd_validator(*key).iter_errors(obj), key=lambda e: list(e.absolute_path))
        if errors:
            raise AssertionError(f"{obj['kind']} {obj['metadata']['name']}: " + "; ".join(
                f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:5]))
        return
    # Raises SchemaNotFoundError for a kind it does not know: no silent pass for unknown kinds.
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str, name_suffix: str = "") -> dict[str, Any]:
    found = [o for o in by_kind(objects, kind) if o["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} named *{name_suffix}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def fabric_toml(objects: list[dict[str, Any]]) -> dict[str, Any]:
    cm = one(objects, "ConfigMap", "-config")
    return tomllib.loads(cm["data"]["kvfabric.toml"])


def pod_specs(raycluster: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod templates of the head group and every worker group."""
    spec = raycluster["spec"]
    return [spec["headGroupSpec"]["template"], *(g["template"] for g in spec["workerGroupSpecs"])]
