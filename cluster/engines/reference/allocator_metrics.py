"""Prometheus metrics of an engine's BlockManager, exported beside the Store's (prefix `kvfabric_`):

    kvfabric_allocator_blocks{state}            gauge: available / cached / in_use / reserved
    kvfabric_allocator_utilisation              gauge: share of blocks a new request cannot take
    kvfabric_allocator_latency_seconds{op}      summary (count, sum) of allocate / release calls
    kvfabric_allocator_recent_latency_seconds{op,quantile}   gauge: p50 / p99 of recent calls

Occupancy is read at scrape time; latency is that of the calls made through `AllocatorMetrics`.
"""

from __future__ import annotations

from collections.abc import Iterator
from time import perf_counter_ns

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

from cluster.engines.reference.block_manager import BlockManager, RequestId
from cluster.engines.reference.sequence import SeqState
from fabric.latency import LatencyRecorder, LatencyStats


class AllocatorMetrics(Collector):
    """A BlockManager's occupancy (read from `stats()` at scrape time) and the latency of its calls.

    The manager itself keeps no clocks: an engine that wants allocator latencies calls the manager
    through this object (`metrics.allocate(seq)` ...), which times each call and delegates. Register
    one per engine pool: `AllocatorMetrics(manager, registry)`. The manager is not thread-safe, so a
    scrape must not overlap its owner's calls (its owner's lock, or a snapshot the owner refreshes).
    """

    def __init__(self, manager: BlockManager, registry: CollectorRegistry, *, latency_window: int = 1024) -> None:
        self.manager = manager
        self._alloc = LatencyRecorder(latency_window)
        self._release = LatencyRecorder(latency_window)
        registry.register(self)

    def allocate(self, seq: SeqState) -> bool:
        start = perf_counter_ns()
        ok = self.manager.allocate(seq)
        if ok:
            self._alloc.record(perf_counter_ns() - start)
        return ok

    def may_append(self, seq: SeqState) -> bool:
        """Timed as an allocation only when it takes a block (most decode steps take none)."""
        before = len(seq.block_table)
        start = perf_counter_ns()
        ok = self.manager.may_append(seq)
        if len(seq.block_table) != before:
            self._alloc.record(perf_counter_ns() - start)
        return ok

    def reserve(self, request_id: RequestId, num_blocks: int) -> bool:
        start = perf_counter_ns()
        ok = self.manager.reserve(request_id, num_blocks)
        if ok:
            self._alloc.record(perf_counter_ns() - start)
        return ok

    def deallocate(self, seq: SeqState) -> None:
        start = perf_counter_ns()
        self.manager.deallocate(seq)
        self._release.record(perf_counter_ns() - start)

    def release(self, request_id: RequestId) -> int:
        start = perf_counter_ns()
        num = self.manager.release(request_id)
        if num:
            self._release.record(perf_counter_ns() - start)
        return num

    def latencies(self) -> dict[str, LatencyStats]:
        """Latency of allocate-side calls (allocate / may_append taking a block / reserve) and release-side
        calls (deallocate / release returning blocks)."""
        return {"allocate": self._alloc.stats(), "release": self._release.stats()}

    def collect(self) -> Iterator[Metric]:
        st = self.manager.stats()
        blocks = GaugeMetricFamily("kvfabric_allocator_blocks", "Engine pool blocks by state", labels=["state"])
        for state, n in (("available", st.num_available), ("cached", st.num_cached),
                         ("in_use", st.num_in_use), ("reserved", st.num_reserved)):
            blocks.add_metric([state], n)
        yield blocks
        yield GaugeMetricFamily("kvfabric_allocator_utilisation", "Share of engine pool blocks a new "
                                "request cannot take", value=st.utilisation)
        total = SummaryMetricFamily("kvfabric_allocator_latency_seconds", "Allocate / release calls of the "
                                    "engine pool", labels=["op"])
        recent = GaugeMetricFamily("kvfabric_allocator_recent_latency_seconds", "Latency quantiles over the "
                                   "most recent allocate / release calls", labels=["op", "quantile"])
        for op, lat in self.latencies().items():
            total.add_metric([op], lat.count, lat.count * lat.mean_ns / 1e9)
            for quantile, ns in _quantiles(lat):
                recent.add_metric([op, quantile], ns / 1e9)
        yield total
        yield recent


def _quantiles(lat: LatencyStats) -> tuple[tuple[str, int], ...]:
    return (("0.5", lat.p50_ns), ("0.99", lat.p99_ns))
