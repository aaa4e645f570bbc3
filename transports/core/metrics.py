"""Prometheus metrics of the transports (prefix `kvfabric_`), one registry per owner."""

from __future__ import annotations

from typing import overload

from prometheus_client import CollectorRegistry, Counter, Gauge

from fabric.counters import CountedChild, CountedCounter
from transports.core.base import Hit, PullResult
from transports.core.codec import MissReason


class TransportMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        # Counted in code as well (fabric/counters.py): owners read them without reading the registry.
        self.pulls = CountedCounter("kvfabric_pulls_total", "Pulled (block, layer) results by transport and outcome",
                                    ["transport", "outcome"], registry=self.registry)
        self.pull_bytes = CountedCounter("kvfabric_pull_bytes_total", "Verified payload bytes pulled",
                                         ["transport"], registry=self.registry)
        self.served = CountedCounter("kvfabric_served_total", "(block, layer) answers sent by the server",
                                     ["transport", "outcome"], registry=self.registry)
        self.served_bytes = CountedCounter("kvfabric_served_bytes_total", "Payload bytes sent by the server",
                                           ["transport"], registry=self.registry)
        self.protocol_errors = Counter("kvfabric_protocol_errors_total", "Connections or streams closed for "
                                       "a protocol error, by transport", ["transport"], registry=self.registry)
        self.auth_failures = Counter("kvfabric_auth_failures_total", "Peers refused during the handshake",
                                     ["transport", "reason"], registry=self.registry)
        self.overloaded = Counter("kvfabric_peer_overloaded_total", "Requests or connections refused with "
                                  "ERROR overloaded, by transport, peer node and the budget it was over "
                                  "(pulls, bytes, connections)", ["transport", "peer", "budget"],
                                  registry=self.registry)
        self.unauthorised_pulls = Counter("kvfabric_unauthorised_pulls_total", "PULLs answered with misses "
                                          "because the peer's certificate is restricted to other tenants "
                                          "than the namespace root's", ["transport", "peer"],
                                          registry=self.registry)
        self.connections = Gauge("kvfabric_connections", "Open connections", ["transport", "side"],
                                 registry=self.registry)

        self._children: dict[tuple[int, tuple[str, ...]], Counter | CountedChild] = {}

    @overload
    def child(self, metric: CountedCounter, *labels: str) -> CountedChild: ...
    @overload
    def child(self, metric: Counter, *labels: str) -> Counter: ...

    def child(self, metric: Counter | CountedCounter, *labels: str) -> Counter | CountedChild:
        """`metric.labels(*labels)`, looked up once: `labels()` costs microseconds, and the data
        path counts every (block, layer) it pulls or serves."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def record(self, transport: str, result: PullResult) -> None:
        if isinstance(result, Hit):
            self.child(self.pulls, transport, "hit").inc()
            self.child(self.pull_bytes, transport).inc(memoryview(result.payload).nbytes)
        else:
            self.child(self.pulls, transport, result.reason.value).inc()

    def digest_mismatches(self, transport: str) -> float:
        return self.pulls.value(transport, MissReason.DIGEST_MISMATCH.value)
