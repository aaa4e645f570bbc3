"""What the transport servers share besides the sessions: reading blocks from the store in
batches (on the loop or in a thread pool) and a periodic timer over connections.

`fetch` calls the store (I/O); the sessions never do. `Watchdog` ticks every `interval_s` and lets
each connection compare `now` with its session's `next_deadline()`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from fabric.keys import BlockAddress
from transports.base import BlockSource
from transports.session import Fetched

logger = logging.getLogger(__name__)

BATCH_BYTES = 1024 * 1024         # a server fetches up to this many payload bytes per batch
INLINE_FETCH_S = 0.001            # a get_block slower than this on the loop counts as slow …
SLOW_STREAK = 3                   # … this many in a row send fetching to the thread pool …
SLOW_SOURCE_HOLD_S = 1.0          # … for this long


class Watched(Protocol):
    def watchdog(self, now: float) -> None: ...


class Watchdog:
    """Every `interval_s`, `conn.watchdog(now)` for each connection `connections()` lists (a copy:
    a watchdog may close its connection, which then leaves the collection)."""

    def __init__(self, interval_s: float, connections: Callable[[], list[Watched]]) -> None:
        self._loop = asyncio.get_running_loop()
        self._interval_s = interval_s
        self._connections = connections
        self._handle = self._loop.call_later(interval_s, self._tick)

    def _tick(self) -> None:
        now = self._loop.time()
        for conn in self._connections():
            conn.watchdog(now)
        self._handle = self._loop.call_later(self._interval_s, self._tick)

    def cancel(self) -> None:
        self._handle.cancel()


def watchdog_interval(frame_timeout_s: float, idle_timeout_s: float) -> float:
    return max(0.02, min(frame_timeout_s, idle_timeout_s) / 8)


def fetch(source: BlockSource, addresses: Sequence[BlockAddress], budget: int,
          slow_s: float = float("inf")) -> tuple[list[Fetched], bool]:
    """Read blocks from the start of `addresses` until `budget` payload bytes; stops early, and says
    so, after a read slower than `slow_s` (disk). A read that raises becomes that exception (the
    session answers MISS(source_error)); nothing else is caught."""
    out: list[Fetched] = []
    get = source.get_block
    for address in addresses:
        start = time.perf_counter()
        got: Fetched
        try:
            got = get(address)
        except Exception as e:  # any failure behind the store is that block's miss, logged once
            logger.error("block source failed reading %s: %r", address, e)
            got = e
        out.append(got)
        if got is not None and not isinstance(got, Exception):
            budget -= len(got.payload)
        if time.perf_counter() - start > slow_s:
            return out, True
        if budget <= 0:
            break
    return out, False
