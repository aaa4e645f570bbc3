"""BlockPool: the mechanics under the block manager (derived counts, primitives, invariant check).

The manager's tests and its state machine drive the pool through the public API; these pin the
pool's own contract: counts read off its state, `num_cached` kept right by each primitive, and
`check()` naming a broken invariant.
"""

from __future__ import annotations

import pytest

from cluster.engines.reference.block_pool import BlockPool, BlockState
from fabric.keys import BlockHash, chain_hash

ROOT = BlockHash(bytes(32))


def h(i: int) -> BlockHash:
    return chain_hash(ROOT, i.to_bytes(4, "little"))


def test_counts_are_derived_from_the_pool_state() -> None:
    pool = BlockPool(6)
    evicted: list[BlockHash] = []
    blocks = pool.take_fresh(3, None, evicted)
    assert blocks == [0, 1, 2] and evicted == []
    assert pool.reserve("r", 2, evicted)
    assert (pool.num_free, pool.num_reserved, pool.num_in_use, pool.num_cached) == (1, 2, 3, 0)
    assert pool.capacity(None) == 1 and pool.capacity("r") == 3
    assert not pool.reserve("r", 2, evicted)  # only one is free: nothing changes
    assert pool.num_reserved == 2
    assert pool.release("r") == 2 and list(pool.free)[:3] == [3, 4, 5]  # released ones go first
    pool.check()


def test_num_cached_follows_every_primitive() -> None:
    pool = BlockPool(4)
    evicted: list[BlockHash] = []
    a = pool.take_fresh(2, None, evicted)
    assert pool.register(a[0], h(0), b"t0") and pool.register(a[1], h(1), b"t1")
    pool.free_refs(a)  # both freed with their hashes: cached, the last one first in the queue
    assert pool.num_cached == 2 and list(pool.free) == [2, 3, 1, 0]
    assert [pool.state(b) for b in (0, 1, 2)] == [BlockState.CACHED, BlockState.CACHED, BlockState.FREE]
    pool.touch([a[0]])  # a hit revives a cached block out of the middle of the queue
    assert pool.num_cached == 1 and pool.ref[a[0]] == 1 and a[0] not in pool.free
    b = pool.take_fresh(1, None, evicted)  # block 2 (never used): drops nothing
    assert not pool.register(b[0], h(1), b"t1")  # a second copy of h(1) takes over; the old one
    assert pool.num_cached == 0 and pool.state(a[1]) is BlockState.FREE  # no longer serves it
    pool.take_fresh(1, None, evicted)  # block 3, then the old copy of h(1): no hash to drop
    pool.take_fresh(1, None, evicted)
    assert evicted == [] and pool.num_free == 0
    pool.free_refs([a[0]])
    assert pool.num_cached == 1
    c = pool.take_fresh(1, None, evicted)  # reusing the cached block evicts its hash
    assert c == [a[0]] and evicted == [h(0)] and pool.num_cached == 0
    assert h(0) not in pool.hash_to_block
    pool.check()


def test_check_names_a_broken_invariant() -> None:
    pool = BlockPool(3)
    pool.take_fresh(1, None, [])
    pool.check()
    pool.ref[2] = 1  # a free block with a reference
    with pytest.raises(RuntimeError, match="free block 2"):
        pool.check()
    pool.ref[2] = 0
    pool._num_cached = 5
    with pytest.raises(RuntimeError, match="counter says 5"):
        pool.check()


def test_dropping_a_reference_that_is_not_there_is_a_bug() -> None:
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="no reference"):
        pool.free_refs([0])
    with pytest.raises(ValueError):
        BlockPool(0)
