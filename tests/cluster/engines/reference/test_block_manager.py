"""BlockManager: prefix hits, ref counts, LRU reuse, reservations, events, stats.

Unit tests for each behaviour, then a hypothesis state machine that drives the manager and a
reference model with random allocate / append / deallocate / reserve / release steps. The model
keys blocks by (namespace, every token up to the block's end) -- no hashing at all -- so
agreement shows that hash hits are exactly equal-prefix hits.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cluster.engines.reference.block_manager import BlockManager, BlockState
from cluster.engines.reference.sequence import SeqState
from fabric.events import BlockEvicted, BlockStored
from fabric.keys import BlockHash, Namespace, block_hashes, chain_hash, tokens_to_bytes
from fabric.layout import KVLayout

LAYOUT = KVLayout.mha(2, 2, 8, "f16")


def ns_of(block_size: int, salt: bytes = b"") -> Namespace:
    return Namespace("test/model", LAYOUT, block_size, tenant_salt=salt)


def registered(events: list[BlockStored | BlockEvicted], start: set[BlockHash] | None = None) -> set[BlockHash]:
    held = set(start or ())
    for ev in events:
        if isinstance(ev, BlockStored):
            assert not held & set(ev.block_hashes), "a hash was reported stored twice"
            held |= set(ev.block_hashes)
        else:
            assert set(ev.block_hashes) <= held, "an unknown hash was reported evicted"
            held -= set(ev.block_hashes)
    return held


# ---------------------------------------------------------------------------- unit tests
def test_allocate_gives_one_block_per_started_block() -> None:
    bm = BlockManager(ns_of(4), 8)
    seq = SeqState(1, range(10))
    assert bm.can_allocate(seq)
    assert bm.allocate(seq)
    assert seq.block_table == [0, 1, 2]
    assert seq.num_cached_tokens == 0
    assert [bm.block_state(b) for b in range(4)] == [BlockState.IN_USE] * 3 + [BlockState.FREE]
    assert bm.seq_block_hashes(seq) == block_hashes(ns_of(4), list(range(10)))
    assert bm.block_hash(2) is None  # partial block
    bm.check()


def test_shared_prompt_hits_and_is_ref_counted() -> None:
    bm = BlockManager(ns_of(4), 8)
    a = SeqState(1, [*range(8), 50])
    b = SeqState(2, [*range(8), 60, 61])
    assert bm.allocate(a) and bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert b.num_cached_tokens == 8
    assert bm.ref_count(a.block_table[0]) == 2
    assert bm.block_state(a.block_table[0]) is BlockState.SHARED
    bm.deallocate(a)
    assert bm.ref_count(b.block_table[0]) == 1
    assert bm.block_state(b.block_table[0]) is BlockState.IN_USE
    assert bm.stats().hit_ratio == pytest.approx(2 / 4)
    bm.check()


def test_freed_blocks_stay_hitable_until_reused() -> None:
    bm = BlockManager(ns_of(2), 6)
    a = SeqState(1, [1, 2, 3, 4, 5])
    bm.allocate(a)
    full = a.block_table[:2]
    bm.deallocate(a)
    assert [bm.block_state(b) for b in full] == [BlockState.CACHED] * 2
    assert bm.stats().num_cached == 2
    assert bm.match_prefix([1, 2, 3, 4, 9]) == 4
    again = SeqState(2, [1, 2, 3, 4, 7])
    bm.allocate(again)
    assert again.block_table[:2] == full
    assert again.num_cached_tokens == 4
    assert bm.stats().num_cached == 0
    bm.check()


def test_lru_reuse_order_and_tail_first_eviction() -> None:
    bm = BlockManager(ns_of(1), 4)
    a = SeqState(1, [7, 8, 9])  # blocks 0, 1, 2
    bm.allocate(a)
    bm.deallocate(a)  # freed last-to-first: queue is 3, 2, 1, 0
    assert bm.free_block_ids() == [3, 2, 1, 0]
    bm.take_events()
    other = SeqState(2, [100])
    bm.allocate(other)
    assert other.block_table == [3]  # the never-used block goes first
    other2 = SeqState(3, [101])
    bm.allocate(other2)
    assert other2.block_table == [2]  # then the tail of the old prompt
    assert bm.match_prefix([7, 8, 9]) == 2  # its head blocks are still cached
    events = bm.take_events()
    evicted = [h for ev in events if isinstance(ev, BlockEvicted) for h in ev.block_hashes]
    assert evicted == [block_hashes(ns_of(1), [7, 8, 9])[2]]
    bm.check()


def test_second_namespace_never_hits() -> None:
    bm = BlockManager(ns_of(2), 8)
    tokens = [1, 2, 3, 4, 5]
    bm.allocate(SeqState(1, tokens))
    tenant = ns_of(2, salt=b"tenant-b")
    other = SeqState(2, tokens, namespace=tenant)
    bm.allocate(other)
    assert other.num_cached_tokens == 0
    assert bm.seq_block_hashes(other) == block_hashes(tenant, tokens)
    assert bm.match_prefix(tokens, namespace=tenant) == 4  # its own blocks now
    with pytest.raises(ValueError, match="block size"):
        bm.allocate(SeqState(3, tokens, namespace=ns_of(4)))


def test_hits_are_verified_against_tokens() -> None:
    def weak(parent: bytes, block: bytes | memoryview) -> BlockHash:
        return chain_hash(parent, b"")  # depends on the position only: every block i collides

    bm = BlockManager(ns_of(2), 8, chain_hash_fn=weak)
    first = SeqState(1, [1, 2, 3, 4])
    bm.allocate(first)
    probe = SeqState(2, [1, 2, 9, 9])
    bm.allocate(probe)
    assert probe.num_cached_tokens == 2  # block 0 really matches; block 1 only by "hash"
    assert probe.block_table[0] == first.block_table[0]
    assert probe.block_table[1] != first.block_table[1]
    bm.check()


def test_hash_evicted_and_stored_again_in_one_call_replays_as_stored() -> None:
    def weak(parent: bytes, block: bytes | memoryview) -> BlockHash:
        return chain_hash(parent, b"")  # depends on the position only

    bm = BlockManager(ns_of(1), 1, chain_hash_fn=weak)
    first = SeqState(1, [5])
    bm.allocate(first)
    bm.deallocate(first)
    second = SeqState(2, [6])  # same "hash", other tokens: a miss that reuses the only block
    assert bm.allocate(second)
    assert second.num_cached_tokens == 0
    held = registered(bm.take_events())
    assert held == {bm.block_hash(0)}
    bm.check()


def test_may_append_takes_block_then_hashes_when_full() -> None:
    ns = ns_of(2)
    bm = BlockManager(ns, 8)
    seq = SeqState(1, [5, 6])
    assert bm.allocate(seq)
    bm.take_events()
    seq.append_token(7)
    assert bm.can_append(seq) and bm.may_append(seq)
    assert len(seq.block_table) == 2
    assert bm.take_events() == []
    seq.append_token(8)
    assert bm.may_append(seq)
    (ev,) = bm.take_events()
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == (block_hashes(ns, [5, 6, 7, 8])[1],)
    assert ev.parent_hash == block_hashes(ns, [5, 6])[0]
    assert ev.block_ids == (seq.block_table[1],)
    other = SeqState(2, [5, 6, 7, 8, 1])
    assert bm.allocate(other)
    assert other.num_cached_tokens == 4
    bm.check()


def test_may_append_several_tokens_at_once() -> None:
    ns = ns_of(2)
    bm = BlockManager(ns, 8)
    seq = SeqState(1, [1])
    bm.allocate(seq)
    for t in (2, 3, 4, 5, 6):
        seq.append_token(t)
    assert bm.may_append(seq)
    assert len(seq.block_table) == 3
    assert bm.seq_block_hashes(seq) == block_hashes(ns, [1, 2, 3, 4, 5, 6])
    stored = [ev for ev in bm.take_events() if isinstance(ev, BlockStored)]
    assert [h for ev in stored for h in ev.block_hashes] == block_hashes(ns, [1, 2, 3, 4, 5, 6])
    bm.check()


def test_block_filled_by_append_takes_over_a_cached_duplicate() -> None:
    ns = ns_of(2)
    bm = BlockManager(ns, 6)
    done = SeqState(1, [1, 2])
    bm.allocate(done)
    old = done.block_table[0]
    bm.deallocate(done)
    assert bm.block_state(old) is BlockState.CACHED
    growing = SeqState(2, [1])  # allocated while its only block was partial: no hit possible
    bm.allocate(growing)
    bm.take_events()
    growing.append_token(2)
    assert bm.may_append(growing)
    assert bm.take_events() == []  # the hash was served before and still is: nothing to report
    assert bm.block_state(old) is BlockState.FREE  # the in-use copy serves it now
    assert bm.stats().num_cached == 0
    probe = SeqState(3, [1, 2, 5])
    assert bm.allocate(probe)
    assert probe.block_table[0] == growing.block_table[0] and probe.num_cached_tokens == 2
    bm.check()


def test_out_of_blocks_is_a_return_value_and_changes_nothing() -> None:
    bm = BlockManager(ns_of(2), 3)
    a = SeqState(1, [1, 2, 3, 4])
    bm.allocate(a)
    big = SeqState(2, [9] * 5)
    assert not bm.can_allocate(big)
    before = (bm.free_block_ids(), bm.stats().num_in_use)
    assert bm.allocate(big) is False
    assert big.block_table == []
    assert (bm.free_block_ids(), bm.stats().num_in_use) == before
    c = SeqState(3, [5, 6])
    bm.allocate(c)
    c.append_token(7)
    assert not bm.can_append(c)
    assert bm.may_append(c) is False
    assert len(c.block_table) == 1
    bm.check()


def test_reservation_holds_blocks_for_its_request_only() -> None:
    bm = BlockManager(ns_of(2), 4)
    warm = SeqState(0, [1, 2])
    bm.allocate(warm)
    bm.deallocate(warm)  # block 0 cached at the tail; queue: 1 2 3 0
    bm.take_events()
    assert bm.reserve("r", 3)
    assert bm.num_reserved_for("r") == 3
    assert [bm.block_state(b) for b in (1, 2, 3)] == [BlockState.RESERVED] * 3
    assert bm.stats().num_reserved == 3
    stranger = SeqState(1, [9, 9, 9])
    assert not bm.can_allocate(stranger) and not bm.allocate(stranger)
    mine = SeqState(2, [1, 2, 8, 8, 8], request_id="r")
    assert bm.allocate(mine)
    assert mine.num_cached_tokens == 2 and mine.block_table[0] == 0
    assert set(mine.block_table[1:]) <= {1, 2, 3}
    assert bm.num_reserved_for("r") == 1
    assert bm.release("r") == 1
    assert bm.release("r") == 0
    assert bm.stats().num_reserved == 0
    assert bm.free_block_ids()[0] in {1, 2, 3}  # unused reserved blocks are reused first
    assert not bm.reserve("r", 2)
    with pytest.raises(ValueError):
        bm.reserve("r", -1)
    bm.check()


def test_reserving_a_cached_block_evicts_its_hash() -> None:
    ns = ns_of(2)
    bm = BlockManager(ns, 2)
    s = SeqState(1, [1, 2])
    bm.allocate(s)
    bm.deallocate(s)
    bm.take_events()
    assert bm.reserve("r", 2)
    assert bm.take_events() == [BlockEvicted((block_hashes(ns, [1, 2])[0],))]
    assert bm.match_prefix([1, 2]) == 0


def test_events_replay_to_the_registered_set() -> None:
    ns = ns_of(1)
    bm = BlockManager(ns, 3)
    a = SeqState(1, [1, 2, 3])
    bm.allocate(a)
    bm.deallocate(a)
    b = SeqState(2, [4, 5])
    bm.allocate(b)
    held = registered(bm.take_events())
    assert held == {*block_hashes(ns, [1]), *block_hashes(ns, [4, 5])}
    assert bm.stats().num_registered_hashes == 3
    assert bm.stats().num_evicted == 2


def test_stats() -> None:
    bm = BlockManager(ns_of(2), 10)
    seqs = [SeqState(i, [i, i, 7]) for i in range(3)]
    for s in seqs:
        bm.allocate(s)
    bm.deallocate(seqs[0])
    assert bm.reserve("r", 1)
    st_ = bm.stats()
    assert (st_.num_blocks, st_.num_available, st_.num_in_use, st_.num_cached, st_.num_reserved) == (10, 5, 4, 1, 1)
    assert st_.utilisation == pytest.approx(0.5)


def test_a_fully_cached_prompt_gets_a_fresh_last_block() -> None:
    """The engine computes the last token into its block, so that block is never one another holds."""
    bm = BlockManager(ns_of(4), 8)
    a = SeqState(1, range(8))  # exactly two full blocks
    assert bm.allocate(a)
    bm.take_events()
    b = SeqState(2, range(8))
    assert bm.match_prefix(range(8)) == 8  # both blocks are cached ...
    assert bm.allocate(b)
    assert b.num_cached_tokens == 4  # ... but only the first is a hit
    assert b.block_table[0] == a.block_table[0] and bm.ref_count(b.block_table[0]) == 2
    assert b.block_table[1] != a.block_table[1]
    assert [bm.ref_count(x) for x in (a.block_table[1], b.block_table[1])] == [1, 1]
    assert bm.block_hash(b.block_table[1]) == block_hashes(ns_of(4), list(range(8)))[1]
    assert bm.take_events() == []  # the hash stayed served throughout: nothing to report
    a_last = a.block_table[1]
    bm.deallocate(a)  # a's old copy is no longer the one serving the hash
    assert bm.block_state(a_last) is BlockState.FREE
    assert bm.stats().num_cached == 0 and bm.match_prefix(range(8)) == 8
    bm.check()


def test_bad_input_is_rejected() -> None:
    with pytest.raises(ValueError):
        SeqState(1, [-1])
    with pytest.raises(ValueError):
        SeqState(1, [2**32])
    seq = SeqState(1, [1])
    with pytest.raises(ValueError):
        seq.append_token(2**32)
    bm = BlockManager(ns_of(2), 4)
    bm.allocate(seq)
    with pytest.raises(ValueError, match="already allocated"):
        bm.allocate(seq)
    with pytest.raises(ValueError):
        BlockManager(ns_of(2), 0)


def test_deallocated_sequence_can_be_allocated_again() -> None:
    bm = BlockManager(ns_of(2), 4)
    seq = SeqState(1, [1, 2, 3])
    bm.allocate(seq)
    seq.append_token(4)
    bm.may_append(seq)
    bm.deallocate(seq)
    assert seq.block_table == [] and seq.num_cached_tokens == 0
    bm.allocate(seq)  # preempted and rescheduled: its whole prompt is cached, its last block is computed
    assert seq.num_cached_tokens == 2
    bm.check()


# ---------------------------------------------------------------------------- reference model
Key = tuple[int, tuple[int, ...]]  # (namespace index, all tokens up to the block's end)


class ModelSeq:
    def __init__(self, ns: int, tokens: list[int], request_id: str | None) -> None:
        self.ns, self.tokens, self.request_id = ns, tokens, request_id
        self.block_table: list[int] = []
        self.num_cached_tokens = 0


class Model:
    """The same policy with plain lists and exact token prefixes instead of hashes."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.free = list(range(num_blocks))
        self.ref = [0] * num_blocks
        self.content: dict[int, Key] = {}
        self.serving: dict[Key, int] = {}
        self.reserved: dict[str, list[int]] = {}

    def key(self, seq: ModelSeq, i: int) -> Key:
        return (seq.ns, tuple(seq.tokens[:(i + 1) * self.bs]))

    def capacity(self, seq: ModelSeq) -> int:
        own = self.reserved.get(seq.request_id, []) if seq.request_id else []
        return len(self.free) + len(own)

    def pop_free(self) -> int:
        b = self.free.pop(0)
        k = self.content.pop(b, None)
        if k is not None and self.serving.get(k) == b:
            del self.serving[k]
        return b

    def fresh(self, seq: ModelSeq) -> int:
        own = self.reserved.get(seq.request_id) if seq.request_id else None
        b = own.pop() if own else self.pop_free()
        self.ref[b] = 1
        seq.block_table.append(b)
        return b

    def register(self, b: int, k: Key) -> None:
        self.content[b] = k
        self.serving[k] = b

    def allocate(self, seq: ModelSeq) -> bool:
        needed = -(-len(seq.tokens) // self.bs)
        if needed > self.capacity(seq):
            return False
        full = len(seq.tokens) // self.bs
        max_hits = (len(seq.tokens) - 1) // self.bs if seq.tokens else 0  # the last token is computed
        i = 0
        while i < max_hits and self.key(seq, i) in self.serving:
            b = self.serving[self.key(seq, i)]
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1
            seq.block_table.append(b)
            i += 1
        seq.num_cached_tokens = i * self.bs
        for j in range(i, needed):
            b = self.fresh(seq)
            if j < full:
                self.register(b, self.key(seq, j))
        return True

    def can_append(self, seq: ModelSeq) -> bool:
        need = -(-len(seq.tokens) // self.bs) - len(seq.block_table)
        return need <= 0 or need <= self.capacity(seq)

    def may_append(self, seq: ModelSeq) -> bool:
        if not self.can_append(seq):
            return False
        while len(seq.block_table) < -(-len(seq.tokens) // self.bs):
            self.fresh(seq)
        for i in range(len(seq.tokens) // self.bs):
            if self.content.get(seq.block_table[i]) != self.key(seq, i):
                self.register(seq.block_table[i], self.key(seq, i))
        return True

    def deallocate(self, seq: ModelSeq) -> None:
        for b in reversed(seq.block_table):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free.append(b)
        seq.block_table.clear()
        seq.num_cached_tokens = 0

    def reserve(self, rid: str, n: int) -> bool:
        if n > len(self.free):
            return False
        self.reserved.setdefault(rid, []).extend(self.pop_free() for _ in range(n))
        return True

    def release(self, rid: str) -> int:
        blocks = self.reserved.pop(rid, [])
        self.free = blocks + self.free
        return len(blocks)

    def state(self, b: int) -> BlockState:
        if self.ref[b] > 1:
            return BlockState.SHARED
        if self.ref[b] == 1:
            return BlockState.IN_USE
        if b in self.free:
            k = self.content.get(b)
            return BlockState.CACHED if k is not None and self.serving.get(k) == b else BlockState.FREE
        return BlockState.RESERVED


PREFIXES = [(), (1,), (1, 2), (1, 2, 3, 4, 5, 6), (1, 2, 3, 0), (2, 2, 2, 2, 2)]
Pair = tuple[SeqState, ModelSeq]


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pending: list[Pair] = []
        self.active: list[Pair] = []
        self.held: set[BlockHash] = set()
        self.next_id = 0

    @initialize(num_blocks=st.integers(1, 12), block_size=st.integers(1, 4))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.nss = [ns_of(block_size), ns_of(block_size, salt=b"tenant-b")]
        self.real = BlockManager(self.nss[0], num_blocks)
        self.model = Model(num_blocks, block_size)

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 2), max_size=5),
          ns=st.sampled_from([0, 0, 1]), rid=st.sampled_from([None, "r0", "r1"]))
    def new_seq(self, prefix: tuple[int, ...], tail: list[int], ns: int, rid: str | None) -> None:
        tokens = [*prefix, *tail]
        real = SeqState(self.next_id, tokens, request_id=rid, namespace=self.nss[ns] if ns else None)
        self.pending.append((real, ModelSeq(ns, list(tokens), rid)))
        self.next_id += 1

    @precondition(lambda self: self.pending)
    @rule(i=st.integers(0, 99))
    def allocate(self, i: int) -> None:
        real, model = self.pending[i % len(self.pending)]
        cached = self.real.match_prefix(model.tokens, real.namespace)
        assert self.real.can_allocate(real) == (-(-len(model.tokens) // self.model.bs)
                                                <= self.model.capacity(model))
        ok = self.real.allocate(real)
        assert ok == self.model.allocate(model)
        if ok:  # the same walk: allocate hits what match_prefix saw, short of the last token's block
            assert real.num_cached_tokens == min(cached, (len(model.tokens) - 1) // self.model.bs * self.model.bs
                                                 if model.tokens else 0)
            self.pending.remove((real, model))
            self.active.append((real, model))

    @precondition(lambda self: self.active)
    @rule(i=st.integers(0, 99), tokens=st.lists(st.integers(0, 2), min_size=1, max_size=3),
          one_by_one=st.booleans())
    def append(self, i: int, tokens: list[int], one_by_one: bool) -> None:
        real, model = self.active[i % len(self.active)]
        batches = [[t] for t in tokens] if one_by_one else [tokens]
        for batch in batches:
            for t in batch:
                real.append_token(t)
                model.tokens.append(t)
            assert self.real.can_append(real) == self.model.can_append(model)
            ok = self.real.may_append(real)
            assert ok == self.model.may_append(model)
            if not ok:
                break

    @precondition(lambda self: self.active)
    @rule(i=st.integers(0, 99))
    def deallocate(self, i: int) -> None:
        pair = self.active.pop(i % len(self.active))
        self.real.deallocate(pair[0])
        self.model.deallocate(pair[1])
        self.pending.append(pair)  # may be rescheduled later, like a preempted sequence

    @rule(rid=st.sampled_from(["r0", "r1"]), n=st.integers(0, 4))
    def reserve(self, rid: str, n: int) -> None:
        assert self.real.reserve(rid, n) == self.model.reserve(rid, n)

    @rule(rid=st.sampled_from(["r0", "r1"]))
    def release(self, rid: str) -> None:
        assert self.real.release(rid) == self.model.release(rid)

    def hash_of(self, k: Key) -> BlockHash:
        return block_hashes(self.nss[k[0]], list(k[1]))[-1]

    @invariant()
    def agrees_with_model(self) -> None:
        if not hasattr(self, "real"):
            return
        real, model = self.real, self.model
        real.check()
        for r, m in self.active + self.pending:
            assert r.block_table == m.block_table
            assert r.num_cached_tokens == m.num_cached_tokens
        for r, m in self.active:
            expected = block_hashes(self.nss[m.ns], m.tokens)
            got = real.seq_block_hashes(r)
            assert got == expected[:len(got)]
            if len(r.block_table) == -(-len(m.tokens) // model.bs):  # may_append is up to date
                assert got == expected
        counts = [0] * real.num_blocks
        for r, _ in self.active:
            for b in r.block_table:
                counts[b] += 1
        assert [real.ref_count(b) for b in range(real.num_blocks)] == counts == model.ref
        assert real.free_block_ids() == model.free
        assert [real.block_state(b) for b in range(real.num_blocks)] == \
               [model.state(b) for b in range(real.num_blocks)]
        events = real.take_events()
        for ev in events:
            if isinstance(ev, BlockStored):
                parent = ev.parent_hash
                for h, b in zip(ev.block_hashes, ev.block_ids, strict=True):
                    k = model.content[b]
                    tokens = tokens_to_bytes(list(k[1][-model.bs:]))
                    assert h == self.hash_of(k) == chain_hash(parent, tokens) == real.block_hash(b)
                    parent = h
        self.held = registered(events, self.held)
        assert self.held == {self.hash_of(k) for k in model.serving}
        stats = real.stats()
        assert stats.num_available == len(model.free)
        assert stats.num_in_use == sum(1 for r in model.ref if r)
        assert stats.num_reserved == sum(len(v) for v in model.reserved.values())
        assert stats.num_cached == sum(1 for b in model.free if model.state(b) is BlockState.CACHED)
        assert stats.num_registered_hashes == len(model.serving)


PoolMachine.TestCase.settings = settings(max_examples=250, stateful_step_count=40, deadline=None)
TestPool = PoolMachine.TestCase
