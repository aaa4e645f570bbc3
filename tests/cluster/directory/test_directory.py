"""Unit tests of cluster/directory/shard.py: one test per consistency rule (the state machine covers interleavings)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from cluster.directory.report import Apply, BeginResync, EndResync, Heartbeat, Report, ResyncBatch
from cluster.directory.shard import DirectoryShard
from cluster.directory.types import ApplyOutcome, NodeAddress, shard_of

ADDR = NodeAddress("127.0.0.1", 7000, "tls-tcp")
ADDR2 = NodeAddress("127.0.0.1", 7001, "quic")
H = [bytes([i]) * 32 for i in range(10)]
A, B, C = "node-a", "node-b", "node-c"


def apply(d: DirectoryShard, node: str, inc: int, seq: int, stored: Sequence[bytes], removed: Sequence[bytes],
          now: float, address: NodeAddress | None = None, versions: Sequence[object] = ()) -> ApplyOutcome:
    return d.submit(Report(d.shard, node, inc, Apply(seq, stored, removed, address, versions)), now)  # type: ignore[arg-type]


def heartbeat(d: DirectoryShard, node: str, inc: int, address: NodeAddress, now: float,
              acked_seq: int | None = None) -> ApplyOutcome:
    return d.submit(Report(d.shard, node, inc, Heartbeat(address, acked_seq)), now)


def begin_resync(d: DirectoryShard, node: str, inc: int, rid: int, address: NodeAddress, now: float) -> ApplyOutcome:
    return d.submit(Report(d.shard, node, inc, BeginResync(rid, address)), now)


def resync_batch(d: DirectoryShard, node: str, inc: int, rid: int, hashes: Sequence[bytes], now: float
                 ) -> ApplyOutcome:
    return d.submit(Report(d.shard, node, inc, ResyncBatch(rid, hashes)), now)


def end_resync(d: DirectoryShard, node: str, inc: int, rid: int, seq: int, now: float) -> ApplyOutcome:
    return d.submit(Report(d.shard, node, inc, EndResync(rid, seq)), now)


def owners(shard: DirectoryShard, hashes: list[bytes], now: float = 0.0) -> list[tuple[str, ...]]:
    return list(shard.locate(hashes, now).owners)


def test_in_order_batches_are_applied_duplicates_ignored_gaps_apply_nothing() -> None:
    d = DirectoryShard()
    assert apply(d, A, 1, 1, H[:3], [], 0.0, ADDR) is ApplyOutcome.ACCEPTED
    assert apply(d, A, 1, 2, [H[3]], [H[0]], 0.0) is ApplyOutcome.ACCEPTED
    assert owners(d, H[:4]) == [(), (A,), (A,), (A,)]
    assert apply(d, A, 1, 2, [H[3]], [H[0]], 0.0) is ApplyOutcome.DUPLICATE      # a retry of batch 2
    assert apply(d, A, 1, 4, [H[6]], [H[2]], 0.0) is ApplyOutcome.GAP            # batch 3 was lost
    assert owners(d, H[:7]) == [(), (A,), (A,), (A,), (), (), ()]
    assert d.nodes(0.0)[0].last_seq == 2
    s = d.stats(0.0)
    assert (s["applied"], s["duplicate"], s["gap"], s["num_entries"]) == (2, 1, 1, 3)


def test_a_used_seq_with_other_content_is_refused_as_a_conflict_and_a_resync_restores_the_map() -> None:
    d = DirectoryShard()
    x, y = H[0], H[1]
    assert apply(d, A, 5, 1, [x], [], 0.0, ADDR) is ApplyOutcome.ACCEPTED
    assert apply(d, A, 5, 2, [], [x], 0.0, ADDR) is ApplyOutcome.ACCEPTED     # not what A sent under seq 2
    assert apply(d, A, 5, 2, [y], [], 0.0, ADDR) is ApplyOutcome.CONFLICT     # A's real batch 2
    assert d.stats(0.0)["conflict"] == 1
    assert begin_resync(d, A, 5, 3, ADDR, 0.0) is ApplyOutcome.ACCEPTED        # what A does on CONFLICT
    assert resync_batch(d, A, 5, 3, [x, y], 0.0) is ApplyOutcome.ACCEPTED
    assert end_resync(d, A, 5, 3, 3, 0.0) is ApplyOutcome.ACCEPTED
    assert owners(d, [x, y]) == [(A,), (A,)]


def test_unknown_node_must_start_at_seq_1() -> None:
    d = DirectoryShard()   # e.g. a restarted directory: the node still counts from where it was
    assert apply(d, A, 1, 57, [H[0]], [], 0.0, ADDR) is ApplyOutcome.GAP
    assert owners(d, [H[0]]) == [()]
    assert d.nodes(0.0) == []
    with pytest.raises(ValueError, match="start at 1"):
        apply(d, A, 1, 0, [H[0]], [], 0.0, ADDR)


def test_older_incarnation_is_stale_newer_replaces_all_entries() -> None:
    d = DirectoryShard()
    apply(d, A, 2, 1, H[:3], [], 0.0, ADDR)
    assert apply(d, A, 1, 2, [H[4]], [], 0.0) is ApplyOutcome.STALE
    assert apply(d, A, 3, 5, [H[4]], [], 0.0) is ApplyOutcome.GAP        # a new incarnation starts at 1
    assert owners(d, H[:5]) == [(A,), (A,), (A,), (), ()]
    assert apply(d, A, 3, 1, [H[4]], [], 0.0) is ApplyOutcome.ACCEPTED
    assert owners(d, H[:5]) == [(), (), (), (), (A,)]
    info = d.nodes(0.0)[0]
    assert (info.incarnation, info.last_seq, info.num_blocks) == (3, 1, 1)
    assert heartbeat(d, A, 2, ADDR, 0.0) is ApplyOutcome.STALE


def test_heartbeat_of_newer_incarnation_drops_entries_and_resets_seq() -> None:
    d = DirectoryShard()
    apply(d, A, 1, 1, H[:2], [], 0.0, ADDR)
    apply(d, A, 1, 2, H[2:4], [], 0.0)
    assert heartbeat(d, A, 2, ADDR2, 1.0) is ApplyOutcome.ACCEPTED
    assert owners(d, H[:4], 1.0) == [(), (), (), ()]
    info = d.nodes(1.0)[0]
    assert (info.incarnation, info.last_seq, info.address) == (2, 0, ADDR2)
    assert apply(d, A, 2, 1, [H[0]], [], 1.0) is ApplyOutcome.ACCEPTED


def test_heartbeat_with_acked_seq_reports_a_directory_that_lost_state() -> None:
    d = DirectoryShard()
    apply(d, A, 1, 1, [H[0]], [], 0.0, ADDR)
    assert heartbeat(d, A, 1, ADDR, 0.0, acked_seq=1) is ApplyOutcome.ACCEPTED
    restarted = DirectoryShard()
    assert heartbeat(restarted, A, 1, ADDR, 0.0, acked_seq=1) is ApplyOutcome.GAP
    assert restarted.nodes(0.0)[0].node_id == A       # the lease is renewed all the same


def test_expired_node_is_never_returned_and_comes_back_empty() -> None:
    d = DirectoryShard(lease_s=5.0)
    apply(d, A, 1, 1, [H[0]], [], 0.0, ADDR)
    apply(d, B, 1, 1, [H[0]], [], 3.0, ADDR)
    assert owners(d, [H[0]], 4.9) == [(A, B)]
    assert owners(d, [H[0]], 5.0) == [(B,)]             # before expire() is called
    assert [n.node_id for n in d.nodes(5.0)] == [B]
    assert d.expire(6.0) == [A]
    assert d.stats(6.0)["num_entries"] == 1
    assert apply(d, A, 1, 2, [H[1]], [], 6.0) is ApplyOutcome.GAP   # the record is gone: resync
    assert heartbeat(d, A, 1, ADDR, 6.0, acked_seq=1) is ApplyOutcome.GAP


def test_lease_is_renewed_by_accepted_batches_and_heartbeats_only() -> None:
    d = DirectoryShard(lease_s=5.0)
    apply(d, A, 1, 1, [H[0]], [], 0.0, ADDR)
    apply(d, A, 1, 1, [H[0]], [], 4.0)                    # a duplicate renews nothing
    assert owners(d, [H[0]], 5.0) == [()]
    d2 = DirectoryShard(lease_s=5.0)
    apply(d2, A, 1, 1, [H[0]], [], 0.0, ADDR)
    heartbeat(d2, A, 1, ADDR, 4.0)
    assert owners(d2, [H[0]], 8.9) == [(A,)]


def test_a_node_is_located_only_once_it_has_an_address() -> None:
    d = DirectoryShard()
    apply(d, A, 1, 1, [H[0]], [], 0.0)
    assert owners(d, [H[0]]) == [()]
    assert d.nodes(0.0) == []
    heartbeat(d, A, 1, ADDR2, 0.0)
    assert owners(d, [H[0]]) == [(A,)]
    assert d.locate([H[0]], 0.0).addresses == {A: ADDR2}


def test_resync_replaces_entries_atomically_at_the_end() -> None:
    d = DirectoryShard()
    apply(d, A, 1, 1, H[:3], [], 0.0, ADDR)
    rid = 9
    assert begin_resync(d, A, 1, rid, ADDR, 1.0) is ApplyOutcome.ACCEPTED
    assert resync_batch(d, A, 1, rid, [H[2], H[3]], 1.0) is ApplyOutcome.ACCEPTED
    assert resync_batch(d, A, 1, rid, [H[4]], 1.0) is ApplyOutcome.ACCEPTED
    assert owners(d, H[:5], 1.0) == [(A,), (A,), (A,), (), ()]    # old entries until the end
    assert end_resync(d, A, 1, rid, 9, 1.0) is ApplyOutcome.ACCEPTED
    assert owners(d, H[:5], 1.0) == [(), (), (A,), (A,), (A,)]
    assert d.nodes(1.0)[0].last_seq == 9
    assert apply(d, A, 1, 10, [H[5]], [], 1.0) is ApplyOutcome.ACCEPTED
    assert resync_batch(d, A, 1, rid, [H[6]], 1.0) is ApplyOutcome.GAP     # finished: unknown now


def test_resync_of_a_newer_incarnation_keeps_old_entries_until_the_end_and_stales_the_old_one() -> None:
    d = DirectoryShard()
    apply(d, A, 1, 1, H[:2], [], 0.0, ADDR)
    rid = 1
    assert begin_resync(d, A, 2, rid, ADDR2, 1.0) is ApplyOutcome.ACCEPTED
    assert apply(d, A, 1, 2, [H[5]], [], 1.0) is ApplyOutcome.STALE   # the old process's last words
    assert heartbeat(d, A, 2, ADDR2, 1.0) is ApplyOutcome.ACCEPTED    # the new one's heartbeat
    assert resync_batch(d, A, 2, rid, [H[1], H[2]], 1.0) is ApplyOutcome.ACCEPTED
    assert owners(d, H[:3], 1.0) == [(A,), (A,), ()]
    assert end_resync(d, A, 2, rid, 0, 1.0) is ApplyOutcome.ACCEPTED
    assert owners(d, H[:3], 1.0) == [(), (A,), (A,)]
    info = d.nodes(1.0)[0]
    assert (info.incarnation, info.last_seq, info.address) == (2, 0, ADDR2)
    assert begin_resync(d, A, 1, 2, ADDR, 1.0) is ApplyOutcome.STALE          # older incarnation: refused


def test_superseded_or_outdated_resync_is_refused() -> None:
    d = DirectoryShard()
    apply(d, A, 1, 1, [H[0]], [], 0.0, ADDR)
    first, second = 1, 2
    assert begin_resync(d, A, 1, first, ADDR, 0.0) is ApplyOutcome.ACCEPTED
    assert begin_resync(d, A, 1, second, ADDR, 0.0) is ApplyOutcome.ACCEPTED
    assert resync_batch(d, A, 1, first, [H[1]], 0.0) is ApplyOutcome.GAP
    assert end_resync(d, A, 1, first, 1, 0.0) is ApplyOutcome.GAP
    assert resync_batch(d, A, 2, second, [H[1]], 0.0) is ApplyOutcome.GAP     # wrong incarnation
    apply(d, A, 1, 2, [H[3]], [], 0.0)                                 # accepted during the resync ...
    assert resync_batch(d, A, 1, second, [H[1]], 0.0) is ApplyOutcome.ACCEPTED
    assert end_resync(d, A, 1, second, 1, 0.0) is ApplyOutcome.STALE   # ... so a snapshot at seq 1 is too old
    assert owners(d, [H[0], H[1], H[3]]) == [(A,), (), (A,)]
    assert heartbeat(d, A, 3, ADDR, 0.0) is ApplyOutcome.ACCEPTED
    third = 1
    assert begin_resync(d, A, 3, third, ADDR, 0.0) is ApplyOutcome.ACCEPTED
    assert apply(d, A, 4, 1, [], [], 0.0) is ApplyOutcome.ACCEPTED     # a newer incarnation cancels it
    assert end_resync(d, A, 3, third, 0, 0.0) is ApplyOutcome.GAP


def test_locate_orders_owners_by_node_id_excludes_and_reports_leading_runs() -> None:
    d = DirectoryShard()
    apply(d, C, 1, 1, H[:5], [], 0.0, ADDR)
    apply(d, A, 1, 1, [*H[:2], H[3]], [], 0.0, ADDR)
    apply(d, B, 1, 1, H[1:4], [], 0.0, ADDR)
    reply = d.locate(H[:6], 0.0)
    assert reply.owners == ((A, C), (A, B, C), (B, C), (A, B, C), (C,), ())
    assert reply.runs == {A: 2, C: 5}          # B lacks block 0: no leading run
    assert reply.addresses == {A: ADDR, B: ADDR, C: ADDR}
    reply = d.locate(H[:6], 0.0, exclude=[C, "never-seen"])
    assert set(reply.addresses) == {A, B}
    assert reply.owners == ((A,), (A, B), (B,), (A, B), (), ())
    assert reply.runs == {A: 2}
    assert d.locate([], 0.0).runs == {}


def test_removing_owners_shrinks_shared_entries() -> None:
    d = DirectoryShard()
    for i, n in enumerate([C, A, B]):
        apply(d, n, 1, 1, [H[0]], [], 0.0, ADDR)
        assert len(owners(d, [H[0]])[0]) == i + 1
    apply(d, A, 1, 2, [], [H[0], H[9]], 0.0)                    # removing what it never had is harmless
    assert owners(d, [H[0]]) == [(B, C)]
    apply(d, C, 1, 2, [], [H[0]], 0.0)
    apply(d, B, 1, 2, [], [H[0]], 0.0)
    assert owners(d, [H[0]]) == [()]
    assert (d.stats(0.0)["num_entries"], d.stats(0.0)["num_hashes"]) == (0, 0)


def test_shards_split_by_hash_bytes() -> None:
    h = bytes(range(32))
    assert shard_of(h, 4) == int.from_bytes(h[:8], "little") % 4 == 0
    assert shard_of(b"\x03" + bytes(31), 4) == 3
    d = DirectoryShard(3, 4)
    assert d.owns(b"\x03" + bytes(31)) and not d.owns(h)
    with pytest.raises(ValueError, match="belongs to shard 0"):
        apply(d, A, 1, 1, [h], [], 0.0, ADDR)
    with pytest.raises(ValueError, match="for shard 0 sent to shard 3"):
        d.submit(Report(0, A, 1, Heartbeat(ADDR)), 0.0)
    assert d.nodes(0.0) == []                                   # nothing was applied
    with pytest.raises(ValueError):
        DirectoryShard(4, 4)


def test_stats_report_compact_entries() -> None:
    d = DirectoryShard()
    hashes = [i.to_bytes(32, "little") for i in range(6000)]
    for k in range(30):
        apply(d, f"node-{k:03d}", 1, 1, hashes[k * 200:(k + 1) * 200 + 200], [], 0.0, ADDR)
    s = d.stats(0.0)
    assert s["num_nodes"] == 30 and s["num_entries"] == 30 * 400 - 200 and s["num_hashes"] == 6000
    assert 40 < s["bytes_per_entry"] <= 200


def _version(tag: int, producer: str) -> bytes:
    return bytes([tag]) * 8 + producer.encode()


def test_owners_of_one_address_are_told_apart_by_block_version_first_reported_first() -> None:
    d = DirectoryShard(lease_s=10.0)
    for node in ("a", "b", "m"):
        heartbeat(d, node, 1, ADDR, 0.0)
    apply(d, "b", 1, 1, [H[0], H[1]], [], 0.0, versions=[_version(2, "node-b"), _version(2, "node-b")])
    apply(d, "a", 1, 1, [H[0], H[1]], [], 0.0, versions=[_version(1, "node-a"), b""])
    apply(d, "m", 1, 1, [H[0]], [], 0.0, versions=[_version(2, "node-b")])   # a mirror of b's
    reply = d.locate([H[0], H[1], H[2]], 0.0)
    assert reply.owners[0] == ("a", "b", "m")
    assert reply.versions[0] == (_version(1, "node-a"), _version(2, "node-b"), _version(2, "node-b"))
    assert reply.firsts == (_version(2, "node-b"), _version(2, "node-b"), b"")   # b reported first
    apply(d, "b", 1, 2, [], [H[0]], 1.0)   # b drops it: the mirror's copy of b's version stays first
    assert d.locate([H[0]], 1.0).firsts == (_version(2, "node-b"),)
    apply(d, "m", 1, 2, [], [H[0]], 1.0)
    assert d.locate([H[0]], 1.0).firsts == (_version(1, "node-a"),)
    apply(d, "a", 1, 2, [], [H[0], H[1]], 1.0)
    assert d.locate([H[0]], 1.0).versions == ((),)
    assert DirectoryShard().locate([H[0]], 0.0).versions == ()   # no versions reported: none answered
    apply(d, "a", 1, 3, [H[3]], [], 1.0, versions=[7])   # not bytes: a version unknown, never passed on
    assert d.locate([H[3]], 1.0).owners == (("a",),) and d.locate([H[3]], 1.0).versions == ((),)
