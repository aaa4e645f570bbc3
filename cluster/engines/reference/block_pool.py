"""Block pool: the mechanics under the block manager (free queue, ref counts, hash map, reservations).

It knows block ids, not sequences or requests' tokens: the request layer (`cluster.engines.reference.block_manager`)
decides which blocks a sequence gets and asks the pool to move them. All per-block state lives in
preallocated lists indexed by block id:

    ref[b]           number of block-table entries holding b (0 = free or reserved)
    hashes[b]        chain hash of b's tokens once b holds a full block, else None
    tokens[b]        b's tokens as little-endian u32 bytes (what a hit is verified against)
    hash_to_block    registered hash -> the one block that serves it
    free             FreeBlockQueue (intrusive LRU list) of every block with ref 0 not reserved
    reserved         request id -> block ids set aside for it (their hashes already dropped)

Block states:  FREE (queued, no registered hash)  CACHED (queued, registered: a hit revives it)
               RESERVED (held for a request)  IN_USE (ref 1)  SHARED (ref > 1)

Counts are derived from that state: in use = num_blocks - free - reserved; reserved = the sum of
the reservations. The one count that cannot be read off in O(1), free blocks that still serve a
hash (`num_cached`), is kept by the four primitives that move a registered block into or out of
the free queue (`touch`, `free_refs`, `_pop_free`, `register`) and nowhere else.

Invariants (checked by `check()`)
    - every block is in exactly one of: free queue, some reservation, ref > 0;
    - hash_to_block[h] == b  implies  hashes[b] == h (a registered hash names its block);
    - a reserved block holds no hash; a free block holds no reference;
    - a freed block keeps its hash until its id is handed out again; the least recently freed
      block is handed out first.

Complexity: every primitive is O(1) per block it moves (one O(1) unlink from the free queue, one
dict probe); nothing searches or shifts a list. Not thread-safe: the owner serialises calls.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from cluster.engines.reference.free_queue import EMPTY, FreeBlockQueue
from fabric.keys import BlockHash

RequestId = str


class BlockState(enum.Enum):
    FREE = "free"
    CACHED = "cached"
    RESERVED = "reserved"
    IN_USE = "in_use"
    SHARED = "shared"


class BlockPool:
    """`num_blocks` block ids with ref counts, an LRU free queue, registered hashes and reservations."""

    __slots__ = ("_num_cached", "free", "hash_to_block", "hashes", "num_blocks", "ref", "reserved", "tokens")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.free = FreeBlockQueue(num_blocks)
        self.ref = [0] * num_blocks
        self.hashes: list[BlockHash | None] = [None] * num_blocks
        self.tokens: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[BlockHash, int] = {}
        self.reserved: dict[RequestId, list[int]] = {}
        self._num_cached = 0

    # ------------------------------------------------------------------ derived counts
    @property
    def num_free(self) -> int:
        """Blocks in the free queue (FREE + CACHED): what an unreserved request can take."""
        return len(self.free)

    @property
    def num_cached(self) -> int:
        """Free blocks that still serve a hash (a hit revives them)."""
        return self._num_cached

    @property
    def num_reserved(self) -> int:
        """Blocks set aside for requests. O(number of requests holding a reservation)."""
        return sum(len(blocks) for blocks in self.reserved.values())

    @property
    def num_in_use(self) -> int:
        """Blocks with at least one reference."""
        return self.num_blocks - len(self.free) - self.num_reserved

    def capacity(self, request_id: RequestId | None) -> int:
        """Blocks an allocation for `request_id` can take: the free queue plus its own reservation."""
        own = self.reserved.get(request_id) if request_id is not None else None
        return len(self.free) + (len(own) if own else 0)

    def is_registered(self, block_id: int) -> bool:
        h = self.hashes[block_id]
        return h is not None and self.hash_to_block.get(h) == block_id

    def state(self, block_id: int) -> BlockState:
        r = self.ref[block_id]
        if r > 1:
            return BlockState.SHARED
        if r == 1:
            return BlockState.IN_USE
        if block_id in self.free:
            return BlockState.CACHED if self.is_registered(block_id) else BlockState.FREE
        return BlockState.RESERVED

    # ------------------------------------------------------------------ primitives
    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block (registered blocks found by a hit); revives cached free ones."""
        ref, free = self.ref, self.free
        revived = 0
        for b in block_ids:
            r = ref[b]
            if r == 0:  # a cached free block: out of the middle of the LRU queue in O(1)
                free.remove(b)
                revived += 1
            ref[b] = r + 1
        self._num_cached -= revived

    def take_fresh(self, num: int, request_id: RequestId | None, evicted: list[BlockHash]) -> list[int]:
        """`num` blocks with one reference each, for new content: from the request's reservation
        first, then the head of the free queue (whose dropped hashes are appended to `evicted`).
        The caller has checked `capacity`."""
        own = self.reserved.get(request_id) if request_id is not None else None
        ref = self.ref
        out: list[int] = []
        for _ in range(num):
            b = own.pop() if own else self._pop_free(evicted)
            ref[b] = 1
            out.append(b)
        return out

    def free_refs(self, block_ids: list[int]) -> None:
        """Drop one reference from each block, last first; a block left with none joins the tail of
        the free queue and keeps its hash. Last first: a prompt's tail blocks then sit nearer the head
        of the LRU queue, so they are evicted before its head blocks, which more requests share."""
        ref, free, hashes, h2b = self.ref, self.free, self.hashes, self.hash_to_block
        cached = 0
        for b in reversed(block_ids):
            r = ref[b] - 1
            if r < 0:
                raise RuntimeError(f"block {b} has no reference left to drop")
            ref[b] = r
            if r == 0:
                free.append(b)
                h = hashes[b]
                if h is not None and h2b.get(h) == b:
                    cached += 1
        self._num_cached += cached

    def register(self, block_id: int, h: BlockHash, chunk: bytes) -> bool:
        """Record that in-use `block_id` holds the full block `chunk` with hash `h`; False when another
        block already served `h` (its prefix was evicted before it, or a hash collision): the newest
        copy serves it from now on and the hash stays served."""
        self.hashes[block_id] = h
        self.tokens[block_id] = chunk
        h2b = self.hash_to_block
        old = h2b.get(h)
        h2b[h] = block_id
        if old is None:
            return True
        if self.ref[old] == 0:
            self._num_cached -= 1  # the old copy is free and no longer hit-able
        return False

    def reserve(self, request_id: RequestId, num: int, evicted: list[BlockHash]) -> bool:
        """Set `num` free blocks aside for `request_id`, dropping their hashes (appended to `evicted`).
        False, changing nothing, when fewer are free."""
        if num > len(self.free):
            return False
        blocks = self.reserved.setdefault(request_id, [])
        for _ in range(num):
            blocks.append(self._pop_free(evicted))
        return True

    def release(self, request_id: RequestId) -> int:
        """Return the request's unused reserved blocks to the head of the free queue; how many."""
        blocks = self.reserved.pop(request_id, None)
        if not blocks:
            return 0
        free = self.free
        for b in reversed(blocks):  # they hold no KV worth keeping: reused before any cached block
            free.appendleft(b)
        return len(blocks)

    def _pop_free(self, evicted: list[BlockHash]) -> int:
        """Take the least recently freed block for new content, dropping the hash it served."""
        b = self.free.popleft()
        if b == EMPTY:
            raise RuntimeError("free queue is empty although capacity was checked")
        h = self.hashes[b]
        if h is not None:
            h2b = self.hash_to_block
            if h2b.get(h) == b:
                del h2b[h]
                evicted.append(h)
                self._num_cached -= 1
            self.hashes[b] = None
            self.tokens[b] = None
        return b

    # ------------------------------------------------------------------ invariants
    def check(self) -> None:
        """Verify the invariants above; raises RuntimeError naming the broken one. O(num_blocks)."""
        self.free.check()
        reserved = [b for blocks in self.reserved.values() for b in blocks]
        in_use = sum(1 for r in self.ref if r > 0)
        if len(set(reserved)) != len(reserved):
            raise RuntimeError("a block is reserved twice")
        for b in reserved:
            if b in self.free or self.ref[b] or self.hashes[b] is not None:
                raise RuntimeError(f"reserved block {b} is also free, referenced or hashed")
        for b in self.free:
            if self.ref[b]:
                raise RuntimeError(f"free block {b} has {self.ref[b]} references")
        if len(self.free) + len(reserved) + in_use != self.num_blocks:
            raise RuntimeError("free + reserved + in use does not add up to num_blocks")
        for h, b in self.hash_to_block.items():
            if self.hashes[b] != h:
                raise RuntimeError(f"hash {h.hex()[:16]} is registered to block {b} that holds another")
        cached = sum(1 for b in self.free if self.is_registered(b))
        if cached != self._num_cached:
            raise RuntimeError(f"{cached} free blocks serve a hash, counter says {self._num_cached}")
