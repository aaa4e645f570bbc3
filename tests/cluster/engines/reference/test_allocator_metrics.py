"""AllocatorMetrics: an engine pool's occupancy and call latencies, as Prometheus exposes them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cluster.engines.reference.allocator_metrics import AllocatorMetrics
from cluster.engines.reference.block_manager import BlockManager
from cluster.engines.reference.sequence import SeqState
from fabric.keys import Namespace
from fabric.layout import KVLayout


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_allocator_metrics_follow_the_block_manager() -> None:
    registry = CollectorRegistry()
    layout = KVLayout.mha(num_layers=2, num_kv_heads=2, head_dim=8, dtype="f16")
    bm = BlockManager(Namespace("m", layout, 4), num_blocks=10)
    am = AllocatorMetrics(bm, registry)   # the calls go through it, so it times them
    seqs = [SeqState(i, [1, 2, 3, 4, 5 + i]) for i in range(3)]   # 2 blocks each, the first shared
    for seq in seqs:
        assert am.allocate(seq)
    am.deallocate(seqs[0])
    assert am.reserve("r", 2)
    got = samples(generate_latest(registry))
    state = {s: got[("kvfabric_allocator_blocks", (("state", s),))]
             for s in ("available", "cached", "in_use", "reserved")}
    assert state == {"available": 5, "cached": 0, "in_use": 3, "reserved": 2}
    assert got[("kvfabric_allocator_utilisation", ())] == 0.5
    assert got[("kvfabric_allocator_latency_seconds_count", (("op", "allocate"),))] == 4   # 3 + reserve
    assert got[("kvfabric_allocator_latency_seconds_count", (("op", "release"),))] == 1
    assert got[("kvfabric_allocator_latency_seconds_sum", (("op", "allocate"),))] > 0
    assert got[("kvfabric_allocator_recent_latency_seconds", (("op", "allocate"), ("quantile", "0.99")))] > 0
