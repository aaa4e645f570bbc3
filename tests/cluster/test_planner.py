"""Unit tests of cluster/planner.py: pull plans over the directory's owners per block."""

from __future__ import annotations

import blake3
import pytest

from cluster.planner import PullRun, agreeing_owners, plan_pulls


def test_longest_run_wins_and_the_plan_continues_where_it_ends() -> None:
    # blocks 0..2 local; A owns 3..6, B owns 3..8, C owns 6..10 (the module docstring's picture)
    owners = [[], [], [], ["A", "B"], ["A", "B"], ["A", "B"], ["A", "B", "C"], ["B", "C"], ["B", "C"],
              ["C"], ["C"]]
    assert plan_pulls(owners, 3) == [PullRun("B", 3, 9, ()), PullRun("C", 9, 11, ())]


def test_alternates_own_the_whole_run_and_are_ranked_by_rendezvous() -> None:
    owners = [["A", "B", "C", "D"], ["A", "B", "C", "D"], ["B", "C", "D"], ["B", "C", "D"]]
    hashes = [bytes([i]) * 32 for i in range(4)]
    plan = plan_pulls(owners, 0, hashes=hashes)
    assert len(plan) == 1 and (plan[0].start, plan[0].end) == (0, 4)
    ranked = [plan[0].node_id, *plan[0].alternates]                        # A stops at block 2: no alternate
    assert ranked == sorted("BCD", key=lambda n: blake3.blake3(hashes[0] + n.encode()).digest())
    tied = plan_pulls([["B", "A"], ["A", "B"]], 0, hashes=[b"x" * 32, b"y" * 32])   # equal runs: rendezvous
    assert tied == plan_pulls([["A", "B"], ["B", "A"]], 0, hashes=[b"x" * 32, b"y" * 32])
    assert len(tied) == 1 and {tied[0].node_id, *tied[0].alternates} == {"A", "B"}


def test_plan_stops_at_the_first_block_nobody_owns() -> None:
    owners = [["A"], ["A"], [], ["A"], ["A"]]
    assert plan_pulls(owners, 0) == [PullRun("A", 0, 2, ())]
    assert plan_pulls(owners, 2) == []
    assert plan_pulls(owners, 3) == [PullRun("A", 3, 5, ())]
    assert plan_pulls(owners, 9) == []
    assert plan_pulls([], 0) == []


def test_runs_cover_the_prefix_contiguously_with_one_request_per_switch() -> None:
    owners = [["A"], ["B"], ["A", "B"], ["A"], ["C", "A"], ["C"]]
    plan = plan_pulls(owners, 0)
    assert [(r.node_id, r.start, r.end) for r in plan] == [("A", 0, 1), ("B", 1, 3), ("A", 3, 5), ("C", 5, 6)]
    assert sum(r.num_blocks for r in plan) == 6
    with pytest.raises(ValueError):
        plan_pulls(owners, -1)


def test_ties_are_not_won_by_the_lowest_node_id() -> None:
    # Every block owned by the same two nodes, one of them named to sort first: over many prefixes
    # each node is asked first for some of them, and a given prefix always goes to the same node.
    winners = []
    for p in range(64):
        hashes = [blake3.blake3(f"{p}:{i}".encode()).digest() for i in range(4)]
        plan = plan_pulls([["0-liar", "node-b"]] * 4, 0, hashes=hashes)
        assert plan == plan_pulls([["node-b", "0-liar"]] * 4, 0, hashes=hashes)
        winners.append(plan[0].node_id)
    assert 16 < winners.count("0-liar") < 48


def test_the_version_more_independent_producers_hold_wins_and_a_tie_is_a_miss() -> None:
    a, b, same = b"\1" * 8 + b"node-a", b"\2" * 8 + b"node-b", b"\1" * 8 + b"node-c"   # c computed a's bytes
    owners = [("A", "B", "C", "old"), ("A", "B"), ("B",), ("A", "M", "B")]
    # Block 3: B reported first, and M mirrors B's block (it carries B's version): still one producer each.
    versions = [(a, b, same, b""), (a, b), (b,), (a, b, b)]
    vote = agreeing_owners(owners, versions, [b, b, b, b])
    assert vote.kept == [["A", "C", "old"], [], ["B"], []]   # an owner that reports no version is kept
    assert vote.disputed == [1, 3]
    assert vote.disagreements == [(0, a, b), (1, b, a), (3, b, a)]
    assert vote.outvoted == [(0, a, b)]                       # two producers against one
    plain = agreeing_owners(owners, (), ())
    assert plain.kept == [list(o) for o in owners] and not plain.disagreements and not plain.disputed
