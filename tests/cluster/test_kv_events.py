"""KV events: the bytes a vLLM-format consumer decodes, the restart view, and replay over real ZMQ
sockets (ipc under tmp_path). The decoder here is written from the format description alone
(plain msgpack and positions), not from the encoder's classes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from cluster.kv_events import KvEventLog
from cluster.kv_events_zmq import KvEventPublisher
from fabric.config import EventsConfig
from fabric.events import EventKind, StoreEvents
from fabric.keys import BlockAddress, BlockHash, Namespace, block_hashes
from fabric.layout import KVLayout

NS = Namespace("events-model", KVLayout.mha(2, 2, 4, "f16"), block_size=4)
TOKENS = list(range(100, 116))            # 4 full blocks
HASHES = block_hashes(NS, TOKENS)


def u64(h: bytes) -> int:
    return int.from_bytes(h[-8:], "big")


def decode(payload: bytes) -> tuple[float, list[dict[str, Any]], int]:
    """EventBatch = [ts, events, dp_rank]; each event an array whose element 0 is its tag."""
    ts, events, rank = msgpack.unpackb(payload, raw=False)
    out = []
    for e in events:
        if e[0] == "BlockStored":
            out.append({"type": e[0], "block_hashes": e[1], "parent_block_hash": e[2], "token_ids": e[3],
                        "block_size": e[4], "lora_id": e[5], "medium": e[6]})
        elif e[0] == "BlockRemoved":
            out.append({"type": e[0], "block_hashes": e[1], "medium": e[2]})
        else:
            assert e == ["AllBlocksCleared"]
            out.append({"type": e[0]})
    return ts, out, rank


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
                       "token_ids": TOKENS, "block_size": 4, "lora_id": None, "medium": "CPU"}]


def test_a_chain_tail_names_its_parent_and_a_block_without_tokens_goes_alone() -> None:
    log = KvEventLog(block_size=4, buffer_batches=8)
    log.note_chain(HASHES[2:], HASHES[1], TOKENS[8:], 4)
    log.note_chain(HASHES[:1], None, None, 4)          # named by id: no tokens
    batch = log.apply(stored([HASHES[0], HASHES[2], HASHES[3]]), 1.0)
    assert batch is not None
    _, events, _ = decode(batch.payload)
    assert [(e["block_hashes"], e["parent_block_hash"], e["token_ids"]) for e in events] == [
        ([u64(HASHES[0])], None, []),
        ([u64(HASHES[2]), u64(HASHES[3])], u64(HASHES[1]), TOKENS[8:])]


def test_a_block_is_removed_only_when_its_last_layer_leaves_in_the_medium_it_was_announced() -> None:
    log = KvEventLog(block_size=4, buffer_batches=8)
    log.apply(stored(HASHES[:2]), 1.0)
    assert log.apply(removed(HASHES[:1], layers=(0,)), 2.0) is None        # layer 1 is still held
    batch = log.apply(removed(HASHES[:2], layers=(1,)), 3.0)
    assert batch is not None
    assert decode(batch.payload)[1] == [{"type": "BlockRemoved", "block_hashes": [u64(HASHES[0])], "medium": "CPU"}]
    assert set(log.held) == {HASHES[1]}


def test_a_restart_clears_first_then_lists_held_ssd_blocks_and_sequence_numbers_never_go_back() -> None:
    log = KvEventLog(block_size=4, buffer_batches=8)
    first = log.apply(stored(HASHES[:1]), 1.0)
    again = log.reset([BlockAddress(h, layer) for h in HASHES[:3] for layer in (0, 1)], 2.0, medium="DISK")
    assert first is not None and again.seq == first.seq + 1
    _, events, _ = decode(again.payload)
    assert events[0] == {"type": "AllBlocksCleared"}
    assert [(e["block_hashes"], e["medium"]) for e in events[1:]] == [
        ([u64(HASHES[0])], "CPU"), ([u64(HASHES[1])], "DISK"), ([u64(HASHES[2])], "DISK")]


def test_an_overflowed_drain_must_be_a_reset() -> None:
    with pytest.raises(ValueError, match="reset"):
        KvEventLog(block_size=4, buffer_batches=8).apply(StoreEvents((), True), 1.0)


def replay(pub: KvEventPublisher, start: int) -> list[tuple[int, bytes]]:
    """Ask `pub`'s replay socket for batches from `start` (the publisher answers on this thread)."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    for _ in range(1000):
        pub.serve_replays()
        if not dealer.poll(10):
            continue
        while dealer.poll(0):
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if int.from_bytes(seq, "big", signed=True) == -1:
                dealer.close(linger=0)
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    raise AssertionError("no end-of-replay marker")


@pytest.fixture
def publisher(tmp_path: Path) -> Any:
    cfg = EventsConfig(enabled=True, endpoint=f"ipc://{tmp_path}/{{node}}.pub",
                       replay_endpoint=f"ipc://{tmp_path}/{{node}}.replay", topic="kv", buffer_batches=64)
    pub = KvEventPublisher(cfg, "n1", block_size=4)
    yield pub
    pub.close()


