"""Prometheus metrics of one Store (prefix `kvfabric_`), in a registry of its own.

    kvfabric_blocks{tier}                       gauge, (block, layer) payloads, read from the tiers at scrape time
    kvfabric_held_blocks{tier}                  gauge, distinct blocks (block hashes) with a layer in the tier
    kvfabric_bytes{tier}                        gauge, idem (SSD counts whole files, header included)
    kvfabric_lookup_seconds{tier,outcome}       histogram of get / get_block: tier that answered
                                                (device/ram/ssd, "none" on a miss), outcome
                                                hit / miss / corrupt
    kvfabric_evictions_total{tier}              counter
    kvfabric_corrupt_blocks_total{tier}         counter: blocks that failed verification and were removed
    kvfabric_index_reconciled_total{action}     counter: see fabric/index.py for the actions
    kvfabric_put_rejected_total{reason}         counter: full / pinned / no_space / digest_mismatch /
                                                conflict / io_error
    kvfabric_pending_writes                     gauge: write-behind blocks not yet on SSD
    kvfabric_store_conflicts_total{held_producer,new_producer}
                                                counter: puts refused because the address holds other
                                                bytes, by the producers of both ("unsigned": no record)

An engine's BlockManager is exported beside them by `cluster.engines.reference.allocator_metrics`.

One `CollectorRegistry` per Store, so several stores (or tests) in one process never collide.
`render()` gives the text exposition; `serve(port)` starts an HTTP endpoint for that registry.
Gauges are callbacks, so the hot paths pay nothing for them; the histogram children used on the
hot path are bound once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

from fabric.tiers.base import Tier

LOOKUP_BUCKETS = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0)
OUTCOMES = ("hit", "miss", "corrupt")


class StoreMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.blocks = Gauge("kvfabric_blocks", "(block, layer) payloads held per tier", ["tier"], registry=r)
        self.held_blocks = Gauge("kvfabric_held_blocks", "Distinct blocks with a layer held, per tier", ["tier"],
                                 registry=r)
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
        self.conflicts = Counter("kvfabric_store_conflicts_total", "Puts of other bytes than those held at "
                                 "the address, by the producer of the held and of the refused bytes",
                                 ["held_producer", "new_producer"], registry=r)
        self.pending_writes = Gauge("kvfabric_pending_writes", "Write-behind blocks not yet on SSD",
                                    registry=r)
        self._hit = {t: self.lookup_seconds.labels(t.value, "hit") for t in Tier}
        self._miss = self.lookup_seconds.labels("none", "miss")
        self._corrupt = self.lookup_seconds.labels(Tier.SSD.value, "corrupt")

    def bind_tier(self, tier: Tier, num_blocks: Callable[[], float], num_bytes: Callable[[], float],
                  num_held_blocks: Callable[[], float] | None = None) -> None:
        """Report a tier's size by calling these at scrape time (held blocks: `num_blocks` if not given)."""
        self.blocks.labels(tier.value).set_function(num_blocks)
        self.bytes.labels(tier.value).set_function(num_bytes)
        self.held_blocks.labels(tier.value).set_function(num_blocks if num_held_blocks is None else num_held_blocks)

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
