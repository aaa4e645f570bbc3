"""Engine-facing block manager: sequences (`cluster.engines.reference.sequence`), prefix matching and events
over a `BlockPool`.

The semantics are nano-vllm's (chained block hashes, hits verified against the block's tokens,
can_allocate / allocate, can_append / may_append, deallocate), plus per-request reservations,
events and stats. The pool (`cluster.engines.reference.block_pool`) holds the per-block mechanics; this layer turns a
sequence's tokens into block hashes, walks the longest cached prefix (one walk, shared by
`match_prefix` and `allocate`), and queues `BlockStored` / `BlockEvicted` events.

Writing rule: the engine writes KV only into blocks whose one reference is its own. A hit block
may be shared, so it must already hold the KV the sequence needs. The block holding a prompt's
last token is therefore never taken as a hit (vLLM does the same): the engine computes that token
to get its logits, so a fully cached prompt gets a fresh last block, which then serves the hash.

Invariants (besides the pool's, checked by `check()` and the property tests)
    - ref[b] == number of block-table entries equal to b over all allocated sequences;
    - a hash is registered at most once; the events replayed give exactly the registered set.

Complexity: O(1) per block touched, whatever num_blocks (one hash, one dict probe, one O(1) unlink).
Out of blocks is a return value (`False`). Not thread-safe: the owner serialises calls and drains
`take_events()` after them. Timing lives outside, in `fabric.metrics.AllocatorMetrics`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cluster.engines.reference.block_pool import BlockPool, BlockState, RequestId
from cluster.engines.reference.sequence import SeqState, le_bytes
from fabric.events import BlockEvent, BlockEvicted, BlockStored
from fabric.keys import BlockHash, Namespace, chain_hash

__all__ = ["BlockManager", "BlockManagerStats", "BlockState", "ChainHashFn", "RequestId"]

ChainHashFn = Callable[[bytes, bytes], BlockHash]


@dataclass(frozen=True, slots=True)
class BlockManagerStats:
    num_blocks: int
    num_available: int  # in the free queue (FREE + CACHED): what an unreserved request can take
    num_cached: int  # free blocks that still serve a hash
    num_in_use: int  # ref > 0 (IN_USE + SHARED)
    num_reserved: int
    num_registered_hashes: int
    num_queried_blocks: int  # full blocks allocate looked up (never a prompt's last block)
    num_hit_blocks: int
    num_evicted: int

    @property
    def utilisation(self) -> float:
        """Fraction of blocks a new unreserved request cannot take."""
        return (self.num_in_use + self.num_reserved) / self.num_blocks if self.num_blocks else 0.0

    @property
    def hit_ratio(self) -> float:
        return self.num_hit_blocks / self.num_queried_blocks if self.num_queried_blocks else 0.0


class BlockManager:
    """Ref-counted pool of `num_blocks` KV blocks of `namespace.block_size` tokens each."""

    def __init__(self, namespace: Namespace, num_blocks: int, *, chain_hash_fn: ChainHashFn = chain_hash) -> None:
        """`chain_hash_fn` exists for experiments; anything but the default makes hashes no peer shares."""
        self._pool = BlockPool(num_blocks)
        self._ns = namespace
        self._block_size = namespace.block_size
        self._chain = chain_hash_fn
        self._events: list[BlockEvent] = []
        self._num_queried = 0
        self._num_hits = 0
        self._num_evicted = 0

    # ------------------------------------------------------------------ queries
    @property
    def namespace(self) -> Namespace:
        return self._ns

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free

    def num_reserved_for(self, request_id: RequestId) -> int:
        return len(self._pool.reserved.get(request_id, ()))

    def block_state(self, block_id: int) -> BlockState:
        return self._pool.state(block_id)

    def ref_count(self, block_id: int) -> int:
        return self._pool.ref[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        """The hash of the full block `block_id` holds (in use or cached), else None."""
        pool = self._pool
        if pool.ref[block_id] > 0 or pool.is_registered(block_id):
            return pool.hashes[block_id]
        return None

    def seq_block_hashes(self, seq: SeqState) -> list[BlockHash]:
        """Hashes of the sequence's full blocks, in order (what a store writes them under).

        A block filled by tokens that `may_append` has not seen yet has no hash so far; the list
        stops before it.
        """
        num_full = len(seq.token_ids) // self._block_size
        hashes = self._pool.hashes
        out: list[BlockHash] = []
        for b in seq.block_table[:num_full]:
            h = hashes[b]
            if h is None:
                break
            out.append(h)
        return out

    def free_block_ids(self) -> list[int]:
        """Free block ids in reuse order (head first). O(num free)."""
        return list(self._pool.free)

    def match_prefix(self, token_ids: Iterable[int], namespace: Namespace | None = None) -> int:
        """Tokens of the longest prefix whose full blocks are cached here (verified); no state change."""
        seq = SeqState(-1, token_ids, namespace=namespace)
        num_full = len(seq.token_ids) // self._block_size
        hits, _, _ = self._walk(self._root_for(seq), le_bytes(seq.token_ids), num_full)
        return len(hits) * self._block_size

    def _walk(self, parent: BlockHash, data: bytes, max_blocks: int
              ) -> tuple[list[int], BlockHash, BlockHash | None]:
        """The prefix walk: blocks of the longest run of up to `max_blocks` full blocks whose hash is
        registered and whose tokens match; the hash of the run's last block (`parent` if none); and
        the hash of the first block that missed (None when the run reached `max_blocks`)."""
        stride = 4 * self._block_size
        h2b_get, tokens, chain = self._pool.hash_to_block.get, self._pool.tokens, self._chain
        hits: list[int] = []
        for i in range(max_blocks):
            chunk = data[i * stride:i * stride + stride]
            h = chain(parent, chunk)
            b = h2b_get(h, -1)
            if b < 0 or tokens[b] != chunk:
                return hits, parent, h
            hits.append(b)
            parent = h
        return hits, parent, None

    def _root_for(self, seq: SeqState) -> BlockHash:
        ns = seq.namespace
        if ns is None or ns is self._ns:
            return self._ns.root
        if ns.block_size != self._block_size or ns.layout != self._ns.layout:
            raise ValueError(f"sequence {seq.seq_id}: namespace {ns.model_id!r} has another block size "
                             f"or KV layout than this pool")
        return ns.root

    # ------------------------------------------------------------------ allocation
    def num_blocks_needed(self, seq: SeqState) -> int:
        return -(-len(seq.token_ids) // self._block_size)

    def can_allocate(self, seq: SeqState) -> bool:
        """True when `allocate(seq)` will succeed (counts every block, as if nothing were cached)."""
        return self.num_blocks_needed(seq) <= self._pool.capacity(seq.request_id)

    def allocate(self, seq: SeqState) -> bool:
        """Give `seq` a block table, reusing its longest verified cached prefix.

        Sets `seq.num_cached_tokens` (never the last token's block: the writing rule above). Fresh
        blocks come from the request's reservation, then the free queue; False when out of blocks.
        """
        table = seq.block_table
        if table:
            raise ValueError(f"sequence {seq.seq_id} is already allocated")
        bs = self._block_size
        num_tokens = len(seq.token_ids)
        num_needed = -(-num_tokens // bs)
        pool = self._pool
        parent = self._root_for(seq)
        if num_needed > pool.capacity(seq.request_id):
            return False
        data = le_bytes(seq.token_ids)
        num_full = num_tokens // bs
        max_hits = (num_tokens - 1) // bs if num_tokens else 0  # never the last token's block
        hits, parent, miss_hash = self._walk(parent, data, max_hits)
        pool.touch(hits)
        table.extend(hits)
        num_hits = len(hits)
        self._num_queried += max_hits
        self._num_hits += num_hits
        seq.num_cached_tokens = num_hits * bs
        if num_hits == num_needed:
            return True
        # Every later block is fresh: the engine computes from the first miss on.
        evicted: list[BlockHash] = []
        table.extend(pool.take_fresh(num_needed - num_hits, seq.request_id, evicted))
        stored = _StoredRuns(parent)
        stride = 4 * bs
        chain = self._chain
        for i in range(num_hits, num_full):
            chunk = data[i * stride:i * stride + stride]
            h = miss_hash if i == num_hits and miss_hash is not None else chain(parent, chunk)
            self._register(table[i], h, chunk, stored)
            parent = h
        self._emit(evicted, stored)
        return True

    def can_append(self, seq: SeqState) -> bool:
        """True when `may_append(seq)` will succeed for the tokens `seq` holds now."""
        need = -(-len(seq.token_ids) // self._block_size) - len(seq.block_table)
        return need <= 0 or need <= self._pool.capacity(seq.request_id)

    def may_append(self, seq: SeqState) -> bool:
        """Catch the block table up with tokens appended since the last call.

        Takes a fresh block when a token starts a new block; when a block becomes full, hashes it
        (chained from the block before) and registers it, so later requests can hit it.
        Returns False, changing nothing, when a block is needed and none is left.
        """
        table = seq.block_table
        num_tokens = len(seq.token_ids)
        bs = self._block_size
        need = -(-num_tokens // bs) - len(table)
        if need > 0:
            if need > self._pool.capacity(seq.request_id):
                return False
            evicted: list[BlockHash] = []
            table.extend(self._pool.take_fresh(need, seq.request_id, evicted))
            if evicted:
                self._emit(evicted, None)
        num_full = num_tokens // bs
        if num_full and self._pool.hashes[table[num_full - 1]] is None:
            self._hash_new_full_blocks(seq, num_full)
        return True

    def _hash_new_full_blocks(self, seq: SeqState, num_full: int) -> None:
        table, hashes, bs = seq.block_table, self._pool.hashes, self._block_size
        first = num_full - 1
        while first > 0 and hashes[table[first - 1]] is None:
            first -= 1
        parent = hashes[table[first - 1]] if first else self._root_for(seq)
        if parent is None:
            raise RuntimeError(f"block {table[first - 1]} of sequence {seq.seq_id} lost its hash")
        data = le_bytes(seq.token_ids[first * bs:num_full * bs])
        stride = 4 * bs
        stored = _StoredRuns(parent)
        for k in range(num_full - first):
            chunk = data[k * stride:(k + 1) * stride]
            parent = self._chain(parent, chunk)
            self._register(table[first + k], parent, chunk, stored)
        self._emit(None, stored)

    def deallocate(self, seq: SeqState) -> None:
        """Drop the sequence's references, last block first; freed blocks keep their hashes."""
        self._pool.free_refs(seq.block_table)
        seq.block_table.clear()
        seq.num_cached_tokens = 0

    # ------------------------------------------------------------------ reservations
    def reserve(self, request_id: RequestId, num_blocks: int) -> bool:
        """Set `num_blocks` free blocks aside for `request_id` (added to any it already holds).

        Only allocations of sequences with this request id can take them. Their cached hashes are
        dropped now (evicted). Returns False, changing nothing, when fewer blocks are free.
        """
        if num_blocks < 0:
            raise ValueError(f"cannot reserve a negative number of blocks ({num_blocks})")
        evicted: list[BlockHash] = []
        if not self._pool.reserve(request_id, num_blocks, evicted):
            return False
        if evicted:
            self._emit(evicted, None)
        return True

    def release(self, request_id: RequestId) -> int:
        """Return the request's unused reserved blocks to the head of the free queue; how many."""
        return self._pool.release(request_id)

    # ------------------------------------------------------------------ events, stats
    def _register(self, block_id: int, h: BlockHash, chunk: bytes, stored: _StoredRuns) -> None:
        if self._pool.register(block_id, h, chunk):
            stored.add(h, block_id)
        else:  # the hash was already served (by an older copy): no event, the run breaks here
            stored.skip(h)

    def _emit(self, evicted: list[BlockHash] | None, stored: _StoredRuns | None) -> None:
        # Evictions first: a hash evicted and stored again in one call ends up stored.
        if evicted:
            self._events.append(BlockEvicted(tuple(evicted)))
            self._num_evicted += len(evicted)
        if stored is not None:
            stored.flush(self._events)

    def take_events(self) -> list[BlockEvent]:
        """Events since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def stats(self) -> BlockManagerStats:
        """Occupancy read off the pool (O(requests holding a reservation)) and this layer's counters."""
        pool = self._pool
        num_reserved = pool.num_reserved
        return BlockManagerStats(
            num_blocks=pool.num_blocks,
            num_available=pool.num_free,
            num_cached=pool.num_cached,
            num_in_use=pool.num_blocks - pool.num_free - num_reserved,
            num_reserved=num_reserved,
            num_registered_hashes=len(pool.hash_to_block),
            num_queried_blocks=self._num_queried,
            num_hit_blocks=self._num_hits,
            num_evicted=self._num_evicted,
        )

    def check(self) -> None:
        """Verify the pool's internal invariants; raises RuntimeError naming the broken one. O(n)."""
        self._pool.check()


class _StoredRuns:
    """Collects newly registered hashes of one call into BlockStored events of unbroken chains."""

    __slots__ = ("_hashes", "_ids", "_parent", "_runs")

    def __init__(self, parent: BlockHash) -> None:
        self._parent = parent
        self._hashes: list[BlockHash] = []
        self._ids: list[int] = []
        self._runs: list[BlockStored] = []

    def add(self, h: BlockHash, block_id: int) -> None:
        self._hashes.append(h)
        self._ids.append(block_id)

    def skip(self, h: BlockHash) -> None:
        """The block with hash `h` produced no event: close the run; the next one chains from `h`."""
        self._close()
        self._parent = h

    def _close(self) -> None:
        if self._hashes:
            self._runs.append(BlockStored(tuple(self._hashes), self._parent, tuple(self._ids)))
            self._hashes.clear()
            self._ids.clear()

    def flush(self, out: list[BlockEvent]) -> None:
        self._close()
        out.extend(self._runs)
        self._runs.clear()