def test_replay_after_a_dropped_subscriber_returns_exactly_the_missed_batches(publisher: KvEventPublisher) -> None:
    ctx = zmq.Context.instance()
    assert publisher.endpoint.endswith("n1.pub")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(publisher.endpoint)
    publisher.start([])
    # The subscription reaches the PUB socket asynchronously: drain single blocks until one arrives.
    published: dict[int, BlockHash] = {}
    fresh = block_hashes(NS, list(range(4 * 64)))

    def publish_one() -> None:
        published[publisher.log.next_seq] = fresh[len(published)]
        publisher.drain(stored([fresh[len(published) - 1]]), list)
    last_read = -1
    while last_read < 0:
        publish_one()
        if sub.poll(100):
            topic, seq, _ = sub.recv_multipart()
            last_read = int.from_bytes(seq, "big")
    assert topic == b"kv"
    sub.close(linger=0)                                 # the subscriber drops; what it did not read is missed
    for _ in range(3):
        publish_one()
    missed = [s for s in sorted(published) if s > last_read]
    assert len(missed) >= 3
    got = replay(publisher, last_read + 1)
    assert [seq for seq, _ in got] == missed
    assert [decode(p)[1][0]["block_hashes"] for _, p in got] == [[u64(published[s])] for s in missed]
    assert replay(publisher, missed[-1] + 1) == []


def test_replay_from_zero_starts_with_all_blocks_cleared_and_serves_only_the_kept_batches(tmp_path: Path) -> None:
    cfg = EventsConfig(enabled=True, endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                       buffer_batches=2)
    pub = KvEventPublisher(cfg, "n2", block_size=4)
    try:
        pub.start([BlockAddress(HASHES[0], 0)])
        first = replay(pub, 0)
        assert [seq for seq, _ in first] == [0]
        assert [e["type"] for e in decode(first[0][1])[1]] == ["AllBlocksCleared", "BlockStored"]
        for h in HASHES[1:]:
            pub.drain(stored([h]), list)
        assert [seq for seq, _ in replay(pub, 0)] == [2, 3]   # buffer of 2
    finally:
        pub.close()


def test_a_malformed_replay_request_is_answered_with_the_end_marker(publisher: KvEventPublisher) -> None:
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(publisher.replay_endpoint)
    dealer.send_multipart([b"", b"\x01\x02"])           # not an 8-byte sequence number
    while not publisher.num_bad_requests:
        publisher.serve_replays()
        dealer.poll(10)
    assert dealer.poll(5000)
    assert dealer.recv_multipart() == [b"", (-1).to_bytes(8, "big", signed=True), b""]
    assert publisher.num_bad_requests == 1
    dealer.close(linger=0)


def test_a_publisher_connects_to_a_subscriber_that_binds_and_names_its_node_in_the_topic(tmp_path: Path) -> None:
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)                           # a central indexer binds, as llm-d's does
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.bind("tcp://127.0.0.1:*")
    cfg = EventsConfig(enabled=True, endpoint=sub.getsockopt_string(zmq.LAST_ENDPOINT),
                       topic="kv@{node}@events-model")
    pub = KvEventPublisher(cfg, "n3", block_size=4)
    try:
        got: list[bytes] = []
        fresh = block_hashes(NS, list(range(4 * 64)))
        while not got:
            pub.drain(stored([fresh.pop()]), list)
            if sub.poll(100):
                got = sub.recv_multipart()
        assert got[0] == b"kv@n3@events-model"
    finally:
        pub.close()
        sub.close(linger=0)


def test_an_endpoint_in_use_is_a_clear_error_naming_it() -> None:
    taken = zmq.Context.instance().socket(zmq.PUB)
    taken.bind("tcp://127.0.0.1:*")
    in_use = taken.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        cfg = EventsConfig(enabled=True, endpoint="tcp://127.0.0.1:*", replay_endpoint=in_use)
        with pytest.raises(OSError, match=f"cannot open KV event endpoint {in_use}"):
            KvEventPublisher(cfg, "n1", block_size=4)
    finally:
        taken.close(linger=0)


def test_chains_noted_but_never_stored_are_bounded_oldest_first() -> None:
    log = KvEventLog(block_size=4, buffer_batches=8, max_hints=2)
    log.note_chain(HASHES[:3], None, TOKENS[:12], 4)      # the hint of HASHES[0] is dropped
    batch = log.apply(stored(HASHES[:3]), 1.0)
    assert batch is not None
    assert [(e["block_hashes"], e["token_ids"]) for e in decode(batch.payload)[1]] == [
        ([u64(HASHES[0])], []), ([u64(HASHES[1]), u64(HASHES[2])], TOKENS[4:12])]
