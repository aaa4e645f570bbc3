"""What a node tells the directory, and in which order: pure bookkeeping, no Ray, no clock.

The node's Store reports (block, layer) addresses stored and removed; the directory knows block
hashes. A hash is advertised while the node holds any layer of it (the owner re-checks every
layer before it sends, so a partly evicted block is a counted "said yes, had no" — a shorter hit,
never wrong KV), and withdrawn when any of its layers is removed.

Per directory shard this keeps an ordered queue of hash operations, numbered batches and the
resync state:

    ops ──coalesce (last op per hash wins)──► Batch(seq, stored, removed) ──► an Apply report
                                               seq = 1, 2, 3 ... per (incarnation, shard)

Rules:
- Batches of one shard go out one at a time, in seq order; the next waits for the previous answer.
- The queue is bounded (`queue_max` operations). Past it the queue is cleared and the shard is
  marked for resync: the resync sends the full set of held hashes, so nothing is dropped silently.
- A GAP answer (the directory missed a batch, or restarted) or a new epoch also marks a resync.
- A resync takes the next seq for itself; ops queued after its snapshot keep later numbers and are
  sent after it ends, so the directory ends in the state of the last operation.

Each stored hash may carry its block version (fabric.provenance.block_version: a tag of the bytes
and the producer's name); a batch carries them beside its stored hashes, so the directory can tell
owners holding different bytes at one address apart.

Cost: O(1) per operation; a batch is O(hashes in it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from cluster.directory.types import ApplyOutcome, shard_of


@dataclass(frozen=True, slots=True)
class Batch:
    shard: int
    seq: int
    stored: tuple[bytes, ...]
    removed: tuple[bytes, ...]
    versions: tuple[bytes, ...] = ()   # per stored hash, its block version (b"": unknown); () none known


@dataclass(slots=True)
class _ShardState:
    ops: dict[bytes, bool] = field(default_factory=dict)   # hash -> stored? (insertion = last op order)
    versions: dict[bytes, bytes] = field(default_factory=dict)   # stored hash in ops -> its block version
    num_ops: int = 0            # operations since the last batch (before coalescing), bounded
    oldest: float | None = None  # when the oldest queued op arrived
    next_seq: int = 1
    acked_seq: int = 0           # highest seq the directory answered ACCEPTED / DUPLICATE, or a resync ended at
    inflight: Batch | None = None
    needs_resync: bool = False
    resyncing: bool = False
    resync_seq: int = 0


class DirectorySync:
    """Ordered, bounded register/unregister batches for every shard of one node incarnation."""

    def __init__(self, num_shards: int, *, flush_s: float, flush_blocks: int, queue_max: int) -> None:
        self.num_shards = num_shards
        self.flush_s = flush_s
        self.flush_blocks = flush_blocks
        self.queue_max = queue_max
        self.shards = [_ShardState() for _ in range(num_shards)]
        self.num_overflows = 0

    # ---- input -------------------------------------------------------------------------------------

    def record(self, ops: Iterable[tuple[bytes, bool]], now: float,
               versions: Mapping[bytes, bytes] | None = None) -> None:
        """Queue hash operations in order: (hash, True) stored, (hash, False) removed; `versions`: the
        block version of stored hashes, where known."""
        for block_hash, stored in ops:
            k = shard_of(block_hash, self.num_shards)
            st = self.shards[k]
            if st.needs_resync:
                continue  # the resync's snapshot will carry the current truth
            st.ops.pop(block_hash, None)  # re-insert: dict order is the order of last operations
            st.ops[block_hash] = stored
            version = versions.get(block_hash) if stored and versions is not None else None
            if version:
                st.versions[block_hash] = version
            else:
                st.versions.pop(block_hash, None)
            st.num_ops += 1
            if st.oldest is None:
                st.oldest = now
            if st.num_ops > self.queue_max:
                self.num_overflows += 1
                self.mark_resync(k)

    def mark_resync(self, shard: int) -> None:
        """Forget the queue of `shard`; it must be rebuilt from a snapshot of what the node holds."""
        st = self.shards[shard]
        st.ops.clear()
        st.versions.clear()
        st.num_ops = 0
        st.oldest = None
        st.needs_resync = True

    def mark_all_resync(self) -> None:
        for k in range(self.num_shards):
            self.mark_resync(k)

    # ---- output ------------------------------------------------------------------------------------

    def due(self, shard: int, now: float, *, force: bool = False) -> bool:
        st = self.shards[shard]
        if st.inflight is not None or st.resyncing or st.needs_resync or not st.ops:
            return False
        assert st.oldest is not None
        return force or len(st.ops) >= self.flush_blocks or now - st.oldest >= self.flush_s

    def take_batch(self, shard: int) -> Batch:
        """The next numbered batch of `shard` (call when `due`); it stays in flight until answered."""
        st = self.shards[shard]
        if st.inflight is not None or st.resyncing:
            raise RuntimeError(f"shard {shard}: a batch or resync is already in flight")
        stored = tuple(h for h, s in st.ops.items() if s)
        removed = tuple(h for h, s in st.ops.items() if not s)
        versions = tuple(st.versions.get(h, b"") for h in stored) if st.versions else ()
        batch = Batch(shard, st.next_seq, stored, removed, versions)
        st.next_seq += 1
        st.ops.clear()
        st.versions.clear()
        st.num_ops = 0
        st.oldest = None
        st.inflight = batch
        return batch

    def answered(self, batch: Batch, outcome: ApplyOutcome | None) -> None:
        """The directory's answer to `batch` (None: the call failed, so its fate is unknown)."""
        st = self.shards[batch.shard]
        if st.inflight != batch:
            raise RuntimeError(f"shard {batch.shard}: answer for batch {batch.seq} that is not in flight")
        st.inflight = None
        if outcome in (ApplyOutcome.ACCEPTED, ApplyOutcome.DUPLICATE):
            st.acked_seq = batch.seq
            return
        # GAP, STALE or unknown: the directory's view of this node can no longer be trusted.
        self.mark_resync(batch.shard)

    def start_resync(self, shard: int) -> int:
        """Begin a resync of `shard`; returns the seq it will end with. The caller then takes a
        snapshot of held hashes *after* this call and sends it."""
        st = self.shards[shard]
        if st.inflight is not None or st.resyncing:
            raise RuntimeError(f"shard {shard}: cannot resync while a batch is in flight")
        st.needs_resync = False
        st.resyncing = True
        st.resync_seq = st.next_seq
        st.next_seq += 1
        return st.resync_seq

    def finish_resync(self, shard: int, ok: bool) -> None:
        st = self.shards[shard]
        if not st.resyncing:
            raise RuntimeError(f"shard {shard}: no resync in progress")
        st.resyncing = False
        if ok:
            st.acked_seq = st.resync_seq
        else:
            self.mark_resync(shard)

    def resync_wanted(self, shard: int) -> bool:
        st = self.shards[shard]
        return st.needs_resync and st.inflight is None and not st.resyncing

    def resyncing(self, shard: int) -> bool:
        """A resync of `shard` has begun and not yet finished."""
        return self.shards[shard].resyncing

    def acked_seq(self, shard: int) -> int:
        """For heartbeats: the shard answers GAP if it holds less than this (its record lapsed)."""
        return self.shards[shard].acked_seq

    def pending(self) -> int:
        return sum(len(st.ops) for st in self.shards)

    def group_by_shard(self, hashes: Iterable[bytes]) -> dict[int, list[bytes]]:
        out: dict[int, list[bytes]] = {k: [] for k in range(self.num_shards)}
        for h in hashes:
            out[shard_of(h, self.num_shards)].append(h)
        return out
