"""Unit tests of cluster/router.py: which node a prompt goes to, and the hit ratio."""

from __future__ import annotations

import blake3
import pytest

from cluster.router import NodeView, RouteDecision, Router


def test_prefers_the_node_with_the_longest_cheap_prefix() -> None:
    r = Router()
    views = [NodeView("a", ["device"] * 4, 0), NodeView("b", ["device"] * 10, 0), NodeView("c", [], 0)]
    assert r.choose(12, views) == RouteDecision("b", 2.0, "cost")


def test_device_beats_ram_beats_ssd_beats_peer_for_the_same_prefix() -> None:
    r = Router()
    tiers = ["peer", "ssd", "ram", "device"]
    views = [NodeView(f"n-{t}", [t] * 8, 0) for t in tiers]
    assert r.choose(8, views).node_id == "n-device"
    assert r.choose(8, views[:3]).node_id == "n-ram"
    assert r.choose(8, views[:2]).node_id == "n-ssd"
    # a long prefix on a peer still beats recomputing: pulling is cheaper than prefill
    assert r.choose(8, [NodeView("cold", [], 0), NodeView("pull", ["peer"] * 8, 0)]).node_id == "pull"


def test_only_the_prompts_blocks_count() -> None:
    r = Router()
    assert r.cost(4, NodeView("a", ["ssd"] * 10, 0)) == pytest.approx(4 * 0.15)


def test_load_breaks_near_ties_but_not_a_large_cache_advantage() -> None:
    r = Router()
    views = [NodeView("a", ["device"] * 8, 3), NodeView("b", ["device"] * 8, 1)]
    assert r.choose(16, views).node_id == "b"
    views = [NodeView("a", ["device"] * 7, 0), NodeView("b", ["device"] * 8, 1)]
    assert r.choose(16, views).node_id == "a"        # one block cheaper to compute < one queued request
    views = [NodeView("a", ["device"] * 100, 2), NodeView("b", [], 0)]
    assert r.choose(100, views) == RouteDecision("a", 4.0, "cost")
    tied = [NodeView("z", [], 0), NodeView("y", [], 0)]
    assert r.choose(4, tied, b"p").node_id == r.choose(4, tied[::-1], b"p").node_id   # a tie: not by order


def test_imbalance_override_routes_to_the_least_loaded() -> None:
    r = Router(imbalance_ratio=2.0, imbalance_min=8.0)
    views = [NodeView("hot", ["device"] * 100, 40), NodeView("idle", [], 3), NodeView("warm", ["ram"] * 50, 20)]
    d = r.choose(100, views)
    assert (d.node_id, d.reason) == ("idle", "imbalance")
    assert d.cost == pytest.approx(100 + 2.0 * 3)
    # a difference below the absolute minimum, or within the ratio, does not trigger it
    assert r.choose(100, [NodeView("hot", ["device"] * 100, 8), NodeView("idle", [], 0)]).reason == "cost"
    assert r.choose(100, [NodeView("hot", ["device"] * 100, 30), NodeView("idle", [], 16)]).reason == "cost"


def test_empty_views_unknown_tiers_and_bad_settings_are_errors() -> None:
    r = Router()
    with pytest.raises(ValueError, match="no nodes"):
        r.choose(4, [])
    with pytest.raises(ValueError, match="unknown tier 'gpu'"):
        r.choose(4, [NodeView("a", ["gpu"], 0)])
    with pytest.raises(ValueError):
        Router(tier_weights={"device": 2.0})
    with pytest.raises(ValueError):
        Router(imbalance_ratio=0.5)


def test_hit_ratio_over_recorded_requests() -> None:
    r = Router()
    assert r.hit_ratio == 0.0
    r.record(10, 8)
    r.record(30, 0)
    assert r.hit_ratio == pytest.approx(8 / 40)
    with pytest.raises(ValueError):
        r.record(4, 5)


def test_ties_spread_distinct_prompts_over_equal_nodes_and_keep_each_prompt_on_one_node() -> None:
    r = Router()
    nodes = ["0-liar", "node-b", "node-c"]   # the lowest id gets no preference
    views = [NodeView(n, [], 0) for n in nodes]
    keys = [blake3.blake3(b"prompt-%d" % i).digest() for i in range(300)]
    chosen = [r.choose(8, views, key).node_id for key in keys]
    shares = {n: chosen.count(n) / len(keys) for n in nodes}
    assert all(0.20 <= share <= 0.47 for share in shares.values()), shares
    assert chosen == [r.choose(8, views[::-1], key).node_id for key in keys]
