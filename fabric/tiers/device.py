"""Device tier hook: which block hashes are resident in the engine's KV pool right now.

The payloads stay in the engine (GPU pages); the fabric never reads them from here. It only keeps
the set of resident block hashes, fed by the block manager's events, so a lookup can answer "on
the GPU now" without a call into the engine:

    BlockStored(block_hashes=(h, ...))   -> those hashes become resident
    BlockEvicted(block_hashes=(h, ...))  -> those hashes leave

Events are `fabric.events.BlockStored` / `BlockEvicted`; an object of another class with the same
name and a `block_hashes` sequence (an engine adapter's own event type) is accepted too. Anything
else raises `UnknownEventError`, because silently ignoring a block manager event would make lookups
lie.

Data structure: one `set[BlockHash]`; contains / apply O(1) per hash. Not thread-safe by itself
(the Store serialises calls under its lock). A hash means every layer of that block is resident.
"""

from __future__ import annotations

from collections.abc import Iterable

from fabric.errors import FabricError
from fabric.events import BlockEvicted, BlockStored
from fabric.keys import BlockHash
from fabric.tiers.base import Tier, TierStats

STORED_EVENTS = frozenset({"BlockStored"})
EVICTED_EVENTS = frozenset({"BlockEvicted"})


class UnknownEventError(FabricError, TypeError):
    """An object that is neither a BlockStored nor a BlockEvicted event (or has no block_hashes)."""


class DeviceTier:
    """Resident block hashes of the engine's pool."""

    tier = Tier.DEVICE

    def __init__(self) -> None:
        self._resident: set[BlockHash] = set()
        self.num_events = 0

    def __len__(self) -> int:
        return len(self._resident)

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._resident

    def apply(self, event: object) -> None:
        """Apply one BlockStored / BlockEvicted event (any object with `block_hashes`)."""
        name = type(event).__name__
        hashes = getattr(event, "block_hashes", None)
        if hashes is None or isinstance(hashes, bytes | str):
            raise UnknownEventError(f"{name} has no block_hashes sequence")
        if isinstance(event, BlockStored) or name in STORED_EVENTS:
            self._resident.update(BlockHash(bytes(h)) for h in hashes)
        elif isinstance(event, BlockEvicted) or name in EVICTED_EVENTS:
            self._resident.difference_update(BlockHash(bytes(h)) for h in hashes)
        else:
            raise UnknownEventError(f"unknown block event {name}; expected BlockStored or BlockEvicted")
        self.num_events += 1

    def apply_all(self, events: Iterable[object]) -> int:
        """Apply events in order; returns how many were applied."""
        count = 0
        for event in events:
            self.apply(event)
            count += 1
        return count

    def remove(self, block_hash: BlockHash) -> bool:
        if block_hash in self._resident:
            self._resident.discard(block_hash)
            return True
        return False

    def clear(self) -> None:
        """The engine restarted or dropped its whole pool."""
        self._resident.clear()

    def stats(self) -> TierStats:
        # Bytes and capacity belong to the engine's pool; only the count is known here.
        return TierStats(len(self._resident), 0, 0)
