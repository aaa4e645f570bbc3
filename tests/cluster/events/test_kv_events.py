"""KV events, pure: the bytes vLLM 0.32's own decoder reads (and byte-equal to what its encoder
writes for the same events), an independent plain-msgpack reading, chains, removals, and the view
a restarted node re-announces from its persisted chains."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest

from cluster.events.log import ChainHint, KvEventLog
from fabric.event_chains import EventChains
from fabric.events import EventKind, StoreEvents
from fabric.keys import BlockAddress, BlockHash, Namespace, block_hashes
from fabric.layout import KVLayout

NS = Namespace("events-model", KVLayout.mha(2, 2, 4, "f16"), block_size=4)
TOKENS = list(range(100, 116))            # 4 full blocks
HASHES = block_hashes(NS, TOKENS)


def u64(h: bytes) -> int:
    return int.from_bytes(h[-8:], "big")


def decode(payload: bytes) -> tuple[float, list[dict[str, Any]], int]:
    """Written from the format description alone: an array [ts, events, rank], each event a map
    tagged under "type"."""
    ts, events, rank = msgpack.unpackb(payload, raw=False)
    assert all(isinstance(e, dict) and isinstance(e["type"], str) for e in events)
    return ts, events, rank


def stored(hashes: list[BlockHash], layers: int = 2) -> StoreEvents:
    return StoreEvents(tuple((EventKind.STORED, BlockAddress(h, layer)) for h in hashes for layer in range(layers)),
                       False)


def removed(hashes: list[BlockHash], layers: tuple[int, ...] = (0, 1)) -> StoreEvents:
    return StoreEvents(tuple((EventKind.REMOVED, BlockAddress(h, layer)) for h in hashes for layer in layers), False)


def test_a_stored_prompt_is_one_block_stored_chain_with_its_tokens() -> None:
    log = KvEventLog(block_size=4, buffer_batches=8)
    log.note_chain(HASHES, None, TOKENS, 4)
    batch = log.apply(stored(HASHES), 12.5)
    assert batch is not None and batch.seq == 0
    ts, events, rank = decode(batch.payload)
    assert (ts, rank) == (12.5, 0)
    assert events == [{"type": "BlockStored", "block_hashes": [u64(h) for h in HASHES], "parent_block_hash": None,
                       "token_ids": TOKENS, "block_size": 4, "lora_id": None, "medium": "CPU", "lora_name": None,
                       "group_idx": 0, "kv_cache_spec_kind": "full_attention", "locality": "LOCAL"}]


def test_vllms_own_decoder_reads_every_event_kind_and_its_encoder_writes_the_same_bytes() -> None:
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    import msgspec

    log = KvEventLog(block_size=4, buffer_batches=8)
    log.note_chain(HASHES[:2], None, TOKENS[:8], 4, extra_keys=[("salt-a",), ("salt-a",)], lora_name="ad1")
    log.note_chain(HASHES[2:3], HASHES[1], None, 4)          # tokens withheld
    log.note_chain(HASHES[3:], HASHES[2], TOKENS[12:], 4, spec_kind="mla_attention")
    batches = [log.apply(stored(HASHES), 1.5), log.apply(removed(HASHES[:1]), 2.5),
               log.reset([BlockAddress(h, 0) for h in HASHES[1:]], 3.5, medium="STORAGE")]
    decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
    got = [decoder.decode(b.payload) for b in batches if b is not None]
    assert len(got) == 3
    stored_events = got[0].events
    assert [type(e).__name__ for e in stored_events] == ["BlockStored"] * 3
    first, bare, last = stored_events
    assert (first.block_hashes, first.parent_block_hash, first.token_ids, first.lora_name, first.extra_keys) == (
        [u64(h) for h in HASHES[:2]], None, TOKENS[:8], "ad1", [("salt-a",), ("salt-a",)])
    assert (bare.block_hashes, bare.parent_block_hash, bare.token_ids, bare.block_size) == (
        [u64(HASHES[2])], u64(HASHES[1]), [], 0)
    assert (last.parent_block_hash, last.token_ids, last.kv_cache_spec_kind) == (
        u64(HASHES[2]), TOKENS[12:], "mla_attention")
    assert all(e.medium == kv_events.MEDIUM_CPU and e.group_idx == 0 and e.locality == "LOCAL"
               for e in stored_events)
    assert got[1].events == [kv_events.BlockRemoved(block_hashes=[u64(HASHES[0])], medium=kv_events.MEDIUM_CPU,
                                                    group_idx=0, locality="LOCAL")]
    assert isinstance(got[2].events[0], kv_events.AllBlocksCleared)
    assert {e.medium for e in got[2].events[1:]} == {kv_events.MEDIUM_CPU}     # announced before, kept
    for batch, decoded in zip(batches, got, strict=True):
        assert batch is not None and msgspec.msgpack.encode(decoded) == batch.payload


def test_a_chain_tail_names_its_parent_and_a_block_without_tokens_goes_alone() -> None:
    log = KvEventLog(block_size=4, buffer_batches=8)
    log.note_chain(HASHES[2:], HASHES[1], TOKENS[8:], 4)
    log.note_chain(HASHES[:1], None, None, 4)          # named by id: no tokens
    batch = log.apply(stored([HASHES[0], HASHES[2], HASHES[3]]), 1.0)
    assert batch is not None
    _, events, _ = decode(batch.payload)
    assert [(e["block_hashes"], e["parent_block_hash"], e["token_ids"], e["block_size"]) for e in events] == [
        ([u64(HASHES[0])], None, [], 0),
        ([u64(HASHES[2]), u64(HASHES[3])], u64(HASHES[1]), TOKENS[8:], 4)]


def test_a_block_is_removed_only_when_its_last_layer_leaves_in_the_medium_it_was_announced() -> None:
    log = KvEventLog(block_size=4, buffer_batches=8)
    log.apply(stored(HASHES[:2]), 1.0)
    assert log.apply(removed(HASHES[:1], layers=(0,)), 2.0) is None        # layer 1 is still held
    batch = log.apply(removed(HASHES[:2], layers=(1,)), 3.0)
    assert batch is not None
    assert decode(batch.payload)[1] == [{"type": "BlockRemoved", "block_hashes": [u64(HASHES[0])], "medium": "CPU",
                                         "group_idx": 0, "locality": "LOCAL"}]
    assert set(log.held) == {HASHES[1]}


def test_an_overflowed_drain_must_be_a_reset() -> None:
    with pytest.raises(ValueError, match="reset"):
        KvEventLog(block_size=4, buffer_batches=8).apply(StoreEvents((), True), 1.0)


def test_chains_noted_but_never_stored_are_bounded_oldest_first() -> None:
    log = KvEventLog(block_size=4, buffer_batches=8, max_hints=2)
    log.note_chain(HASHES[:3], None, TOKENS[:12], 4)      # the hint of HASHES[0] is dropped
    batch = log.apply(stored(HASHES[:3]), 1.0)
    assert batch is not None
    assert [(e["block_hashes"], e["token_ids"]) for e in decode(batch.payload)[1]] == [
        ([u64(HASHES[0])], []), ([u64(HASHES[1]), u64(HASHES[2])], TOKENS[4:12])]


def test_a_restarted_log_re_announces_surviving_blocks_with_their_tokens_and_parents(tmp_path: Path) -> None:
    path = tmp_path / "chains"
    chains = EventChains(path, ChainHint.unpack)
    log = KvEventLog(block_size=4, buffer_batches=8, chains=chains)
    log.note_chain(HASHES, None, TOKENS, 4)
    log.apply(stored(HASHES), 1.0)
    log.apply(removed(HASHES[3:]), 2.0)                  # gone before the restart: its row goes too
    chains.close()
    chains = EventChains(path, ChainHint.unpack)           # a new process, the same folder
    assert len(chains) == 3
    again = KvEventLog(block_size=4, buffer_batches=8, chains=chains)
    survivors = [BlockAddress(h, layer) for h in (HASHES[0], HASHES[2]) for layer in (0, 1)]   # HASHES[1]: RAM only
    batch = again.reset(survivors, 3.0, medium="STORAGE")
    assert batch.seq == 0
    _, events, _ = decode(batch.payload)
    assert events[0] == {"type": "AllBlocksCleared"}
    assert [(e["block_hashes"], e["parent_block_hash"], e["token_ids"], e["medium"]) for e in events[1:]] == [
        ([u64(HASHES[0])], None, TOKENS[:4], "STORAGE"),
        ([u64(HASHES[2])], u64(HASHES[1]), TOKENS[8:12], "STORAGE")]
    assert len(chains) == 2                              # rows of blocks that did not survive are dropped
    chains.close()


def test_replay_reads_a_bounded_window_from_any_start() -> None:
    log = KvEventLog(block_size=4, buffer_batches=3)
    for i, h in enumerate(HASHES):
        log.apply(stored([h]), float(i))
    assert [(first, [b.seq for b in out]) for first, out in (log.replay(0, 10), log.replay(2, 1), log.replay(9, 5))] \
        == [(1, [1, 2, 3]), (1, [2]), (1, [])]
