"""Prometheus metrics of one Store (prefix `kvfabric_`), in a registry of its own.

    kvfabric_blocks{tier}                       gauge, read from the tiers at scrape time
    kvfabric_bytes{tier}                        gauge, idem (SSD counts whole files, header included)
    kvfabric_lookup_seconds{tier,outcome}       histogram of get / get_block: tier that answered
                                                (device/ram/ssd, "none" on a miss), outcome
                                                hit / miss / corrupt
    kvfabric_evictions_total{tier}              counter
    kvfabric_corrupt_blocks_total{tier}         counter: blocks that failed verification and were removed
    kvfabric_index_reconciled_total{action}     counter: see fabric/index.py for the actions
    kvfabric_put_rejected_total{reason}         counter: full / no_space / digest_mismatch / io_error
    kvfabric_pending_writes                     gauge: write-behind blocks not yet on SSD

An engine's BlockManager is exported beside them by `AllocatorMetrics` (occupancy read at scrape time,
latency of the calls made through it):

    kvfabric_allocator_blocks{state}            gauge: available / cached / in_use / reserved
    kvfabric_allocator_utilisation              gauge: share of blocks a new request cannot take
    kvfabric_allocator_latency_seconds{op}      summary (count, sum) of allocate / release calls
    kvfabric_allocator_recent_latency_seconds{op,quantile}   gauge: p50 / p99 of recent calls

One `CollectorRegistry` per Store, so several stores (or tests) in one process never collide.
`render()` gives the text exposition; `serve(port)` starts an HTTP endpoint for that registry.
Gauges are callbacks, so the hot paths pay nothing for them; the histogram children used on the
hot path are bound once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from time import perf_counter_ns
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

from fabric.block_manager import BlockManager, RequestId, SeqState
from fabric.latency import LatencyRecorder, LatencyStats
from fabric.tiers.base import Tier

LOOKUP_BUCKETS = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0)
OUTCOMES = ("hit", "miss", "corrupt")


class StoreMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.blocks = Gauge("kvfabric_blocks", "Blocks held per tier", ["tier"], registry=r)
        self.bytes = Gauge("kvfabric_bytes", "Bytes held per tier", ["tier"], registry=r)
        self.lookup_seconds = Histogram("kvfabric_lookup_seconds", "Time to answer a block get, by the tier "
                                        "that answered and the outcome", ["tier", "outcome"],
                                        buckets=LOOKUP_BUCKETS, registry=r)
        self.evictions = Counter("kvfabric_evictions_total", "Blocks evicted per tier", ["tier"], registry=r)
        self.corrupt = Counter("kvfabric_corrupt_blocks_total", "Blocks that failed verification and "
                               "were removed", ["tier"], registry=r)
        self.reconciled = Counter("kvfabric_index_reconciled_total", "Index / SSD disagreements repaired, "
                                  "by action", ["action"], registry=r)
        self.put_rejected = Counter("kvfabric_put_rejected_total", "Puts refused, by reason", ["reason"],
                                    registry=r)
        self.pending_writes = Gauge("kvfabric_pending_writes", "Write-behind blocks not yet on SSD",
                                    registry=r)
        self._hit = {t: self.lookup_seconds.labels(t.value, "hit") for t in Tier}
        self._miss = self.lookup_seconds.labels("none", "miss")
        self._corrupt = self.lookup_seconds.labels(Tier.SSD.value, "corrupt")

    def bind_tier(self, tier: Tier, num_blocks: Callable[[], float], num_bytes: Callable[[], float]) -> None:
        """Report a tier's size by calling these at scrape time."""
        self.blocks.labels(tier.value).set_function(num_blocks)
        self.bytes.labels(tier.value).set_function(num_bytes)

    def observe_hit(self, tier: Tier, seconds: float) -> None:
        self._hit[tier].observe(seconds)

    def observe_miss(self, seconds: float) -> None:
        self._miss.observe(seconds)

    def observe_corrupt(self, tier: Tier, seconds: float) -> None:
        self._corrupt.observe(seconds)
        self.corrupt.labels(tier.value).inc()

    def value(self, name: str, **labels: str) -> float:
        """Current value of one sample (0 if never set): a convenience for stats and tests."""
        found = self.registry.get_sample_value(name, labels)
        return 0.0 if found is None else found

    def render(self) -> bytes:
        """The Prometheus text exposition of this store's registry."""
        return generate_latest(self.registry)

    def serve(self, port: int, addr: str = "127.0.0.1") -> tuple[WSGIServer, threading.Thread]:
        """Serve /metrics for this registry on addr:port (port 0 picks one: see server.server_port)."""
        return start_http_server(port, addr=addr, registry=self.registry)


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
