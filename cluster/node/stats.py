"""A node's `stats()` answer: what its metrics registry counted, beside its store, directory upkeep,
estimates and engine load, as one JSON-ready dict (what `kvfabric stats` prints per node).

The counters are read back from the node's own prometheus registry, so `stats()` and `/metrics`
never disagree.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from prometheus_client import CollectorRegistry

from cluster.directory.client import DirectoryClient
from cluster.directory.upkeep import DirectoryUpkeep
from cluster.node.reads import NodeLoader
from cluster.node.runtime import NodeRuntime
from fabric.provenance import Rejection
from transports.core.codec import MissReason


def counter_stats(registry: CollectorRegistry, transport: str) -> dict[str, Any]:
    """Hits, pulls and rejections as counted so far by the metrics in `registry`."""
    def count(metric: str, **labels: str) -> float:
        value = registry.get_sample_value(metric, labels or None)
        return float(value or 0.0)
    requested = count("kvfabric_requested_blocks_total")
    local, peer = count("kvfabric_hit_blocks_total", source="local"), count("kvfabric_hit_blocks_total",
                                                                             source="peer")
    return {"requested_blocks": requested, "hit_blocks_local": local, "hit_blocks_peer": peer,
            "hit_ratio": (local + peer) / requested if requested else 0.0,
            "pulls": {o: count("kvfabric_pulls_total", transport=transport, outcome=o)
                      for o in ("hit", *(reason.value for reason in MissReason))},
            "pulled_bytes": count("kvfabric_pull_bytes_total", transport=transport),
            "said_yes_owner_no": count("kvfabric_directory_said_yes_owner_said_no_total"),
            "provenance_rejections": {r.value: count("kvfabric_provenance_rejections_total", reason=r.value)
                                      for r in Rejection}}


def node_stats(rt: NodeRuntime, loader: NodeLoader, upkeep: DirectoryUpkeep, directory: DirectoryClient
               ) -> dict[str, Any]:
    """Everything `NodeActor.stats` reports about one running node."""
    a = rt.address
    return {"node_id": rt.node_id, "node_name": rt.node_name, "incarnation": rt.incarnation,
            "pid": os.getpid(), "address": f"{a.host}:{a.port}", "transport": a.transport,
            "metrics_port": rt.metrics_port, "store": rt.kv_store.stats(),
            **counter_stats(rt.registry, a.transport),
            "revoked_certificates": len(rt.trust.revoked),
            "pending_directory_ops": upkeep.pending(), "overflows": upkeep.num_overflows(),
            "pending_mirrors": loader.pending_mirrors,
            "estimates": {"peers": loader.peer_estimates.snapshot(time.monotonic()),
                          "prefill_tokens_per_s": rt.local.prefill.snapshot()},
            "engine_load": dataclasses.asdict(rt.local.engine_load), "directory": directory.breaker_stats(),
            "kv_events": None if rt.kv_events is None else rt.kv_events.endpoints()}
