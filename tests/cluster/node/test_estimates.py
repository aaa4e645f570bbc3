"""Live estimates and the load-or-recompute plan, without Ray: measurements and `now` go in."""

from __future__ import annotations

import pytest

from cluster.node.estimates import (
    DEFAULT_BANDWIDTH,
    PULL_MARGIN,
    PeerEstimates,
    PrefillEstimate,
    RunCost,
    plan_by_deadline,
)

MB = 1_000_000


def test_peer_bandwidth_and_rtt_follow_completed_pulls() -> None:
    peers = PeerEstimates(alpha=0.5)
    assert peers.expected_s("a", 100 * MB, 0.0) == pytest.approx(0.001 + 100 * MB / DEFAULT_BANDWIDTH)
    peers.record_pull("a", 10 * MB, 1.0, rtt_s=0.01)           # 10 MB/s
    assert peers.expected_s("a", 10 * MB, 0.0) == pytest.approx(1.01)
    peers.record_pull("a", 30 * MB, 1.0, rtt_s=0.01)           # 30 MB/s: the estimate moves halfway
    assert peers.snapshot(0.0)["a"]["bandwidth_mb_s"] == pytest.approx(20.0)
    assert peers.snapshot(0.0)["a"]["pulls"] == 2


def test_failures_slow_a_peer_down_until_they_are_forgotten() -> None:
    peers = PeerEstimates()
    peers.record_pull("a", 10 * MB, 0.1, rtt_s=0.0)
    healthy = peers.expected_s("a", MB, 0.0)
    peers.record_failure("a", 1.0)
    peers.record_failure("a", 2.0)
    assert peers.expected_s("a", MB, 3.0) == pytest.approx(4 * healthy)
    assert peers.expected_s("a", MB, 35.0) == pytest.approx(healthy)


def test_without_a_prefill_rate_every_run_is_pulled() -> None:
    runs = [RunCost("a", 4, 4 * MB, 64)]
    assert plan_by_deadline(runs, PeerEstimates(), PrefillEstimate(), 0.0, deadline_s=2.0) == (1, 2.0)


def test_a_slow_peer_is_not_pulled_and_a_fast_one_is() -> None:
    prefill = PrefillEstimate()
    prefill.record(1000, 1.0)                                  # 1,000 tokens/s
    peers = PeerEstimates()
    peers.record_pull("fast", 100 * MB, 0.1, rtt_s=0.0)        # 1 GB/s
    peers.record_pull("slow", 1 * MB, 1.0, rtt_s=0.0)          # 1 MB/s
    # 1,000 tokens of KV is 46 MB (SmolLM2): 1 s to compute, 0.046 s from fast, 46 s from slow.
    fast = [RunCost("fast", 64, 46 * MB, 1000)]
    taken, deadline = plan_by_deadline(fast, peers, prefill, 0.0)
    assert taken == 1 and deadline == pytest.approx(PULL_MARGIN * 1.0)
    assert plan_by_deadline([RunCost("slow", 64, 46 * MB, 1000)], peers, prefill, 0.0) == (0, None)
    # The leading run pays, the second (slow) one does not: only the first is pulled.
    mixed = [RunCost("fast", 32, 23 * MB, 500), RunCost("slow", 32, 23 * MB, 500)]
    taken, deadline = plan_by_deadline(mixed, peers, prefill, 0.0)
    assert taken == 1 and deadline == pytest.approx(PULL_MARGIN * 0.5)
    # A caller's deadline shorter than the pull: nothing pays.
    assert plan_by_deadline(fast, peers, prefill, 0.0, deadline_s=0.01) == (0, None)


def test_prefill_rate_ignores_empty_and_short_reports() -> None:
    prefill = PrefillEstimate(alpha=1.0)
    prefill.record(0, 1.0)
    prefill.record(16, 0.5)          # a suffix after a hit: mostly overhead
    assert prefill.compute_s(100) is None
    prefill.record(200, 0.5)
    assert prefill.compute_s(100) == pytest.approx(0.25)


def test_a_slow_estimate_goes_stale_so_the_peer_is_measured_again() -> None:
    from cluster.node.estimates import STALE_S
    peers = PeerEstimates()
    peers.record_pull("a", 1 * MB, 1.0, rtt_s=0.0, now=100.0)          # 1 MB/s
    assert peers.expected_s("a", 10 * MB, 101.0) == pytest.approx(10.0)
    assert peers.expected_s("a", 10 * MB, 100.0 + STALE_S + 1) < 0.1   # back to the optimistic default


def test_a_pull_cut_at_its_deadline_replaces_the_estimate() -> None:
    peers = PeerEstimates(alpha=0.3)
    peers.record_pull("a", 100 * MB, 1.0, rtt_s=0.0, now=1.0)             # 100 MB/s
    peers.record_pull("a", 2 * MB, 1.0, rtt_s=0.0, now=2.0, cut=True)     # cut after 2 MB in 1 s
    assert peers.snapshot(2.0)["a"]["bandwidth_mb_s"] == pytest.approx(2.0)
