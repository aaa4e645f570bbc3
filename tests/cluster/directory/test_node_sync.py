"""DirectorySync: the order, numbering and bounds of what a node tells the directory (pure)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from cluster.directory.report import Apply, BeginResync, Body, EndResync, Report, ResyncBatch
from cluster.directory.shard import DirectoryShard
from cluster.directory.sync import Batch, DirectorySync
from cluster.directory.types import ApplyOutcome, NodeAddress

ADDR = NodeAddress("127.0.0.1", 1, "tls-tcp")


def submit(shard: DirectoryShard, incarnation: int, body: Body) -> ApplyOutcome:
    return shard.submit(Report(shard.shard, "n", incarnation, body), 0.0)


def send(shard: DirectoryShard, incarnation: int, batch: Batch) -> ApplyOutcome:
    return submit(shard, incarnation, Apply(batch.seq, batch.stored, batch.removed, ADDR, batch.versions))


def resync(shard: DirectoryShard, incarnation: int, seq: int, snapshot: Sequence[bytes]) -> bool:
    """A node's resync as DirectoryUpkeep sends it (named by the seq it ends at); whether it ended."""
    return all(submit(shard, incarnation, body) is ApplyOutcome.ACCEPTED
               for body in (BeginResync(seq, ADDR), ResyncBatch(seq, snapshot), EndResync(seq, seq)))


def h(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def test_last_operation_per_hash_wins_within_a_batch() -> None:
    sync = DirectorySync(1, flush_s=0.005, flush_blocks=100, queue_max=1000)
    sync.record([(h(1), True), (h(2), True), (h(1), False)], now=0.0)
    assert not sync.due(0, now=0.001)
    assert sync.due(0, now=0.01)
    batch = sync.take_batch(0)
    assert (batch.seq, batch.stored, batch.removed) == (1, (h(2),), (h(1),))


def test_a_batch_leaves_by_count_before_its_time() -> None:
    sync = DirectorySync(1, flush_s=10.0, flush_blocks=3, queue_max=1000)
    sync.record([(h(i), True) for i in range(3)], now=0.0)
    assert sync.due(0, now=0.0)


def test_batches_of_a_shard_go_one_at_a_time_in_seq_order() -> None:
    sync = DirectorySync(1, flush_s=0.0, flush_blocks=1, queue_max=1000)
    sync.record([(h(1), True)], now=0.0)
    first = sync.take_batch(0)
    sync.record([(h(2), True)], now=0.0)
    assert not sync.due(0, now=1.0)          # the first is still in flight
    sync.answered(first, ApplyOutcome.ACCEPTED)
    assert sync.take_batch(0).seq == 2


def test_overflow_never_drops_silently_it_forces_a_resync() -> None:
    sync = DirectorySync(1, flush_s=1.0, flush_blocks=10_000, queue_max=5)
    sync.record([(h(i), True) for i in range(6)], now=0.0)
    assert sync.num_overflows == 1 and sync.resync_wanted(0) and sync.pending() == 0


def test_a_gap_or_a_failed_call_forces_a_resync() -> None:
    for outcome in (ApplyOutcome.GAP, None):
        sync = DirectorySync(1, flush_s=0.0, flush_blocks=1, queue_max=100)
        sync.record([(h(1), True)], now=0.0)
        sync.answered(sync.take_batch(0), outcome)
        assert sync.resync_wanted(0)


def test_replaying_random_operations_through_a_real_shard_ends_in_the_held_set() -> None:
    """A node's queue, batches, drops (lost calls -> resync from its held set) and a directory restart,
    replayed against a real DirectoryShard: the directory ends listing exactly what the node holds."""
    rng = random.Random(7)
    for trial in range(20):
        sync = DirectorySync(2, flush_s=0.0, flush_blocks=rng.randint(1, 8), queue_max=rng.randint(4, 40))
        shards = [DirectoryShard(k, 2, lease_s=1e9) for k in range(2)]
        held: set[bytes] = set()
        incarnation = 5
        sync.mark_all_resync()
        for _ in range(300):
            ops = []
            for _ in range(rng.randint(0, 6)):
                x = h(rng.randrange(40))
                stored = rng.random() < 0.6
                (held.add if stored else held.discard)(x)
                ops.append((x, stored))
            sync.record(ops, now=0.0)
            if rng.random() < 0.02:   # the directory restarts: empty shard, the node notices a new epoch
                k = rng.randrange(2)
                shards[k] = DirectoryShard(k, 2, lease_s=1e9)
                if not sync.shards[k].resyncing and sync.shards[k].inflight is None:
                    sync.mark_resync(k)
            for k in range(2):
                if sync.resync_wanted(k):
                    seq = sync.start_resync(k)
                    snapshot = sync.group_by_shard(held)[k]
                    sync.finish_resync(k, resync(shards[k], incarnation, seq, snapshot))
                elif sync.due(k, now=1.0):
                    batch = sync.take_batch(k)
                    lost = rng.random() < 0.05
                    outcome = None if lost else send(shards[k], incarnation, batch)
                    sync.answered(batch, outcome)
        for k in range(2):   # drain
            for _ in range(3):
                if sync.resync_wanted(k):
                    seq = sync.start_resync(k)
                    sync.finish_resync(k, resync(shards[k], incarnation, seq, sync.group_by_shard(held)[k]))
                elif sync.due(k, now=2.0, force=True):
                    batch = sync.take_batch(k)
                    sync.answered(batch, send(shards[k], incarnation, batch))
        listed = {x for k in range(2) for x in sync.group_by_shard(h(i) for i in range(40))[k]
                  if shards[k].locate([x], 0.0).owners[0]}
        assert listed == held, f"trial {trial}"


def test_a_batch_answered_conflict_makes_the_node_resync_until_the_map_equals_what_it_holds() -> None:
    shard = DirectoryShard()
    sync = DirectorySync(1, flush_s=0.0, flush_blocks=1, queue_max=1000)
    held = {h(1)}
    sync.record([(h(1), True)], now=0.0)
    first = sync.take_batch(0)
    sync.answered(first, send(shard, 1, first))
    submit(shard, 1, Apply(2, [], [h(1)], ADDR))              # someone else's batch 2 under this node's name
    held.add(h(2))
    sync.record([(h(2), True)], now=0.0)
    second = sync.take_batch(0)
    outcome = send(shard, 1, second)
    assert outcome is ApplyOutcome.CONFLICT
    sync.answered(second, outcome)
    assert sync.resync_wanted(0)
    seq = sync.start_resync(0)
    assert resync(shard, 1, seq, sorted(held))
    sync.finish_resync(0, True)
    assert not sync.resync_wanted(0)
    assert shard.locate([h(1), h(2)], 0.0).owners == (("n",), ("n",))
