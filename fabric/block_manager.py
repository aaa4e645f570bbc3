"""Engine-facing block manager: a fixed pool of KV block ids with ref counts and prefix caching.

The semantics are nano-vllm's (chained block hashes, hits verified against the block's tokens,
can_allocate / allocate, can_append / may_append, deallocate), plus per-request reservations,
events and stats. All per-block state lives in preallocated lists indexed by block id:

    _ref[b]     number of sequences whose block table holds b (0 = free or reserved)
    _hash[b]    chain hash of b's tokens once b holds a full block, else None
    _tokens[b]  b's tokens as little-endian u32 bytes (what a hit is verified against)
    _hash_to_block   registered hash -> the one block that serves it
    _free       FreeBlockQueue (intrusive LRU list) of every block with _ref == 0 not reserved
    _reserved   request id -> block ids set aside for it (hash already dropped)

Block states:  FREE (queued, no registered hash)  CACHED (queued, registered: a hit revives it)
               RESERVED (held for a request)  IN_USE (ref 1)  SHARED (ref > 1)

Invariants (checked by `check()` and the property tests)
    - every block is in exactly one of: free queue, some reservation, ref > 0;
      so len(free) + num_reserved + num_in_use == num_blocks;
    - _ref[b] == number of block-table entries equal to b over all allocated sequences;
    - _hash_to_block[h] == b  implies  _hash[b] == h (a registered hash names its block);
    - a hash is registered at most once; the events replayed give exactly the registered set;
    - a freed block keeps its hash until its id is handed out again; the least recently freed
      block is handed out first (a finished sequence frees its blocks last-to-first, so the tail
      of a prompt is evicted before its head).

Complexity: every operation is O(1) per block touched, whatever num_blocks: hashing each full
block once, one dict probe, one O(1) unlink from the free queue. No list is searched or shifted.
Out of blocks is a return value (`False`), never an exception. Not thread-safe: the owner (an
engine loop or a NodeActor) serialises calls, and drains `take_events()` after them.
"""

from __future__ import annotations

import enum
import sys
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from time import perf_counter_ns

from fabric.events import BlockEvent, BlockEvicted, BlockStored
from fabric.free_queue import EMPTY, FreeBlockQueue
from fabric.keys import BlockHash, Namespace, chain_hash

ChainHashFn = Callable[[bytes, bytes], BlockHash]
RequestId = str

if array("I").itemsize != 4:  # pragma: no cover - every supported platform has a 32-bit C int
    raise ImportError("fabric.block_manager needs array('I') to hold 32-bit token ids")
_LITTLE_ENDIAN = sys.byteorder == "little"


def _le_bytes(tokens: array[int]) -> bytes:
    """Token ids as little-endian u32 bytes, the encoding fabric.keys hashes."""
    if _LITTLE_ENDIAN:
        return tokens.tobytes()
    swapped = array("I", tokens)  # pragma: no cover - big-endian hosts
    swapped.byteswap()  # pragma: no cover
    return swapped.tobytes()  # pragma: no cover


class BlockState(enum.Enum):
    FREE = "free"
    CACHED = "cached"
    RESERVED = "reserved"
    IN_USE = "in_use"
    SHARED = "shared"


class SeqState:
    """One sequence as the block manager sees it.

    `token_ids` holds every token whose KV the sequence needs (prompt and generated so far);
    append the next token, then call `may_append`. `block_table[i]` is the device block of
    tokens [i*block_size, (i+1)*block_size). `num_cached_tokens` is the prefix `allocate`
    found cached: the engine can skip prefill for those. `request_id` ties the sequence to a
    reservation; `namespace` overrides the manager's (e.g. another tenant salt, same KV shape).
    """

    __slots__ = ("block_table", "namespace", "num_cached_tokens", "request_id", "seq_id", "token_ids")

    def __init__(self, seq_id: int, token_ids: Iterable[int], *, request_id: RequestId | None = None,
                 namespace: Namespace | None = None) -> None:
        try:
            tokens = array("I", token_ids)
        except OverflowError:
            raise ValueError("token ids must lie in [0, 2**32)") from None
        self.seq_id = seq_id
        self.token_ids: array[int] = tokens
        self.block_table: list[int] = []
        self.num_cached_tokens = 0
        self.request_id = request_id
        self.namespace = namespace

    def __len__(self) -> int:
        return len(self.token_ids)

    def append_token(self, token_id: int) -> None:
        try:
            self.token_ids.append(token_id)
        except OverflowError:
            raise ValueError(f"token id {token_id} does not fit in a u32") from None


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """Latency of one kind of operation: totals since start, percentiles over the recent window."""

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


