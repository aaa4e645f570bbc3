"""Unit tests of cluster/router.py: which node a prompt goes to, and the hit ratio."""

from __future__ import annotations

import blake3
import pytest

from cluster.api import BlockLocation, CacheFill, EngineLoad, LookupReply, Where
from cluster.router import NodeView, RouteDecision, Router


def _prompt(*parts: str) -> list[bytes]:
    """Chained block hashes of a prompt made of named blocks (a shared prefix is shared parts first)."""
    hashes, h = [], b""
    for p in parts:
        h = blake3.blake3(h + p.encode()).digest()
        hashes.append(h)
    return hashes


def _blocks(n: int, tag: str = "p") -> list[bytes]:
    return _prompt(*(f"{tag}-{i}" for i in range(n)))


def test_prefers_the_node_with_the_longest_cheap_prefix() -> None:
    r = Router()
    views = [NodeView("a", ["device"] * 4), NodeView("b", ["device"] * 10), NodeView("c", [])]
    assert r.choose(_blocks(12), views) == RouteDecision("b", 2.0, "cost")


def test_device_beats_ram_beats_ssd_beats_peer_for_the_same_prefix() -> None:
    r = Router()
    tiers = ["peer", "ssd", "ram", "device"]
    views = [NodeView(f"n-{t}", [t] * 8) for t in tiers]
    assert r.choose(_blocks(8), views).node_id == "n-device"
    assert r.choose(_blocks(8), views[:3]).node_id == "n-ram"
    assert r.choose(_blocks(8), views[:2]).node_id == "n-ssd"
    # a long prefix on a peer still beats recomputing: pulling is cheaper than prefill
    assert r.choose(_blocks(8), [NodeView("cold", []), NodeView("pull", ["peer"] * 8)]).node_id == "pull"


def test_only_the_prompts_blocks_count() -> None:
    r = Router()
    assert r.cost(4, NodeView("a", ["ssd"] * 10)) == pytest.approx(4 * 0.15)


def test_load_breaks_near_ties_but_not_a_large_cache_advantage() -> None:
    r = Router()
    views = [NodeView("a", ["device"] * 8, 3), NodeView("b", ["device"] * 8, 1)]
    assert r.choose(_blocks(16), views).node_id == "b"
    views = [NodeView("a", ["device"] * 7, 0), NodeView("b", ["device"] * 8, 1)]
    assert r.choose(_blocks(16), views).node_id == "a"        # one block cheaper to compute < one request
    views = [NodeView("a", ["device"] * 100, 2), NodeView("b", [], 0)]
    assert r.choose(_blocks(100), views) == RouteDecision("a", 4.0, "cost")
    tied = [NodeView("z", []), NodeView("y", [])]
    assert r.choose(_blocks(4), tied).node_id == r.choose(_blocks(4), tied[::-1]).node_id   # not by order


def test_queued_prefill_tokens_weigh_not_only_request_counts() -> None:
    """Two nodes hold the prefix and run one request each; one of them has 60 blocks of prefill queued.
    Every request goes to the other, whatever its tie-break key says."""
    r = Router()
    for i in range(40):
        prompt = _prompt("system", "more-system", f"question-{i}")
        views = [NodeView("busy", ["ram"] * 2, 1, queued_blocks=60.0), NodeView("light", ["ram"] * 2, 1, 2.0)]
        assert r.choose(prompt, views).node_id == "light"
        assert r.choose(prompt, views[::-1]).node_id == "light"


def test_a_queue_past_the_bound_loses_to_an_idle_node() -> None:
    r = Router(max_queued_blocks=512)
    prompt = _blocks(2000)
    over = NodeView("over", ["device"] * 2000, 1, queued_blocks=520.0)   # cheapest by cost: 0 + 520 + 2
    idle = NodeView("idle", [])                                          # 2,000 blocks to compute
    d = r.choose(prompt, [over, idle])
    assert (d.node_id, d.reason) == ("idle", "queue bound")
    assert d.cost == pytest.approx(2000)
    # within the bound, cost decides; when every node is past it, cost decides among them
    assert r.choose(prompt, [NodeView("over", ["device"] * 2000, 1, 500.0), idle]).node_id == "over"
    assert r.choose(prompt, [over, NodeView("worse", [], 1, 600.0)]) == RouteDecision("over", 522.0, "cost")


