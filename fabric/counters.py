"""Counters kept in code and exported to Prometheus: owners read their own numbers, never the registry.

    owner ── inc(n) ──► CountedCounter ──► prometheus Counter (export: /metrics)
                                  └──────► value(*labels)     (what `stats()` reports)

`stats()` answers and /metrics never disagree because both come from the same `inc`: the value is
added to the Prometheus counter and to a plain float beside it, under one lock (pulls are counted
from the event loop, store work from I/O threads). Each label combination's child is created once;
`labels()` afterwards is a dict lookup.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter


class CountedChild:
    """One label combination of a `CountedCounter`."""

    __slots__ = ("_exported", "_lock", "value")

    def __init__(self, exported: Counter, lock: threading.Lock) -> None:
        self._exported = exported
        self._lock = lock
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        with self._lock:
            self._exported.inc(amount)
            self.value += amount


class CountedCounter:
    """A Prometheus counter named `name` (in `registry`) whose values this object also keeps."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *,
                 registry: CollectorRegistry | None) -> None:
        self.name = name
        self.labelnames = tuple(labelnames)
        self._exported = Counter(name, documentation, self.labelnames, registry=registry)
        self._lock = threading.Lock()
        self._children: dict[tuple[str, ...], CountedChild] = {}
        self._unlabelled = None if self.labelnames else CountedChild(self._exported, self._lock)

    def labels(self, *values: str) -> CountedChild:
        found = self._children.get(values)
        if found is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
            with self._lock:
                found = self._children.setdefault(values, CountedChild(self._exported.labels(*values), self._lock))
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
