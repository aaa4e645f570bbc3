"""Latency of one kind of operation: running totals plus a ring of the most recent samples.

Pure bookkeeping (the caller measures and passes nanoseconds in). `record` is O(1) and allocates
nothing: the ring is preallocated and indexed with a power-of-two mask. `stats` sorts the ring,
O(window log window), so it belongs at scrape time, not on a hot path.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """Totals since start, percentiles over the recent window."""

    count: int
    mean_ns: float
    max_ns: int
    p50_ns: int
    p99_ns: int


class LatencyRecorder:
    """Running count / sum / max plus a preallocated ring of the most recent samples."""

    __slots__ = ("_count", "_index", "_mask", "_max", "_ring", "_total")

    def __init__(self, window: int = 1024) -> None:
        if window <= 0 or window & (window - 1):
            raise ValueError(f"latency window must be a power of two, got {window}")
        self._ring = [0] * window
        self._mask = window - 1
        self._index = 0
        self._count = 0
        self._total = 0
        self._max = 0

    def record(self, elapsed_ns: int) -> None:
        self._ring[self._index] = elapsed_ns
        self._index = (self._index + 1) & self._mask
        self._count += 1
        self._total += elapsed_ns
        if elapsed_ns > self._max:
            self._max = elapsed_ns

    def stats(self) -> LatencyStats:
        recent = sorted(self._ring[:min(self._count, len(self._ring))])
        if not recent:
            return LatencyStats(0, 0.0, 0, 0, 0)
        return LatencyStats(self._count, self._total / self._count, self._max,
                            recent[(len(recent) - 1) // 2], recent[(len(recent) - 1) * 99 // 100])
