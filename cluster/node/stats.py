"""A node's `stats()` answer: what its metrics registry counted, beside its store, directory upkeep,
estimates and engine load, as one JSON-ready dict (what `kvfabric stats` prints per node).

The counters come from their owners (`ClusterMetrics`, `TransportMetrics`), which keep them in code
beside the Prometheus counters they export (fabric/counters.py): `stats()` and `/metrics` never
disagree, and nothing is read back out of the registry.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from cluster.directory.client import DirectoryClient
from cluster.directory.upkeep import DirectoryUpkeep
from cluster.node.metrics import ClusterMetrics
from cluster.node.reads import NodeLoader
from cluster.node.runtime import NodeRuntime
from fabric.provenance import Rejection
from transports.core.codec import MissReason
from transports.core.metrics import TransportMetrics


def counter_stats(cluster: ClusterMetrics, pulls: TransportMetrics, transport: str) -> dict[str, Any]:
    """Hits, pulls and rejections as counted so far by their owners."""
    requested = cluster.requested_blocks.value()
    local, peer = cluster.hit_blocks.value("local"), cluster.hit_blocks.value("peer")
    return {"requested_blocks": requested, "hit_blocks_local": local, "hit_blocks_peer": peer,
            "hit_ratio": (local + peer) / requested if requested else 0.0,
            "pulls": {o: pulls.pulls.value(transport, o) for o in ("hit", *(reason.value for reason in MissReason))},
            "pulled_bytes": pulls.pull_bytes.value(transport),
            "said_yes_owner_no": cluster.said_yes_owner_no.value(),
            "provenance_rejections": {r.value: cluster.provenance_rejections.value(r.value) for r in Rejection}}


def node_stats(rt: NodeRuntime, loader: NodeLoader, upkeep: DirectoryUpkeep, directory: DirectoryClient
               ) -> dict[str, Any]:
    """Everything `NodeActor.stats` reports about one running node."""
    a = rt.address
    return {"node_id": rt.node_id, "node_name": rt.node_name, "incarnation": rt.incarnation,
            "pid": os.getpid(), "address": f"{a.host}:{a.port}", "transport": a.transport,
            "metrics_port": rt.metrics_port, "store": rt.kv_store.stats(),
            **counter_stats(rt.metrics, rt.transport_metrics, a.transport),
            "revoked_certificates": len(rt.trust.revoked),
            "pending_directory_ops": upkeep.pending(), "overflows": upkeep.num_overflows(),
            "pending_mirrors": loader.pending_mirrors,
            "estimates": {"peers": loader.peer_estimates.snapshot(time.monotonic()),
                          "prefill_tokens_per_s": rt.local.prefill.snapshot()},
            "engine_load": dataclasses.asdict(rt.local.engine_load), "directory": directory.breaker_stats(),
            "kv_events": None if rt.kv_events is None else rt.kv_events.endpoints()}
