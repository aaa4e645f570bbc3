"""The alerting rules shipped beside the chart: each names a metric a real node exports, and the
revocation list warns a week ahead of its nextUpdate."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from cluster.node.metrics import ClusterMetrics

RULES = Path(__file__).resolve().parents[2] / "charts" / "kvfabric" / "files" / "kvfabric-alerts.yaml"


def test_every_alert_names_a_metric_a_node_exports_and_the_list_warns_a_week_ahead() -> None:
    registry = CollectorRegistry()
    ClusterMetrics(registry)
    exported = {m.name for m in registry.collect()}
    rules = [r for group in yaml.safe_load(RULES.read_text())["groups"] for r in group["rules"]]
    assert rules
    for rule in rules:
        names = set(re.findall(r"kvfabric_[a-z_]+", rule["expr"]))
        assert names and names <= exported, (rule["alert"], names - exported)
    horizons = {r["labels"]["severity"]: r["expr"].rsplit("<", 1)[1].strip() for r in rules
                if "kvfabric_crl_seconds_to_next_update" in r["expr"]}
    assert _seconds(horizons["warning"]) >= 7 * 86400 and _seconds(horizons["critical"]) >= 86400


def _seconds(product: str) -> float:
    """A threshold written as a product of numbers ("7 * 86400")."""
    out = 1.0
    for factor in product.split("*"):
        out *= float(factor)
    return out
