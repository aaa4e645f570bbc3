"""Counters kept in code and exported to Prometheus: owners read their own numbers, never the registry.

    owner ── inc(n) ──► CountedCounter.value (a float per label combination, under one lock)
                                  │
    /metrics scrape ──► collect() ┘ (a Prometheus collector: the same numbers, read at scrape time)

`stats()` answers and /metrics never disagree because there is one number: the counter is a
collector in the registry, so a scrape reads what the owner counted, as the gauges' callbacks do.
An `inc` costs a lock and an add (pulls are counted from the event loop, store work from I/O
threads), no more than a `prometheus_client.Counter` child's. The exposition is a Counter's:
`<name>` samples per label combination and their `_created` timestamps. Each label combination's
child is created once; `labels()` afterwards is a dict lookup.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily


class CountedChild:
    """One label combination of a `CountedCounter`."""

    __slots__ = ("_lock", "created", "value")

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError(f"counters only go up: inc({amount})")
        with self._lock:
            self.value += amount


class CountedCounter:
    """A counter named `name` (ending in `_total`), registered in `registry` as a collector."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *,
                 registry: CollectorRegistry | None) -> None:
        if not name.endswith("_total"):
            raise ValueError(f"a counter's name ends in _total, got {name!r}")
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()
        self._children: dict[tuple[str, ...], CountedChild] = {}
        self._unlabelled = None if self.labelnames else CountedChild(self._lock)
        if registry is not None:
            registry.register(self)

    def labels(self, *values: str) -> CountedChild:
        found = self._children.get(values)
        if found is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
            with self._lock:
                found = self._children.setdefault(values, CountedChild(self._lock))
        return found

    def inc(self, amount: float = 1.0) -> None:
        if self._unlabelled is None:
            raise ValueError(f"{self.name} takes labels {self.labelnames}: count through labels()")
        self._unlabelled.inc(amount)

    def value(self, *labels: str) -> float:
        """What was counted so far (for `labels`, or the unlabelled total); 0 before the first count."""
        if not labels and self._unlabelled is not None:
            return self._unlabelled.value
        found = self._children.get(labels)
        return 0.0 if found is None else found.value

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        with self._lock:
            children = list(self._children.items()) if self._unlabelled is None else [((), self._unlabelled)]
            for values, child in children:
                family.add_metric(list(values), child.value, created=child.created)
        yield family
