"""Events the node-local core queues for its owner to drain (`take_events()`), never callbacks.

A producer (the BlockManager) records what changed in the set of block hashes it can serve;
the owner (a NodeActor) drains the queue and forwards it, batched, to the directory.

Invariant a consumer may rely on: replaying a producer's events in order, adding the hashes of
every `BlockStored` and removing those of every `BlockEvicted`, yields exactly the set of hashes
the producer currently holds. A hash is never reported stored twice without an eviction between.
"""

from __future__ import annotations

from dataclasses import dataclass

from fabric.keys import BlockHash


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
