"""Events the node-local core queues for its owner to drain (`take_events()`), never callbacks.

Two producers:

* the BlockManager (device pages): `BlockStored` / `BlockEvicted`, by block hash;
* the Store (RAM / SSD): `StoreEvents`, an ordered tuple of (EventKind, BlockAddress), drained
  from a bounded `StoreEventLog`.

A producer (the BlockManager) records what changed in the set of block hashes it can serve;
the owner (a NodeActor) drains the queue and forwards it, batched, to the directory.

Invariant a consumer may rely on: replaying a producer's events in order, adding the hashes of
every `BlockStored` and removing those of every `BlockEvicted`, yields exactly the set of hashes
the producer currently holds. A hash is never reported stored twice without an eviction between.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

from fabric.keys import BlockAddress, BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks whose hashes became available, in chain order.

    `block_hashes[0]` chains from `parent_hash` (the namespace root for a sequence's first block)
    and each later hash chains from the one before it. `block_ids[i]` is the device block that
    holds `block_hashes[i]`.
    """

    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash
    block_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.block_hashes) != len(self.block_ids):
            raise ValueError(f"BlockStored has {len(self.block_hashes)} hashes but "
                             f"{len(self.block_ids)} block ids")


@dataclass(frozen=True, slots=True)
class BlockEvicted:
    """Hashes that can no longer be served: their block id was reused for other tokens."""

    block_hashes: tuple[BlockHash, ...]


BlockEvent = BlockStored | BlockEvicted


class EventKind(enum.Enum):
    """What happened to a (block, layer) in the store."""

    STORED = "stored"      # it became held (first acknowledged put or mirror; not a promotion)
    REMOVED = "removed"    # no tier holds it any more (eviction of the last copy, TTL, delete, corrupt)


@dataclass(frozen=True, slots=True)
class StoreEvents:
    """Store events in the order they happened.

    `overflowed` True means events were dropped because the queue passed its bound: `events` is
    then empty, and the consumer must resync from `Store.held_addresses()` and apply later batches
    on top (a later batch may repeat what the snapshot already shows: treat events as set updates).
    """

    events: tuple[tuple[EventKind, BlockAddress], ...]
    overflowed: bool


class StoreEventLog:
    """A bounded FIFO of store events. Not thread-safe (the Store appends and drains under its lock).

    Past `max_events` the queue is cleared and marked overflowed, and stays empty until the next
    `take()`, which reports the overflow once: a consumer never silently misses an event.
    append / take O(1) per event.
    """

    def __init__(self, max_events: int) -> None:
        if max_events <= 0:
            raise ValueError(f"max_events must be positive, got {max_events}")
        self.max_events = max_events
        self._queue: deque[tuple[EventKind, BlockAddress]] = deque()
        self._overflowed = False

    def __len__(self) -> int:
        return len(self._queue)

    def append(self, kind: EventKind, address: BlockAddress) -> None:
        if self._overflowed:
            return
        if len(self._queue) >= self.max_events:
            self._queue.clear()
            self._overflowed = True
            return
        self._queue.append((kind, address))

    def take(self, max_events: int | None = None) -> StoreEvents:
        """Up to `max_events` of the oldest events (all when None), or the overflow marker."""
        if self._overflowed:
            self._overflowed = False
            return StoreEvents((), True)
        if max_events is None or max_events >= len(self._queue):
            out = tuple(self._queue)
            self._queue.clear()
        else:
            out = tuple(self._queue.popleft() for _ in range(max(0, max_events)))
        return StoreEvents(out, False)
