"""RadixCache against a reference model: a dict (namespace, token prefix) -> slot.

Every test slot id is unique, so a slot names exactly one cached (namespace, prefix) entry;
that makes "which tokens did evict free" observable without looking inside the tree.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fabric.keys import Namespace
from fabric.layout import KVLayout
from fabric.radix_cache import RadixCache, RadixNode

NS_A = Namespace("model-a", KVLayout.mha(2, 2, 4, "f16"), block_size=4).root
NS_B = Namespace("model-b", KVLayout.mha(2, 2, 4, "f16"), block_size=4).root
NAMESPACES = (NS_A, NS_B)

Prefix = tuple[bytes, tuple[int, ...]]

token_lists = st.lists(st.integers(0, 3), min_size=0, max_size=8)


class RadixModel(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.cache = RadixCache()
        self.model: dict[Prefix, int] = {}
        self.last_used: dict[Prefix, int] = {}  # entry -> step of the last insert/match covering it
        self.step = 0
        self.locks: list[tuple[RadixNode, bytes, tuple[int, ...]]] = []
        self.next_slot = 0
        self.freed: set[int] = set()

    # ------------------------------------------------------------ model helpers
    def longest(self, ns: bytes, tokens: tuple[int, ...]) -> int:
        n = 0
        while n < len(tokens) and (ns, tokens[:n + 1]) in self.model:
            n += 1
        return n

    def locked_entries(self) -> set[Prefix]:
        return {(ns, toks[:k]) for _, ns, toks in self.locks for k in range(1, len(toks) + 1)}

    def use(self, ns: bytes, toks: tuple[int, ...]) -> None:
        self.step += 1
        for k in range(1, len(toks) + 1):
            self.last_used[(ns, toks[:k])] = self.step

    def fresh_slots(self, n: int) -> list[int]:
        slots = list(range(self.next_slot, self.next_slot + n))
        self.next_slot += n
        return slots

    # ------------------------------------------------------------ rules
    @rule(ns=st.sampled_from(NAMESPACES), tokens=token_lists)
    def insert(self, ns: bytes, tokens: list[int]) -> None:
        toks = tuple(tokens)
        slots = self.fresh_slots(len(toks))
        expected_present = self.longest(ns, toks)
        assert self.cache.insert(ns, toks, slots) == expected_present
        for k in range(expected_present + 1, len(toks) + 1):
            self.model[(ns, toks[:k])] = slots[k - 1]
        self.use(ns, toks)

    @rule(ns=st.sampled_from(NAMESPACES), tokens=token_lists, lock=st.booleans())
    def match(self, ns: bytes, tokens: list[int], lock: bool) -> None:
        toks = tuple(tokens)
        n = self.longest(ns, toks)
        result = self.cache.match_prefix(ns, toks)
        assert result.num_tokens == n
        assert result.slots.tolist() == [self.model[(ns, toks[:k])] for k in range(1, n + 1)]
        self.use(ns, toks[:n])
        if lock:
            self.cache.lock(result.last_node)
            self.locks.append((result.last_node, ns, toks[:n]))

    @precondition(lambda self: bool(self.locks))
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.locks) - 1))
        node, _, _ = self.locks.pop(index)
        self.cache.unlock(node)

    @rule(num_tokens=st.integers(0, 12))
    def evict(self, num_tokens: int) -> None:
        evictable_before = self.cache.evictable_size()
        locked = self.locked_entries()
        freed = self.cache.evict(num_tokens)
        assert len(freed) == len(set(freed)), "a slot was returned twice in one evict"
        assert not self.freed & set(freed), "a slot was returned by two evicts"
        self.freed |= set(freed)
        by_slot = {slot: entry for entry, slot in self.model.items()}
        for slot in freed:
            assert slot in by_slot, f"evict returned slot {slot} that the cache never held"
            assert by_slot[slot] not in locked, "a locked entry was evicted"
            del self.model[by_slot[slot]]
        assert len(freed) >= min(num_tokens, evictable_before)
        # LRU: nothing left behind as an unlocked leaf was used before something that went.
        if freed:
            newest_freed = max(self.last_used[by_slot[slot]] for slot in freed)
            children = {(ns, toks[:-1]) for ns, toks in self.model}
            for entry in self.model.keys() - children - locked:
                assert self.last_used[entry] >= newest_freed, "evict skipped an older leaf"
        assert self.cache.evictable_size() == evictable_before - len(freed)

    # ------------------------------------------------------------ invariants
    @invariant()
    def sizes_add_up(self) -> None:
        assert self.cache.evictable_size() + self.cache.protected_size() == len(self.model)
        assert self.cache.protected_size() == len(self.locked_entries())

    @invariant()
    def model_is_prefix_closed(self) -> None:
        # Only leaves are evicted, so what remains is still a tree of prefixes.
        for ns, toks in self.model:
            assert len(toks) == 1 or (ns, toks[:-1]) in self.model


TestRadixModel = RadixModel.TestCase
TestRadixModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# ---------------------------------------------------------------- unit tests
def test_longest_prefix_and_split_keep_slots() -> None:
    cache = RadixCache()
    assert cache.insert(NS_A, [1, 2, 3, 4], [10, 11, 12, 13]) == 0
    assert cache.insert(NS_A, [1, 2, 9], [20, 21, 22]) == 2
    assert cache.match_prefix(NS_A, [1, 2, 3, 4, 5]).slots.tolist() == [10, 11, 12, 13]
    assert cache.match_prefix(NS_A, [1, 2, 9]).slots.tolist() == [10, 11, 22]
    assert cache.match_prefix(NS_A, [1, 2, 7]).slots.tolist() == [10, 11]
    assert cache.match_prefix(NS_A, [5]).num_tokens == 0
    assert cache.total_size() == 5


def test_namespaces_never_match_each_other() -> None:
    cache = RadixCache()
    cache.insert(NS_A, [1, 2, 3], [0, 1, 2])
    assert cache.match_prefix(NS_B, [1, 2, 3]).num_tokens == 0
    assert cache.insert(NS_B, [1, 2, 3], [5, 6, 7]) == 0
    assert cache.match_prefix(NS_B, [1, 2, 3]).slots.tolist() == [5, 6, 7]
    assert cache.match_prefix(NS_A, [1, 2, 3]).slots.tolist() == [0, 1, 2]


def test_evicts_least_recently_used_leaf_first() -> None:
    cache = RadixCache()
    cache.insert(NS_A, [1, 1], [0, 1])
    cache.insert(NS_A, [2, 2], [2, 3])
    cache.insert(NS_A, [3, 3], [4, 5])
    cache.match_prefix(NS_A, [1, 1])  # [2 2] is now the oldest
    assert cache.evict(1) == [2, 3]
    assert cache.evict(1) == [4, 5]
    assert cache.evict(1) == [0, 1]
    assert cache.evict(1) == []
    assert cache.num_namespaces() == 0


def test_evicting_a_leaf_makes_its_parent_evictable() -> None:
    cache = RadixCache()
    cache.insert(NS_A, [1, 2, 3], [0, 1, 2])
    cache.insert(NS_A, [1, 2, 4], [0, 1, 3])
    assert sorted(cache.evict(100)) == [0, 1, 2, 3]
    assert cache.total_size() == 0


def test_lock_protects_matched_prefix_only() -> None:
    cache = RadixCache()
    cache.insert(NS_A, [1, 2, 3, 4], [0, 1, 2, 3])
    match = cache.match_prefix(NS_A, [1, 2, 9])
    cache.lock(match.last_node)
    assert (cache.protected_size(), cache.evictable_size()) == (2, 2)
    assert cache.evict(100) == [2, 3]
    assert cache.match_prefix(NS_A, [1, 2, 3]).slots.tolist() == [0, 1]
    cache.unlock(match.last_node)
    assert cache.evict(100) == [0, 1]


def test_lock_survives_a_later_split_of_the_locked_node() -> None:
    cache = RadixCache()
    cache.insert(NS_A, [1, 2, 3, 4], [0, 1, 2, 3])
    node = cache.match_prefix(NS_A, [1, 2, 3, 4]).last_node
    cache.lock(node)
    cache.insert(NS_A, [1, 2, 7], [0, 1, 9])  # splits the locked run after two tokens
    assert cache.evict(100) == [9]
    assert cache.protected_size() == 4
    cache.unlock(node)
    assert sorted(cache.evict(100)) == [0, 1, 2, 3]


def test_misuse_is_reported() -> None:
    cache = RadixCache()
    cache.insert(NS_A, [1, 2], [0, 1])
    node = cache.match_prefix(NS_A, [1, 2]).last_node
    with pytest.raises(RuntimeError, match="unlock without a matching lock"):
        cache.unlock(node)
    cache.evict(2)
    with pytest.raises(RuntimeError, match="evicted node"):
        cache.lock(node)
    with pytest.raises(ValueError, match="one slot per token"):
        cache.insert(NS_A, [1, 2, 3], [0, 1])
    with pytest.raises(ValueError, match="one-dimensional"):
        cache.match_prefix(NS_A, np.zeros((2, 2), dtype=np.int64))


def test_many_evictions_stay_fast_and_exact() -> None:
    cache = RadixCache()
    rng = np.random.default_rng(7)
    for i in range(3000):
        tokens = rng.integers(0, 50, size=8)
        cache.insert(NS_A, tokens, np.arange(i * 8, i * 8 + 8))
        cache.match_prefix(NS_A, tokens[:4])
    total = cache.total_size()
    freed = cache.evict(total)
    assert len(freed) == len(set(freed)) == total
    assert cache.total_size() == 0