def test_requests_that_share_their_first_blocks_spread_over_the_nodes_that_hold_them() -> None:
    """Every prompt starts with the same 4 blocks, which all three nodes hold; the rest differs. Ties
    go by each request's own key: the nodes share the requests, and one prompt always goes to one node."""
    r = Router()
    nodes = ["0-liar", "node-b", "node-c"]   # the lowest id gets no preference
    views = [NodeView(n, ["ram"] * 4) for n in nodes]
    prompts = [_prompt("sys-0", "sys-1", "sys-2", "sys-3", f"q-{i}", f"q-{i}-more") for i in range(300)]
    chosen = [r.choose(p, views).node_id for p in prompts]
    shares = {n: chosen.count(n) / len(prompts) for n in nodes}
    assert all(0.20 <= share <= 0.47 for share in shares.values()), shares
    assert chosen == [r.choose(p, views[::-1]).node_id for p in prompts]


def test_an_empty_node_grows_a_new_prefix() -> None:
    """The node holding a shared prefix is full: storing a conversation there evicts as many blocks,
    and it is fuller than the other. The empty node pulls the prefix once instead, evicts nothing, and
    its room counts for it."""
    r = Router()
    prompt = _blocks(16)
    full = NodeView("full", ["ram"] * 8, held_blocks=100, capacity_blocks=100)
    empty = NodeView("empty", ["peer"] * 8, held_blocks=0, capacity_blocks=100)
    d = r.choose(prompt, [full, empty])
    assert (d.node_id, d.reason) == ("empty", "cost")
    assert d.cost == pytest.approx(8 * 0.3 + 8 - 16 * 0.5)          # mean fill 0.5: 16 blocks into room
    assert r.cost(16, full, mean_fill=0.5) == pytest.approx(8 * 0.05 + 8 + 8 + 8 * 0.5)
    # equally full, the local prefix wins; room for part of the prompt evicts only the rest
    half = NodeView("half", ["ram"] * 8, held_blocks=50, capacity_blocks=100)
    assert r.choose(prompt, [half, NodeView("other", ["peer"] * 8, held_blocks=50, capacity_blocks=100)]
                    ).node_id == "half"
    assert r.cost(16, NodeView("x", ["ram"] * 8, held_blocks=95, capacity_blocks=100)) == pytest.approx(0.4 + 8 + 3)


def test_one_node_holding_a_shared_prefix_does_not_take_every_conversation() -> None:
    """A replay: every conversation starts with the same 8-block system prompt, first computed on one
    node; each stores 8 blocks of its own. Nodes report their fill, and a node that served the prompt
    holds it from then on. Once the first node is full, the others pull the prompt and take their share."""
    r = Router()
    nodes = ["a", "b", "c"]
    held = {"a": 8, "b": 0, "c": 0}
    chosen = []
    for i in range(60):
        prompt = _prompt(*(f"sys-{k}" for k in range(8)), *(f"conv-{i}-{k}" for k in range(8)))
        views = [NodeView(n, ["ram" if held[n] else "peer"] * 8, held_blocks=held[n], capacity_blocks=64)
                 for n in nodes]
        node = r.choose(prompt, views).node_id
        held[node] = min(64, held[node] + (8 if held[node] else 16))
        chosen.append(node)
    assert all(chosen.count(n) >= 12 for n in nodes), {n: chosen.count(n) for n in nodes}


def test_a_view_from_a_lookup_reply_carries_the_prefix_the_load_and_the_fill() -> None:
    reply = LookupReply(16, (BlockLocation(Where.RAM, "n"), BlockLocation(Where.PEER, "m")),
                        EngineLoad(running_requests=1, queued_requests=2, queued_prefill_tokens=320),
                        CacheFill(held_blocks=30, capacity_blocks=40))
    view = NodeView.of("n", reply)
    assert view == NodeView("n", ["ram", "peer"], 3, 20.0, 30, 40)
    assert view.num_local_blocks == 1


def test_empty_views_unknown_tiers_and_bad_settings_are_errors() -> None:
    r = Router()
    with pytest.raises(ValueError, match="no nodes"):
        r.choose(_blocks(4), [])
    with pytest.raises(ValueError, match="unknown tier 'gpu'"):
        r.choose(_blocks(4), [NodeView("a", ["gpu"])])
    with pytest.raises(ValueError):
        Router(tier_weights={"device": 2.0})
    with pytest.raises(ValueError):
        Router(queue_weight=-1.0)
    with pytest.raises(ValueError):
        Router(fill_weight=-1.0)
    with pytest.raises(ValueError):
        Router(max_queued_blocks=0)


def test_hit_ratio_over_recorded_requests() -> None:
    r = Router()
    assert r.hit_ratio == 0.0
    r.record(10, 8)
    r.record(30, 0)
    assert r.hit_ratio == pytest.approx(8 / 40)
    with pytest.raises(ValueError):
        r.record(4, 5)
