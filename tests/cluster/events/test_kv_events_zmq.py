"""KV events over real ZMQ sockets: live batches and replays framed as vLLM 0.32's publisher frames
them (a REQ client as in vLLM's subscriber example, and a DEALER), replays after a gap and after a
restart, the markers that name whatever a reply leaves out, and CURVE: a consumer not on the
allow-list gets nothing."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
import zmq.auth

from cluster.events.publisher import KvEventPublisher
from cluster.events.replay import END_SEQ, GAP_SEQ
from fabric.config import ConfigError, EventsConfig
from fabric.events import EventKind, StoreEvents
from fabric.keys import BlockAddress, BlockHash, Namespace, block_hashes
from fabric.layout import KVLayout

NS = Namespace("events-zmq", KVLayout.mha(1, 1, 4, "f16"), block_size=4)
FRESH = block_hashes(NS, list(range(4 * 256)))
CTX: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()


def stored(h: BlockHash) -> StoreEvents:
    return StoreEvents(((EventKind.STORED, BlockAddress(h, 0)),), False)


def config(tmp_path: Path, **kw: Any) -> EventsConfig:
    return EventsConfig(enabled=True, endpoint=f"ipc://{tmp_path}/{{node}}.pub",
                        replay_endpoint=f"ipc://{tmp_path}/{{node}}.replay", topic="kv", **kw)


def publish(pub: KvEventPublisher, n: int, tokens: bool = True) -> None:
    for _ in range(n):
        i = pub.log.next_seq
        if tokens:
            pub.note_chain([FRESH[i]], FRESH[i - 1] if i else None, list(range(4 * i, 4 * i + 4)), 4)
        pub.drain(stored(FRESH[i]), list)


def req_replay(endpoint: str, start: int, **socket_options: Any
               ) -> tuple[list[tuple[int, bytes]], list[dict[str, Any]]]:
    """vLLM's subscriber example's shape: a REQ socket sends a sequence number as 8 bytes and reads
    the reply's first message ([topic, seq, payload], or END [b"", END_SEQ, b""]). A REQ socket
    reads one message per request, so each request gets a fresh socket and asks from the next."""
    out: list[tuple[int, bytes]] = []
    markers: list[dict[str, Any]] = []
    while True:
        req = CTX.socket(zmq.REQ)
        for key, value in socket_options.items():
            setattr(req, key, value)
        req.connect(endpoint)
        try:
            req.send(start.to_bytes(8, "big"))
            assert req.poll(5000), "replay request unanswered"
            topic, seq, payload = req.recv_multipart()
        finally:
            req.close(linger=0)
        if seq == END_SEQ:
            assert (topic, payload) == (b"", b"")
            return out, markers
        if seq == GAP_SEQ:
            markers.append(msgpack.unpackb(payload))
            start = markers[-1]["first"]
            if markers[-1]["reason"] == "rate_limited":
                time.sleep(0.05)                          # the client backs off, as the marker asks
            continue
        assert topic == b"kv"
        out.append((int.from_bytes(seq, "big"), payload))
        start = out[-1][0] + 1


def dealer_reply(endpoint: str | zmq.Socket[bytes], start: int, **socket_options: Any
                 ) -> list[tuple[bytes, int, bytes]]:
    """One whole reply to a DEALER (a new one, or the one given): (topic, signed seq, payload) up to
    and including END."""
    dealer = CTX.socket(zmq.DEALER) if isinstance(endpoint, str) else endpoint
    for key, value in socket_options.items():
        setattr(dealer, key, value)
    if isinstance(endpoint, str):
        dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while dealer.poll(5000):
            empty, topic, seq, payload = dealer.recv_multipart()
            assert empty == b""
            out.append((topic, int.from_bytes(seq, "big", signed=True), payload))
            if seq == END_SEQ:
                return out
        raise AssertionError("no END after a replay")
    finally:
        if isinstance(endpoint, str):
            dealer.close(linger=0)


@pytest.fixture
def publisher(tmp_path: Path) -> Iterator[KvEventPublisher]:
    pub = KvEventPublisher(config(tmp_path, buffer_batches=64), "n1", block_size=4, chains_path=tmp_path / "chains")
    yield pub
    pub.close()


def test_live_batches_missed_by_a_subscriber_replay_identically_with_contiguous_numbers(
        publisher: KvEventPublisher) -> None:
    sub = CTX.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(publisher.endpoint)
    publisher.start([])
    live: dict[int, bytes] = {}
    while not live:                                   # the subscription reaches the PUB asynchronously
        publish(publisher, 1)
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv"
            live[int.from_bytes(seq, "big")] = payload
    publish(publisher, 5)
    while len(live) < 6:
        assert sub.poll(5000)
        _, seq, payload = sub.recv_multipart()
        live[int.from_bytes(seq, "big")] = payload
    sub.close(linger=0)
    first = min(live)
    publish(publisher, 3)                              # missed: nobody is subscribed
    got, markers = req_replay(publisher.replay_endpoint, first)
    assert not markers
    assert [s for s, _ in got] == list(range(first, publisher.log.next_seq))
    assert {s: p for s, p in got if s in live} == live
    whole = dealer_reply(publisher.replay_endpoint, first)
    assert [(s, p) for _, s, p in whole[:-1]] == got and whole[-1] == (b"", -1, b"")


def test_after_a_restart_a_consumer_rebuilds_the_held_set_with_parents_and_tokens(tmp_path: Path) -> None:
    pub = KvEventPublisher(config(tmp_path), "n1", block_size=4, chains_path=tmp_path / "chains")
    pub.start([])
    publish(pub, 6)
    pub.close()
    survivors = [BlockAddress(h, 0) for h in FRESH[1:6]]     # FRESH[0] was in RAM only
    pub = KvEventPublisher(config(tmp_path), "n1", block_size=4, chains_path=tmp_path / "chains")
    try:
        pub.start(survivors)
        publish(pub, 0)
        got, markers = req_replay(pub.replay_endpoint, 0)
        assert not markers and [s for s, _ in got] == [0]      # a new incarnation counts from 0
        held: dict[int, tuple[int | None, list[int]]] = {}
        for _, payload in got:
            for event in msgpack.unpackb(payload)[1]:
                if event["type"] == "AllBlocksCleared":
                    held.clear()
                elif event["type"] == "BlockStored":
                    for i, h in enumerate(event["block_hashes"]):
                        parent = event["parent_block_hash"] if i == 0 else event["block_hashes"][i - 1]
                        held[h] = (parent, event["token_ids"][4 * i:4 * i + 4])
        u64 = [int.from_bytes(h[-8:], "big") for h in FRESH]
        assert held == {u64[i]: (u64[i - 1], list(range(4 * i, 4 * i + 4))) for i in range(1, 6)}
    finally:
        pub.close()


def test_what_a_reply_leaves_out_is_named_by_a_marker(tmp_path: Path) -> None:
    pub = KvEventPublisher(config(tmp_path, buffer_batches=6, replay_max_batches=4, replay_rate=1.0), "n1",
                           block_size=4)
    try:
        publish(pub, 10)                                 # 0..3 are older than the buffer of 6
        dealer = CTX.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        reply = dealer_reply(dealer, 1)
        gaps = [msgpack.unpackb(p) for _, s, p in reply if s == -2]
        assert [s for _, s, _ in reply] == [-2, 4, 5, 6, 7, -2, -1]
        assert gaps == [{"reason": "expired", "first": 1, "last": 3}, {"reason": "more", "first": 8, "last": 9}]
        # That reply spent this requester's share: asking on at once, it is told to wait, never cut silently.
        reply = dealer_reply(dealer, 8)
        dealer.close(linger=0)
        assert [(s, msgpack.unpackb(p) if p else p) for _, s, p in reply] == [
            (-2, {"reason": "rate_limited", "first": 8, "last": 9}), (-1, b"")]
        got, markers = req_replay(pub.replay_endpoint, 8)      # another requester has its own share
        assert [s for s, _ in got] == [8, 9] and not markers
    finally:
        pub.close()


def test_a_requester_that_reads_too_slowly_gets_no_end_and_then_a_marker(tmp_path: Path) -> None:
    cfg = EventsConfig(enabled=True, endpoint=f"inproc://pub-{tmp_path.name}",
                       replay_endpoint=f"inproc://replay-{tmp_path.name}", topic="kv", hwm=2,
                       replay_max_batches=40)
    pub = KvEventPublisher(cfg, "n1", block_size=4)
    dealer = CTX.socket(zmq.DEALER)
    dealer.rcvhwm = 1
    dealer.connect(pub.replay_endpoint)
    try:
        publish(pub, 30)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert pub.replays is not None
        deadline = time.monotonic() + 10
        while pub.replays.num_cut_replies == 0:
            assert time.monotonic() < deadline, "the reply was never cut"
            time.sleep(0.01)
        first = []
        while dealer.poll(200):
            first.append(int.from_bytes(dealer.recv_multipart()[2], "big", signed=True))
        assert first and -1 not in first and first == list(range(len(first)))
        dealer.send_multipart([b"", (len(first)).to_bytes(8, "big")])
        assert dealer.poll(5000)
        _, _, seq, payload = dealer.recv_multipart()
        assert seq == GAP_SEQ and msgpack.unpackb(payload) == {"reason": "hwm", "first": len(first), "last": 29}
    finally:
        dealer.close(linger=0)
        pub.close()


def test_only_consumers_on_the_allow_list_receive_events_or_replays(tmp_path: Path) -> None:
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    keys.mkdir()
    allowed.mkdir()
    zmq.auth.create_certificates(keys, "node")
    router_pub, _ = zmq.auth.create_certificates(keys, "router")
    zmq.auth.create_certificates(keys, "stranger")
    (allowed / "router.key").write_bytes(Path(router_pub).read_bytes())
    cfg = EventsConfig(enabled=True, endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv",
                       curve_secret_key=str(keys / "node.key_secret"), curve_allow_dir=str(allowed))
    pub = KvEventPublisher(cfg, "n1", block_size=4, tenancy_required=True)
    server_key = pub.endpoints()["curve_public_key"].encode()

    def curve(name: str | None) -> dict[str, Any]:
        if name is None:
            return {}
        public, secret = zmq.auth.load_certificate(keys / f"{name}.key_secret")
        return {"curve_publickey": public, "curve_secretkey": secret, "curve_serverkey": server_key}
    subs = {}
    for name in ("router", "stranger", None):
        sub = CTX.socket(zmq.SUB)
        for key, value in curve(name).items():
            setattr(sub, key, value)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        subs[name] = sub
    try:
        got = 0
        while got < 20:                                   # the allowed consumer reads 20 batches ...
            publish(pub, 1)
            while subs["router"].poll(20):
                subs["router"].recv_multipart()
                got += 1
        assert not subs["stranger"].poll(0) and not subs[None].poll(0)   # ... the others nothing
        replay = dealer_reply(pub.replay_endpoint, 0, **curve("router"))
        assert len(replay) == pub.log.next_seq + 1
        for name in ("stranger", None):
            dealer = CTX.socket(zmq.DEALER)
            for key, value in curve(name).items():
                setattr(dealer, key, value)
            dealer.connect(pub.replay_endpoint)
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            assert not dealer.poll(500)                   # refused by the ZAP handler: no reply at all
            dealer.close(linger=0)
        assert pub.replays is not None and pub.replays.num_requests == 1
    finally:
        for sub in subs.values():
            sub.close(linger=0)
        pub.close()


def test_start_up_refuses_tenants_token_ids_on_an_unauthenticated_tcp_endpoint(tmp_path: Path) -> None:
    cfg = EventsConfig(enabled=True, endpoint="tcp://127.0.0.1:*", topic="kv")
    with pytest.raises(ConfigError, match=r"tenancy.*token ids"):
        KvEventPublisher(cfg, "n1", block_size=4, tenancy_required=True)
    cfg.token_ids_tenants = []                            # hashes only: allowed
    KvEventPublisher(cfg, "n1", block_size=4, tenancy_required=True).close()
    cfg = EventsConfig(enabled=True, endpoint="tcp://0.0.0.0:*")
    with pytest.raises(ConfigError, match="reachable from other hosts"):
        KvEventPublisher(cfg, "n1", block_size=4)


def test_token_ids_are_shown_only_for_tenants_that_opted_in(tmp_path: Path) -> None:
    pub = KvEventPublisher(config(tmp_path, token_ids_tenants=["alice"]), "n1", block_size=4,
                           tenancy_required=True)
    try:
        assert [pub.shows_tokens(t) for t in (frozenset({"alice"}), frozenset({"bob"}), frozenset(), None)] == [
            True, False, False, False]
    finally:
        pub.close()


def test_a_malformed_replay_request_is_answered_with_the_end_marker(publisher: KvEventPublisher) -> None:
    dealer = CTX.socket(zmq.DEALER)
    dealer.connect(publisher.replay_endpoint)
    try:
        dealer.send_multipart([b"", b"\x01\x02"])           # not an 8-byte sequence number
        assert dealer.poll(5000)
        assert dealer.recv_multipart() == [b"", b"", END_SEQ, b""]
        assert publisher.replays is not None and publisher.replays.num_bad_requests == 1
    finally:
        dealer.close(linger=0)


def test_the_cli_makes_a_consumer_key_pair_a_node_admits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cluster.cli.main import main
    assert main(["certs", "events-key", "router", "--out", str(tmp_path / "keys")]) == 0
    assert main(["certs", "events-key", "node", "--out", str(tmp_path / "keys")]) == 0
    assert (tmp_path / "keys" / "router.key_secret").stat().st_mode & 0o077 == 0
    assert main(["certs", "events-key", "router", "--out", str(tmp_path / "keys")]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "router.key").write_bytes((tmp_path / "keys" / "router.key").read_bytes())
    cfg = config(tmp_path, curve_secret_key=str(tmp_path / "keys" / "node.key_secret"), curve_allow_dir=str(allowed))
    pub = KvEventPublisher(cfg, "n1", block_size=4)
    try:
        public, secret = zmq.auth.load_certificate(tmp_path / "keys" / "router.key_secret")
        publish(pub, 2)
        reply = dealer_reply(pub.replay_endpoint, 0, curve_publickey=public, curve_secretkey=secret,
                             curve_serverkey=pub.endpoints()["curve_public_key"].encode())
        assert [s for _, s, _ in reply] == [0, 1, -1]
    finally:
        pub.close()
