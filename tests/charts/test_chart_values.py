"""What a user gets for the values they write: bad values are refused before anything is applied, the
rendered TOML is a config that fabric/config.py loads, and the dashboard asks for metrics that exist."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
from chart_support import ALL_FEATURES, CHART, ROOT, fabric_toml, one, render, template

from fabric.config import Config

SCHEMA = json.loads((CHART / "values.schema.json").read_text())

# Metrics the cluster layer (cluster/node/actor.py) exports; the rest are read from the source below.
CLUSTER_METRICS = {"kvfabric_pulls_total", "kvfabric_lookups_total", "kvfabric_lookup_seconds",
                   "kvfabric_hit_blocks_total", "kvfabric_requested_blocks_total",
                   "kvfabric_directory_said_yes_owner_said_no_total"}


@pytest.mark.parametrize(("values", "complaint"), [
    ({"replicaCount": 3}, "replicaCount"),
    ({"config": {"kv": {"ram_gb": 4}}}, "ram_gb"),                          # typo of ram_gib
    ({"config": {"transport": {"cert_dir": "/x"}}}, "cert_dir"),            # set by the chart
    ({"config": {"transport": {"kind": "udp"}}}, "/config/transport/kind"),
    ({"config": {"kv": {"block_size": "16"}}}, "block_size"),
    ({"config": {"kv": {"ssd_low_water": 1.5}}}, "ssd_low_water"),
    ({"config": {"gpu": {}}}, "gpu"),                                       # no such section
    ({"config": {"tenancy": {"shared": [["team-a"]]}}}, "/config/tenancy/shared"),   # a group of one
    ({"config": {"tenancy": {"credential": "/x"}}}, "credential"),          # a client's, not a node's
    ({"workerDefaults": {"gpus": -1}}, "gpus"),
    ({"workerGroups": []}, "workerGroups"),
    ({"workerGroups": [{"name": "GPU_pool"}]}, "GPU_pool"),
    ({"workerGroups": [{"gpus": 1}]}, "name"),
    ({"ssd": {"type": "nfs"}}, "/ssd/type"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"ports": {"tcp": 70000}}, "tcp"),
    ({"metrics": {"serviceMonitor": {"interval": "soon"}}}, "interval"),
    ({"head": {"resources": {"limits": {"memory": "lots"}}}}, "memory"),
])
def test_schema_rejects_bad_values(values: dict[str, Any], complaint: str, tmp_path: Path) -> None:
    result = template(tmp_path, values)
    assert result.returncode != 0, f"{values} rendered"
    assert "schema" in result.stderr.lower() and complaint in result.stderr, result.stderr


@pytest.mark.parametrize(("values", "release", "complaint"), [
    ({"workerGroups": [{"name": "gpu", "minReplicas": 3, "maxReplicas": 2, "replicas": 2}]}, "kvf",
     "minReplicas (3) > maxReplicas (2)"),
    ({"workerGroups": [{"name": "gpu", "minReplicas": 1, "maxReplicas": 2, "replicas": 5}]}, "kvf",
     "replicas (5) must lie in"),
    ({"tls": {"existingSecret": ""}}, "kvf", "need the cluster CA"),
    ({}, "a-release-name-that-is-far-too-long-for-kuberay", "KubeRay needs at most 47"),
    ({}, "9lives", "DNS-1035"),
    ({"workerGroups": [{"name": "gpu"}, {"name": "gpu"}]}, "kvf", "used twice"),
    ({"workerDefaults": {"resources": {"limits": {"nvidia.com/gpu": 2}}}}, "kvf", "set GPUs with `gpus`"),
    ({"gcsFaultTolerance": {"enabled": True}}, "kvf", "redisAddress"),
    ({"metrics": {"port": 7470}}, "kvf", "collides"),
])
def test_render_guards(values: dict[str, Any], release: str, complaint: str, tmp_path: Path) -> None:
    result = template(tmp_path, values, release=release)
    assert result.returncode != 0, f"{values} / {release} rendered"
    assert complaint in result.stderr, result.stderr


def test_longest_allowed_release_name_renders(tmp_path: Path) -> None:
    release = "r" * 38  # + "-kvfabric" = 47 characters, KubeRay's RayJob limit
    cluster = one(render(tmp_path, {}, release=release), "RayCluster")
    assert len(cluster["metadata"]["name"]) == 47


@pytest.mark.parametrize("case", ["default", "all-features"])
def test_rendered_toml_is_a_valid_config(case: str, tmp_path: Path) -> None:
    values = ALL_FEATURES if case == "all-features" else {}
    data = fabric_toml(render(tmp_path, values))
    cfg = Config.from_dict(data, source="rendered kvfabric.toml")  # unknown keys or bad types raise
    assert cfg.cluster.metrics_port == 9108
    assert (cfg.transport.tcp_port, cfg.transport.quic_port) == (7470, 7471)
    if values:
        assert cfg.kv.ram_gib == 64 and cfg.kv.ssd_gib == 800.5 and cfg.kv.o_direct is False
        assert cfg.transport.kind == "quic" and cfg.transport.max_payload_bytes == 67108864
        assert cfg.cluster.directory_shards == 4 and cfg.cluster.lease_s == 6.0
        assert cfg.tenancy.required and cfg.tenancy.shared == [["team-a", "team-b"]]


def _sample(prop: dict[str, Any]) -> Any:
    if "enum" in prop:
        return prop["enum"][-1]
    if "examples" in prop:   # a string with a format of its own (an endpoint, a resource name)
        return prop["examples"][0]
    kind = prop["type"]
    if kind == "boolean":
        return False
    if kind == "integer":
        if "maximum" in prop:   # ports and datagram sizes take 1200; small ranges their top
            return min(prop["maximum"], max(prop.get("minimum", 1), 1200))
        return max(prop.get("minimum", 1), 7)
    if kind == "number":
        return 0.75 if prop.get("maximum") == 1 else 1.5
    return "sample"


def test_every_config_key_the_schema_allows_is_a_real_config_key(tmp_path: Path) -> None:
    sections = SCHEMA["properties"]["config"]["properties"]
    values = {name: {key: _sample(prop) for key, prop in section["properties"].items()}
              for name, section in sections.items()}
    values["cluster"]["lease_s"] = 30.0  # must exceed heartbeat_s
    data = fabric_toml(render(tmp_path, {"config": values}))
    cfg = Config.from_dict(data, source="rendered kvfabric.toml")
    for name, section in values.items():
        for key, value in section.items():
            assert getattr(getattr(cfg, name), key) == value, f"{name}.{key}"
    fields = {f.name for f in dataclasses.fields(Config)}
    assert set(sections) == fields


def test_dashboard_queries_metrics_the_fabric_exports() -> None:
    dashboard = json.loads((CHART / "files" / "kvfabric-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|sum|count)$", "", m) for e in exprs for m in re.findall(r"\bkvfabric_\w+", e)}
    defined = set(CLUSTER_METRICS)
    for source in [*(ROOT / "fabric").rglob("*.py"), *(ROOT / "transports").rglob("*.py"),
                   *(ROOT / "cluster").rglob("*.py")]:
        defined |= set(re.findall(r"[\"'](kvfabric_\w+)[\"']", source.read_text()))
    assert used <= defined, f"dashboard queries metrics nobody exports: {sorted(used - defined)}"
    for needed in ("kvfabric_hit_blocks_total", "kvfabric_bytes", "kvfabric_pulls_total", "kvfabric_lookup_seconds",
                   "kvfabric_evictions_total", "kvfabric_corrupt_blocks_total", "kvfabric_auth_failures_total"):
        assert needed in used, f"the dashboard has no panel for {needed}"


def test_dashboard_configmap_carries_the_file(tmp_path: Path) -> None:
    cm = one(render(tmp_path, {}), "ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["kvfabric.json"])["uid"] == "kvfabric"


# Values that are maps handed to Kubernetes (or to the TOML) as a whole: listed as one row each.
MAP_VALUES = {"resources", "podSecurityContext", "rayStartParams", "nodeSelector", "affinity", "podLabels",
              "podAnnotations", "labels", "commonLabels", "kv", "transport", "cluster"}


def _leaves(values: dict[str, Any], prefix: str = "") -> list[str]:
    out: list[str] = []
    for key, value in values.items():
        if isinstance(value, dict) and value and key not in MAP_VALUES:
            out += _leaves(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}")
    return out


def test_chart_readme_lists_every_value() -> None:
    import yaml

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text()
    missing = [path for path in _leaves(values) if f"| `{path}` |" not in readme]
    assert not missing, f"values missing from charts/kvfabric/README.md: {missing}"