@dataclass(frozen=True, slots=True)
class BlockManagerStats:
    num_blocks: int
    num_available: int  # in the free queue (FREE + CACHED): what an unreserved request can take
    num_cached: int  # free blocks that still serve a hash
    num_in_use: int  # ref > 0 (IN_USE + SHARED)
    num_reserved: int
    num_registered_hashes: int
    num_queried_blocks: int  # full blocks looked up by allocate
    num_hit_blocks: int
    num_evicted: int
    alloc_latency: LatencyStats
    release_latency: LatencyStats

    @property
    def utilisation(self) -> float:
        """Fraction of blocks a new unreserved request cannot take."""
        return (self.num_in_use + self.num_reserved) / self.num_blocks if self.num_blocks else 0.0

    @property
    def hit_ratio(self) -> float:
        return self.num_hit_blocks / self.num_queried_blocks if self.num_queried_blocks else 0.0


class BlockManager:
    """Ref-counted pool of `num_blocks` KV blocks of `namespace.block_size` tokens each."""

    def __init__(self, namespace: Namespace, num_blocks: int, *, latency_window: int = 1024,
                 chain_hash_fn: ChainHashFn = chain_hash) -> None:
        """`chain_hash_fn` exists for experiments; anything but the default makes hashes no peer shares."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self._ns = namespace
        self._block_size = namespace.block_size
        self._num_blocks = num_blocks
        self._chain = chain_hash_fn
        self._free = FreeBlockQueue(num_blocks)
        self._ref = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._tokens: list[bytes | None] = [None] * num_blocks
        self._hash_to_block: dict[BlockHash, int] = {}
        self._reserved: dict[RequestId, list[int]] = {}
        self._num_in_use = 0
        self._num_reserved = 0
        self._num_cached = 0
        self._num_queried = 0
        self._num_hits = 0
        self._num_evicted = 0
        self._events: list[BlockEvent] = []
        self._alloc_latency = LatencyRecorder(latency_window)
        self._release_latency = LatencyRecorder(latency_window)

    # ------------------------------------------------------------------ queries
    @property
    def namespace(self) -> Namespace:
        return self._ns

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def num_reserved_for(self, request_id: RequestId) -> int:
        return len(self._reserved.get(request_id, ()))

    def block_state(self, block_id: int) -> BlockState:
        r = self._ref[block_id]
        if r > 1:
            return BlockState.SHARED
        if r == 1:
            return BlockState.IN_USE
        if block_id in self._free:
            return BlockState.CACHED if self._is_registered(block_id) else BlockState.FREE
        return BlockState.RESERVED

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        """The hash of the full block `block_id` holds (in use or cached), else None."""
        if self._ref[block_id] > 0 or self._is_registered(block_id):
            return self._hash[block_id]
        return None

    def seq_block_hashes(self, seq: SeqState) -> list[BlockHash]:
        """Hashes of the sequence's full blocks, in order (what a store writes them under).

        A block filled by tokens that `may_append` has not seen yet has no hash so far; the list
        stops before it.
        """
        num_full = len(seq.token_ids) // self._block_size
        out: list[BlockHash] = []
        for b in seq.block_table[:num_full]:
            h = self._hash[b]
            if h is None:
                break
            out.append(h)
        return out

    def free_block_ids(self) -> list[int]:
        """Free block ids in reuse order (head first). O(num free)."""
        return list(self._free)

    def match_prefix(self, token_ids: Iterable[int], namespace: Namespace | None = None) -> int:
        """Tokens of the longest prefix whose full blocks are cached here (verified); no state change."""
        seq = SeqState(-1, token_ids, namespace=namespace)
        parent = self._root_for(seq)
        data = _le_bytes(seq.token_ids)
        stride = 4 * self._block_size
        h2b, tokens, chain = self._hash_to_block, self._tokens, self._chain
        num_full = len(seq.token_ids) // self._block_size
        for i in range(num_full):
            chunk = data[i * stride:(i + 1) * stride]
            parent = chain(parent, chunk)
            b = h2b.get(parent, -1)
            if b < 0 or tokens[b] != chunk:
                return i * self._block_size
        return num_full * self._block_size

    def _is_registered(self, block_id: int) -> bool:
        h = self._hash[block_id]
        return h is not None and self._hash_to_block.get(h) == block_id

    def _root_for(self, seq: SeqState) -> BlockHash:
        ns = seq.namespace
        if ns is None or ns is self._ns:
            return self._ns.root
        if ns.block_size != self._block_size or ns.layout != self._ns.layout:
            raise ValueError(f"sequence {seq.seq_id}: namespace {ns.model_id!r} has another block size "
                             f"or KV layout than this pool")
        return ns.root

    # ------------------------------------------------------------------ allocation
    def _capacity_for(self, seq: SeqState) -> int:
        rid = seq.request_id
        own = len(self._reserved.get(rid, ())) if rid is not None else 0
        return len(self._free) + own

    def num_blocks_needed(self, seq: SeqState) -> int:
        return -(-len(seq.token_ids) // self._block_size)

    def can_allocate(self, seq: SeqState) -> bool:
        """True when `allocate(seq)` will succeed (counts every block, as if nothing were cached)."""
        return self.num_blocks_needed(seq) <= self._capacity_for(seq)

    def allocate(self, seq: SeqState) -> bool:
        """Give `seq` a block table, reusing its longest verified cached prefix.

        Sets `seq.num_cached_tokens`. Fresh blocks come from the request's reservation first,
        then from the head of the free queue. Returns False, changing nothing, when out of blocks.
        """
        start = perf_counter_ns()
        table = seq.block_table
        if table:
            raise ValueError(f"sequence {seq.seq_id} is already allocated")
        bs = self._block_size
        num_tokens = len(seq.token_ids)
        num_needed = -(-num_tokens // bs)
        rid = seq.request_id
        reserved = self._reserved.get(rid) if rid is not None else None
        parent = self._root_for(seq)
        if num_needed > len(self._free) + (len(reserved) if reserved else 0):
            return False
        data = _le_bytes(seq.token_ids)
        stride = 4 * bs
        num_full = num_tokens // bs
        chain, h2b, tokens, ref, free = self._chain, self._hash_to_block, self._tokens, self._ref, self._free

        # 1) Longest prefix of full blocks whose hash is registered and whose tokens match.
        revived = 0
        i = 0
        h = parent
        chunk = b""
        while i < num_full:
            chunk = data[i * stride:i * stride + stride]
            h = chain(parent, chunk)
            b = h2b.get(h, -1)
            if b < 0 or tokens[b] != chunk:
                break
            r = ref[b]
            if r == 0:  # a cached free block: take it out of the middle of the LRU queue
                free.remove(b)
                revived += 1
            ref[b] = r + 1
            table.append(b)
            parent = h
            i += 1
        num_hits = i
        self._num_cached -= revived
        self._num_in_use += revived
        self._num_queried += num_full
        self._num_hits += num_hits
        seq.num_cached_tokens = num_hits * bs

        # 2) Every later block is fresh (the engine recomputes from the first miss on).
        if i < num_needed:
            evicted: list[BlockHash] = []
            stored = _StoredRuns(parent)
            had_reserved = len(reserved) if reserved else 0
            while i < num_needed:
                b = reserved.pop() if reserved else self._pop_free(evicted)
                ref[b] = 1
                table.append(b)
                if i < num_full:
                    if i > num_hits:  # block num_hits was already hashed by the lookup loop
                        chunk = data[i * stride:i * stride + stride]
                        h = chain(parent, chunk)
                    self._register(b, h, chunk, stored)
                    parent = h
                i += 1
            if had_reserved:
                self._num_reserved -= had_reserved - len(reserved or ())
            self._num_in_use += num_needed - num_hits
            self._emit(evicted, stored)
        self._alloc_latency.record(perf_counter_ns() - start)
        return True

    def can_append(self, seq: SeqState) -> bool:
        """True when `may_append(seq)` will succeed for the tokens `seq` holds now."""
        need = -(-len(seq.token_ids) // self._block_size) - len(seq.block_table)
        return need <= 0 or need <= self._capacity_for(seq)

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
            start = perf_counter_ns()
            rid = seq.request_id
            reserved = self._reserved.get(rid) if rid is not None else None
            if need > len(self._free) + (len(reserved) if reserved else 0):
                return False
            evicted: list[BlockHash] = []
            ref = self._ref
            for _ in range(need):
                if reserved:
                    b = reserved.pop()
                    self._num_reserved -= 1
                else:
                    b = self._pop_free(evicted)
                ref[b] = 1
                table.append(b)
            self._num_in_use += need
            if evicted:
                self._emit(evicted, None)
            self._alloc_latency.record(perf_counter_ns() - start)
        num_full = num_tokens // bs
        if num_full and self._hash[table[num_full - 1]] is None:
            self._hash_new_full_blocks(seq, num_full)
        return True

    def _hash_new_full_blocks(self, seq: SeqState, num_full: int) -> None:
        table, hashes, bs = seq.block_table, self._hash, self._block_size
        first = num_full - 1
        while first > 0 and hashes[table[first - 1]] is None:
            first -= 1
        parent = hashes[table[first - 1]] if first else self._root_for(seq)
        if parent is None:
            raise RuntimeError(f"block {table[first - 1]} of sequence {seq.seq_id} lost its hash")
        data = _le_bytes(seq.token_ids[first * bs:num_full * bs])
        stride = 4 * bs
        stored = _StoredRuns(parent)
        for k in range(num_full - first):
            chunk = data[k * stride:(k + 1) * stride]
            parent = self._chain(parent, chunk)
            self._register(table[first + k], parent, chunk, stored)
        self._emit(None, stored)

    def deallocate(self, seq: SeqState) -> None:
        """Drop the sequence's references, last block first; freed blocks keep their hashes."""
        start = perf_counter_ns()
        table = seq.block_table
        ref, free, hashes, h2b = self._ref, self._free, self._hash, self._hash_to_block
        num_freed = num_cached = 0
        # Reverse order: a prompt's tail blocks sit nearer the head of the LRU queue, so they are
        # evicted before its head blocks, which more requests share.
        for b in reversed(table):
            r = ref[b] - 1
            if r < 0:
                raise RuntimeError(f"block {b} of sequence {seq.seq_id} has no reference left to drop")
            ref[b] = r
            if r == 0:
                free.append(b)
                num_freed += 1
                h = hashes[b]
                if h is not None and h2b.get(h) == b:
                    num_cached += 1
        self._num_in_use -= num_freed
        self._num_cached += num_cached
        table.clear()
        seq.num_cached_tokens = 0
        self._release_latency.record(perf_counter_ns() - start)

    # ------------------------------------------------------------------ reservations
    def reserve(self, request_id: RequestId, num_blocks: int) -> bool:
        """Set `num_blocks` free blocks aside for `request_id` (added to any it already holds).

        Only allocations of sequences with this request id can take them. Their cached hashes are
        dropped now (evicted). Returns False, changing nothing, when fewer blocks are free.
        """
        if num_blocks < 0:
            raise ValueError(f"cannot reserve a negative number of blocks ({num_blocks})")
        if num_blocks > len(self._free):
            return False
        start = perf_counter_ns()
        evicted: list[BlockHash] = []
        blocks = self._reserved.setdefault(request_id, [])
        for _ in range(num_blocks):
            blocks.append(self._pop_free(evicted))
        self._num_reserved += num_blocks
        if evicted:
            self._emit(evicted, None)
        self._alloc_latency.record(perf_counter_ns() - start)
        return True

    def release(self, request_id: RequestId) -> int:
        """Return the request's unused reserved blocks to the head of the free queue; how many."""
        blocks = self._reserved.pop(request_id, None)
        if not blocks:
            return 0
        start = perf_counter_ns()
        free = self._free
        # They hold no KV worth keeping, so they are reused before any cached block.
        for b in reversed(blocks):
            free.appendleft(b)
        self._num_reserved -= len(blocks)
        self._release_latency.record(perf_counter_ns() - start)
        return len(blocks)

    # ------------------------------------------------------------------ internals
    def _pop_free(self, evicted: list[BlockHash]) -> int:
        """Take the least recently freed block for new content, dropping the hash it served."""
        b = self._free.popleft()
        if b == EMPTY:
            raise RuntimeError("free queue is empty although capacity was checked")
        h = self._hash[b]
        if h is not None:
            h2b = self._hash_to_block
            if h2b.get(h) == b:
                del h2b[h]
                evicted.append(h)
                self._num_cached -= 1
            self._hash[b] = None
            self._tokens[b] = None
        return b

    def _register(self, block_id: int, h: BlockHash, chunk: bytes, stored: _StoredRuns) -> None:
        """Record that in-use `block_id` holds the full block `chunk` with hash `h`."""
        self._hash[block_id] = h
        self._tokens[block_id] = chunk
        h2b = self._hash_to_block
        old = h2b.get(h)
        h2b[h] = block_id
        if old is None:
            stored.add(h, block_id)
            return
        # Another block already served `h` (its prefix was evicted before it, or a hash collision):
        # the newest copy serves it from now on; the hash stays served, so no event.
        stored.skip(h)
        if self._ref[old] == 0:
            self._num_cached -= 1  # the old copy is free and no longer hit-able

    def _emit(self, evicted: list[BlockHash] | None, stored: _StoredRuns | None) -> None:
        # Evictions first: a hash evicted and stored again in one call ends up stored.
        if evicted:
            self._events.append(BlockEvicted(tuple(evicted)))
            self._num_evicted += len(evicted)
        if stored is not None:
            stored.flush(self._events)

    # ------------------------------------------------------------------ events, stats
    def take_events(self) -> list[BlockEvent]:
        """Events since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def stats(self) -> BlockManagerStats:
        return BlockManagerStats(
            num_blocks=self._num_blocks,
            num_available=len(self._free),
            num_cached=self._num_cached,
            num_in_use=self._num_in_use,
            num_reserved=self._num_reserved,
            num_registered_hashes=len(self._hash_to_block),
            num_queried_blocks=self._num_queried,
            num_hit_blocks=self._num_hits,
            num_evicted=self._num_evicted,
            alloc_latency=self._alloc_latency.stats(),
            release_latency=self._release_latency.stats(),
        )

    def check(self) -> None:
        """Verify the pool's internal invariants; raises RuntimeError naming the broken one. O(n)."""
        self._free.check()
        reserved = [b for blocks in self._reserved.values() for b in blocks]
        in_use = sum(1 for r in self._ref if r > 0)
        if len(set(reserved)) != len(reserved) or len(reserved) != self._num_reserved:
            raise RuntimeError(f"reservations hold {len(reserved)} ids, counter says {self._num_reserved}")
        if in_use != self._num_in_use:
            raise RuntimeError(f"{in_use} blocks have references, counter says {self._num_in_use}")
        for b in reserved:
            if b in self._free or self._ref[b] or self._hash[b] is not None:
                raise RuntimeError(f"reserved block {b} is also free, referenced or hashed")
        for b in self._free:
            if self._ref[b]:
                raise RuntimeError(f"free block {b} has {self._ref[b]} references")
        if len(self._free) + len(reserved) + in_use != self._num_blocks:
            raise RuntimeError("free + reserved + in use does not add up to num_blocks")
        for h, b in self._hash_to_block.items():
            if self._hash[b] != h:
                raise RuntimeError(f"hash {h.hex()[:16]} is registered to block {b} that holds another")
        cached = sum(1 for b in self._free if self._is_registered(b))
        if cached != self._num_cached:
            raise RuntimeError(f"{cached} free blocks serve a hash, counter says {self._num_cached}")


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
