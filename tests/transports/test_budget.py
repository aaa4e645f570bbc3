"""Per-peer token buckets with an injected clock (no sockets, no sleeping)."""

from __future__ import annotations

import pytest

from transports.core import budget
from transports.core.budget import PeerBudgets, PeerRates, TokenBucket, Verdict


def test_a_bucket_gives_its_burst_then_refills_at_its_rate() -> None:
    bucket = TokenBucket.full(rate=10.0, burst=5.0, now=0.0)
    assert [bucket.take(1, 0.0) for _ in range(6)] == [True] * 5 + [False]
    assert not bucket.take(1, 0.05)          # half a token back
    assert bucket.take(1, 0.1)               # one token back
    assert bucket.take(4, 100.0) and not bucket.take(2, 100.0)   # never more than the burst


def test_a_charge_may_leave_debt_that_the_refill_pays_back() -> None:
    bucket = TokenBucket.full(rate=100.0, burst=100.0, now=0.0)
    bucket.charge(300, 0.0)
    assert bucket.in_debt(0.0) and bucket.in_debt(1.9) and not bucket.in_debt(2.01)


def test_pulls_over_the_rate_are_refused_per_peer() -> None:
    budgets = PeerBudgets(PeerRates(pulls_per_s=100.0, pull_burst=10.0))
    assert [budgets.admit_pull("flood", 0.0) for _ in range(11)] == [Verdict.OK] * 10 + [Verdict.PULLS]
    assert budgets.admit_pull("good", 0.0) is Verdict.OK      # another peer has its own budget
    assert budgets.admit_pull("flood", 0.01) is Verdict.OK    # 1 token back after 10 ms


def test_a_peer_in_byte_debt_gets_no_pull_until_paid_back() -> None:
    budgets = PeerBudgets(PeerRates(bytes_per_s=1000.0, bytes_burst=1000.0))
    assert budgets.admit_pull("big", 0.0) is Verdict.OK
    budgets.charge_bytes("big", 3000, 0.0)   # served more than its burst in one go
    assert budgets.admit_pull("big", 1.0) is Verdict.BYTES
    assert budgets.admit_pull("other", 1.0) is Verdict.OK
    assert budgets.admit_pull("big", 2.01) is Verdict.OK


def test_wait_says_when_the_next_pull_would_be_admitted() -> None:
    budgets = PeerBudgets(PeerRates(pulls_per_s=10.0, pull_burst=1.0, bytes_per_s=100.0, bytes_burst=100.0))
    assert budgets.wait_s("p", 0.0) == 0.0
    assert budgets.admit_pull("p", 0.0) is Verdict.OK
    assert budgets.wait_s("p", 0.0) == pytest.approx(0.1)    # one PULL token refills in 0.1 s
    budgets.charge_bytes("p", 400, 0.0)                       # 300 bytes of debt at 100 bytes/s
    assert budgets.wait_s("p", 0.0) == pytest.approx(3.0)
    assert budgets.admit_pull("p", 3.0) is Verdict.OK


def test_idle_peers_are_forgotten_once_many_are_tracked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(budget, "MAX_TRACKED", 4)
    budgets = PeerBudgets(PeerRates(pulls_per_s=1.0, pull_burst=2.0))
    for i in range(4):
        budgets.admit_pull(f"peer-{i}", 0.0)
    budgets.admit_pull("busy", 10.0)   # the others refilled by then: swept
    assert budgets.num_tracked == 1
    budgets.admit_pull("busy", 10.0)
    assert budgets.admit_pull("busy", 10.0) is Verdict.PULLS   # its own state survived the sweep


def test_rates_must_be_positive() -> None:
    with pytest.raises(ValueError, match="pulls_per_s"):
        PeerRates(pulls_per_s=0.0)


def test_a_contended_shared_budget_refuses_the_heaviest_keys_and_admits_the_light_ones() -> None:
    shared = budget.SharedBudget(rate=100.0, burst=100.0, now=0.0)
    assert shared.admit("churner", 0.0)
    shared.charge("churner", 150, 0.0)                   # the node's bucket is now in debt
    assert shared.admit("churner", 0.0)                  # alone, it is everyone: its own budget bounds it
    shared.charge("good", 10, 0.0)
    assert not shared.admit("churner", 0.0) and shared.admit("good", 0.0) and shared.admit("new", 0.0)
    assert shared.admit("churner", 10.0)                 # the bucket refilled: everyone again


def test_handshakes_past_the_nodes_rate_are_shared_by_source_address() -> None:
    budgets = PeerBudgets(PeerRates(handshakes_per_s=1.0, handshake_burst=4.0))
    assert [budgets.admit_handshake("10.0.0.9", 0.0) for _ in range(5)] == [True] * 4 + [True]   # alone
    assert budgets.admit_handshake("10.0.0.2", 0.0)      # a source that began few is admitted ...
    assert not budgets.admit_handshake("10.0.0.9", 0.0)  # ... the churning one is not
    assert budgets.admit_handshake("10.0.0.9", 60.0)


def test_a_peer_over_its_fair_share_of_the_nodes_bytes_is_refused_as_such() -> None:
    budgets = PeerBudgets(PeerRates(node_bytes_per_s=1000.0, node_bytes_burst=1000.0))
    budgets.charge_bytes("flood", 5000, 0.0)
    budgets.charge_bytes("good", 100, 0.0)
    assert budgets.admit_pull("flood", 0.0) is Verdict.SHARE and budgets.admit_pull("good", 0.0) is Verdict.OK
    assert budgets.wait_s("flood", 0.0) > 0
