"""The chat workload and the cache models the cluster's trace hit ratio is compared with."""

from __future__ import annotations

import itertools

import blake3

from benchmarks.lib.chat_trace import PrefixLru, chat_trace, hit_ratio, isolated_hit_ratio


def _h(*names: str) -> list[bytes]:
    return [blake3.blake3(n.encode()).digest() for n in names]


def test_the_trace_is_deterministic_and_conversations_grow_turn_by_turn() -> None:
    trace = chat_trace(200, num_users=5, num_system_prompts=4, system_tokens=64, question_tokens=8,
                       answer_tokens=8, max_turns=3, seed=7)
    assert trace == chat_trace(200, num_users=5, num_system_prompts=4, system_tokens=64, question_tokens=8,
                               answer_tokens=8, max_turns=3, seed=7)
    assert trace != chat_trace(200, num_users=5, num_system_prompts=4, system_tokens=64, question_tokens=8,
                               answer_tokens=8, max_turns=3, seed=8)
    assert all(a.arrival_s < b.arrival_s for a, b in itertools.pairwise(trace))
    assert {r.turn for r in trace} == {0, 1, 2}
    last: dict[int, tuple[int, ...]] = {}
    for r in trace:
        if r.turn > 0:   # the previous turn's prompt (and its answer) is a prefix of this one
            prev = last[r.user]
            assert r.tokens[:len(prev)] == prev and len(r.tokens) == len(prev) + 8 + 8
        last[r.user] = r.tokens
    # Zipf: the most popular system prompt opens more conversations than the least popular one.
    firsts = [r.tokens[:64] for r in trace if r.turn == 0]
    counts = sorted((firsts.count(s) for s in set(firsts)), reverse=True)
    assert counts[0] > counts[-1]


def test_a_prefix_lru_serves_the_cached_leading_run_and_evicts_the_least_recent() -> None:
    cache = PrefixLru(3)
    assert cache.serve(_h("a", "b")) == 0
    assert cache.serve(_h("a", "b", "c")) == 2
    assert cache.serve(_h("x", "b")) == 0            # b is cached but not a leading run
    assert len(cache) == 3                           # a was the least recent: evicted
    assert cache.serve(_h("a")) == 0
    assert PrefixLru(None).serve(_h("a")) == 0


def test_pooled_capacity_beats_isolated_and_unbounded_beats_both() -> None:
    trace = chat_trace(300, num_users=12, num_system_prompts=6, system_tokens=128, question_tokens=16,
                       answer_tokens=16, seed=1)
    requests = [[blake3.blake3(bytes(str(r.tokens[:i + 16]), "ascii")).digest()
                 for i in range(0, len(r.tokens) - 15, 16)] for r in trace]
    nodes = [f"n{r.user % 3}" if i % 2 else f"n{i % 3}" for i, r in enumerate(trace)]
    unbounded = hit_ratio(PrefixLru(None), requests)
    pooled = hit_ratio(PrefixLru(3 * 60), requests)
    isolated = isolated_hit_ratio(60, requests, nodes)
    assert unbounded >= pooled > isolated > 0
