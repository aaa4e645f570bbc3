"""One request computes at a time on an engine actor; the rest queue. `LoadGate` counts them and
reports every change to the node's fabric, where routers read it with each lookup.

An engine actor is threaded (it accepts requests while one computes, so its queue is visible);
`request(num_tokens)` wraps one request: queued (with its prompt tokens, the prefill it still owes)
until it may compute, then running, then gone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from cluster.api import EngineLoad


class LoadGate:
    def __init__(self, report: Callable[[EngineLoad], None] | None) -> None:
        self._report_to = report
        self._compute = threading.Lock()      # one request computes at a time
        self._counts = threading.Lock()
        self._running = self._queued = self._queued_tokens = 0

    @contextmanager
    def request(self, num_tokens: int) -> Iterator[None]:
        """Count a request as queued until it may compute, then as running; report each change."""
        with self._counts:
            self._queued += 1
            self._queued_tokens += num_tokens
            self._report()
        try:
            with self._compute:
                with self._counts:
                    self._queued -= 1
                    self._running += 1
                    self._report()
                yield
        finally:
            with self._counts:
                if self._running:
                    self._running -= 1
                else:                      # never got to compute
                    self._queued -= 1
                self._queued_tokens -= num_tokens
                self._report()

    def load(self) -> EngineLoad:
        with self._counts:
            return EngineLoad(self._running, self._queued, self._queued_tokens)

    def _report(self) -> None:
        if self._report_to is not None:
            self._report_to(EngineLoad(self._running, self._queued, self._queued_tokens))
