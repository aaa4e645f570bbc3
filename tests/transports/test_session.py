"""The connection protocol without sockets: a ClientSession and a ServerSession wired in memory.

As in aioquic's tests, a loop is the network: bytes one session returns are fed to the other,
with a fake clock passed as `now`. Every rule the transports share is asserted here once."""

from __future__ import annotations

import os

import blake3
import msgpack
import pytest

from fabric.keys import BlockAddress, BlockHash
from fabric.provenance import Provenance, sign_block
from transports.core.base import Hit, PullResult
from transports.core.client_session import ClientSession
from transports.core.codec import (
    VERSION,
    Block,
    Blocks,
    Bye,
    End,
    Error,
    ErrorCode,
    Frame,
    FrameDecoder,
    FrameType,
    Hello,
    LocalProtocolError,
    Miss,
    MissReason,
    ProtocolError,
    Pull,
    encode,
)
from transports.core.encoder import MAGIC, PREAMBLE
from transports.core.session import GROUP_BYTES, GROUP_PART_MAX, Fetched, ServerSession

TIMEOUT_S = 10.0


class Stored:
    def __init__(self, payload: bytes) -> None:
        self.payload = payload
        self.digest = blake3.blake3(payload).digest()


def addr(i: int, layer: int = 0) -> BlockAddress:
    return BlockAddress(BlockHash(blake3.blake3(i.to_bytes(4, "little")).digest()), layer)


def taken(client: ClientSession, touched: list[int]) -> list[tuple[int, list[PullResult], bool]]:
    """(request id, results, done) of each request `touched`, its results taken from its outcome
    (the one way results leave a client session)."""
    out = []
    for rid in touched:
        outcome = client.outcome(rid)
        out.append((rid, [outcome.take() for _ in range(len(outcome.results))], outcome.done))
    return out


def wire(frames: list[Frame]) -> bytes:
    return b"".join(encode(f) for f in frames)


class Pair:
    """A client and a server session joined by in-memory byte strings; `store` answers pulls."""

    def __init__(self, store: dict[BlockAddress, Fetched], *, client_max_payload: int = 1 << 26,
                 max_inflight: int = 4, hello_node: str = "client-1", require_namespace: bool = False) -> None:
        self.now = 0.0
        self.store = store
        self.server = ServerSession("server-1", "client-1", self.now, max_inflight=max_inflight,
                                    frame_timeout_s=TIMEOUT_S, idle_timeout_s=30.0,
                                    require_namespace=require_namespace)
        self.client = ClientSession(hello_node, "server-1", self.now, max_payload=client_max_payload,
                                    frame_timeout_s=TIMEOUT_S, idle_timeout_s=30.0)
        self.to_server = wire(self.client.hello())
        self.results: dict[int, list[PullResult]] = {}
        self.done: set[int] = set()

    def pull(self, addresses: list[BlockAddress], namespace: bytes = b"") -> int:
        rid, frames = self.client.submit(addresses, self.now, namespace=namespace)
        self.to_server += wire(frames)
        return rid

    def run(self) -> None:
        """Move bytes both ways until nothing is left to move; the server answers every pull it starts."""
        while self.to_server:
            data, self.to_server = self.to_server, b""
            back = self.server.receive(data, self.now)
            self.server.take_pulls()
            while (batch := self.server.next_batch()) is not None:
                rid, rest = batch
                back += self.server.answer(rid, rest, [self.store.get(a) for a in rest], self.now)
            for rid in self.client.receive(wire(back), self.now):
                outcome = self.client.outcome(rid)   # left there: a test may take them itself
                self.results[rid] = list(outcome.results)
                if outcome.done:
                    self.done.add(rid)


def test_pull_returns_verified_hits_and_misses_in_the_order_asked() -> None:
    blocks = {addr(i): Stored(os.urandom(1000 + i)) for i in range(5)}
    pair = Pair(dict(blocks))
    asked = [addr(0), addr(99), addr(3), addr(3), addr(4)]
    rid = pair.pull(asked)
    pair.run()
    got = pair.results[rid]
    assert rid in pair.done
    assert [r.address for r in got] == asked
    assert isinstance(got[1], Miss) and got[1].reason is MissReason.NOT_FOUND
    for r in (got[0], got[2], got[3], got[4]):
        assert isinstance(r, Hit) and bytes(r.payload) == blocks[r.address].payload


def test_oversize_and_failed_blocks_are_misses_with_a_reason_and_the_rest_is_served() -> None:
    small, big, broken = addr(1), addr(2), addr(3)
    pair = Pair({small: Stored(b"x" * 100), big: Stored(b"y" * 5000), broken: OSError("disk gone")},
                client_max_payload=4096)
    rid = pair.pull([small, big, broken])
    pair.run()
    reasons = [r.reason if isinstance(r, Miss) else "hit" for r in pair.results[rid]]
    assert reasons == ["hit", MissReason.TOO_LARGE, MissReason.SOURCE_ERROR]
    stats = pair.server.take_stats()
    assert (stats.num_hits, stats.num_bytes) == (1, 100)
    assert stats.misses == {MissReason.TOO_LARGE: 1, MissReason.SOURCE_ERROR: 1}


def answer_frames(store: dict[BlockAddress, Fetched], asked: list[BlockAddress], client_max_payload: int = 1 << 26
                  ) -> list[Frame]:
    """What a server sends for one PULL of `asked`, decoded as the client sees it."""
    server = ServerSession("server-1", "client-1", 0.0)
    server.receive(wire([Hello("client-1", max_payload=client_max_payload), Pull(1, tuple(asked))]), 0.0)
    assert [p.request_id for p in server.take_pulls()] == [1]
    half = len(asked) // 2   # answered in two fetch batches, as adapters do
    out = server.answer(1, asked[:half], [store.get(a) for a in asked[:half]], 0.0)
    out += server.answer(1, asked[half:], [store.get(a) for a in asked[half:]], 0.0)
    return FrameDecoder().feed(wire(out))


def test_a_run_of_small_hits_travels_as_few_blocks_frames_each_part_verified() -> None:
    """Per-frame work (header, decode, buffer, wake-ups) was paid once per 64 KiB block; a run of
    hits now shares one BLOCKS frame of at most GROUP_BYTES, and each part is still checked
    against its own digest and lands on the address asked at its position."""
    small = {addr(i): Stored(os.urandom(64 * 1024)) for i in range(40)}
    big = {addr(100): Stored(os.urandom(GROUP_PART_MAX + 1))}
    asked = [*list(small)[:20], addr(99), *big, *list(small)[20:]]   # a miss and a big block break the runs
    frames = answer_frames(small | big, asked)
    kinds = [type(f).__name__ for f in frames]
    # 18 parts of 64 KiB fit GROUP_BYTES; the answer's second fetch batch starts at the miss (address 20)
    assert kinds == ["Blocks", "Blocks", "Miss", "Block", "Blocks", "Blocks", "End"]
    assert [(f.first, f.num_parts) for f in frames if isinstance(f, Blocks)] == [(0, 18), (18, 2), (22, 18), (40, 2)]
    assert all(len(f.payload) <= GROUP_BYTES for f in frames if isinstance(f, Blocks))
    pair = Pair(small | big)
    rid = pair.pull(asked)
    pair.run()
    got = pair.results[rid]
    assert [r.address for r in got] == asked
    assert isinstance(got[20], Miss) and got[20].reason is MissReason.NOT_FOUND
    store = small | big
    assert all(isinstance(r, Hit) and bytes(r.payload) == store[r.address].payload
               for i, r in enumerate(got) if i != 20)


def test_blocks_frames_respect_the_clients_payload_limit() -> None:
    store = {addr(i): Stored(os.urandom(30_000)) for i in range(10)}
    frames = answer_frames(store, list(store), client_max_payload=100_000)
    parts = [f.num_parts if isinstance(f, Blocks) else 1 for f in frames if isinstance(f, Block | Blocks)]
    assert sum(parts) == 10 and max(parts) == 3
    assert all(len(f.payload) <= 100_000 for f in frames if isinstance(f, Block | Blocks))


def test_a_corrupt_part_is_a_digest_mismatch_for_its_address_only() -> None:
    client = ClientSession("client-1", "server-1", 0.0)
    asked = [addr(i) for i in range(3)]
    rid, _ = client.submit(asked, 0.0)
    parts = [os.urandom(1000) for _ in asked]
    digests = [blake3.blake3(p).digest() for p in parts]
    digests[1] = blake3.blake3(b"something else").digest()   # the server lies about one part
    out = taken(client, client.receive(
        wire([Hello("server-1"), Blocks(rid, 0, b"".join(digests), (1000,) * 3, b"".join(parts))]), 0.0))
    flat = [r for _, res, _ in out for r in res]
    assert [type(r).__name__ for r in flat] == ["Hit", "Miss", "Hit"]
    assert flat[1].reason is MissReason.DIGEST_MISMATCH and flat[1].address == asked[1]
    assert bytes(flat[0].payload) == parts[0] and bytes(flat[2].payload) == parts[2]
    assert not client.closing


@pytest.mark.parametrize(("first", "count", "why"), [(1, 1, "skips the first address"), (0, 3, "runs past the end")])
def test_blocks_out_of_turn_or_past_the_request_is_a_protocol_error(first: int, count: int, why: str) -> None:
    client = ClientSession("client-1", "server-1", 0.0)
    rid, _ = client.submit([addr(1), addr(2)], 0.0)
    part = b"p" * 10
    frame = Blocks(rid, first, blake3.blake3(part).digest() * count, (10,) * count, part * count)
    out = taken(client, client.receive(wire([Hello("server-1"), frame]), 0.0))
    assert client.closing and client.error is not None and "BLOCKS" in str(client.error), why
    assert [[r.reason for r in res] for _, res, _ in out] == [[MissReason.PEER_ERROR] * 2]


def placed_run(num: int, size: int) -> tuple[ClientSession, int, bytearray, list[bytes], bytes]:
    """A client that asked for `num` addresses into `num` slots of `size`, and the wire of a server
    answering them all in one BLOCKS frame."""
    client = ClientSession("client-1", "server-1", 0.0)
    slots = bytearray(b"?" * (num * size))
    rid, _ = client.submit([addr(i) for i in range(num)], 0.0, into=memoryview(slots))
    parts = [os.urandom(size) for _ in range(num)]
    frame = Blocks(rid, 0, b"".join(blake3.blake3(p).digest() for p in parts), (size,) * num, b"".join(parts))
    return client, rid, slots, parts, wire([Hello("server-1"), frame])


def test_blocks_are_received_straight_into_the_callers_slots() -> None:
    """A NodeActor pulls into its reply array: each hit's payload is its slot (no copy), written by
    that address's answer and verified there."""
    client, _rid, slots, parts, data = placed_run(4, 5000)
    out = taken(client, client.receive(data, 0.0))
    hits = [r for _, res, _ in out for r in res]
    assert all(isinstance(h, Hit) for h in hits) and bytes(slots) == b"".join(parts)
    assert all(h.payload.obj is slots for h in hits if isinstance(h, Hit))


def test_a_lying_part_in_a_slot_is_a_miss_and_answered_slots_are_never_rewritten() -> None:
    client, rid, slots, parts, data = placed_run(3, 1000)
    taken(client, client.receive(data, 0.0))
    before = bytes(slots)
    # A second BLOCKS for addresses already answered: refused before any byte lands in their slots.
    again = Blocks(rid, 0, blake3.blake3(b"x" * 1000).digest() * 2, (1000, 1000), b"x" * 2000)
    taken(client, client.receive(encode(again), 0.0))
    assert bytes(slots) == before and client.closing and "BLOCKS" in str(client.error)
    client, rid, slots, parts, _ = placed_run(2, 1000)
    lie = Blocks(rid, 0, blake3.blake3(parts[0]).digest() + blake3.blake3(b"other").digest(), (1000, 1000),
                 b"".join(parts))
    out = taken(client, client.receive(wire([Hello("server-1"), lie]), 0.0))
    kinds = [type(r).__name__ for _, res, _ in out for r in res]
    assert kinds == ["Hit", "Miss"]


def placed_blocks(num: int, size: int) -> tuple[ClientSession, int, bytearray, list[bytes]]:
    """A client that asked for `num` addresses into `num` slots of `size` (over the BLOCKS part
    size: a server answers each with a BLOCK frame of its own), and the payloads the server holds."""
    client = ClientSession("client-1", "server-1", 0.0)
    slots = bytearray(b"?" * (num * size))
    rid, _ = client.submit([addr(i) for i in range(num)], 0.0, into=memoryview(slots))
    return client, rid, slots, [os.urandom(size) for _ in range(num)]


def test_block_frames_are_received_straight_into_the_callers_slots() -> None:
    """A 1 MiB layer comes as a BLOCK frame: it lands in its slot too, and each hit's payload is
    its slot (no payload-sized buffer of its own)."""
    size = GROUP_PART_MAX + 4096
    client, rid, slots, parts = placed_blocks(3, size)
    frames: list[Frame] = [Hello("server-1"), *(Block(rid, addr(i), blake3.blake3(p).digest(), p)
                                                for i, p in enumerate(parts))]
    # Arbitrary splits: a frame's payload is received across several reads.
    data, hits = wire(frames), []
    for at in range(0, len(data), 70_001):
        hits += [r for _, res, _ in taken(client, client.receive(data[at:at + 70_001], 0.0)) for r in res]
    assert all(isinstance(h, Hit) for h in hits) and bytes(slots) == b"".join(parts)
    assert [h.payload.obj is slots and h.payload.nbytes == size for h in hits if isinstance(h, Hit)] == [True] * 3


def test_a_corrupt_block_frame_in_a_slot_is_a_miss() -> None:
    """A BLOCK whose payload does not match its digest lands in its slot, and is a miss."""
    size = GROUP_PART_MAX + 1
    client, rid, slots, parts = placed_blocks(2, size)
    lie = Block(rid, addr(0), blake3.blake3(b"other").digest(), parts[0])
    good = Block(rid, addr(1), blake3.blake3(parts[1]).digest(), parts[1])
    out = taken(client, client.receive(wire([Hello("server-1"), lie, good]), 0.0))
    results = [r for _, res, _ in out for r in res]
    assert [type(r).__name__ for r in results] == ["Miss", "Hit"]
    assert isinstance(results[0], Miss) and results[0].reason is MissReason.DIGEST_MISMATCH
    assert isinstance(results[1], Hit) and bytes(results[1].payload) == parts[1]
    # The lie was received in its slot (no copy) and checked there: the slot never counted as filled.
    assert bytes(slots[:size]) == parts[0] and results[1].payload.obj is slots


def test_a_block_for_a_repeated_address_never_lands_in_an_answered_slot() -> None:
    """Asked [A, B, A] and answered MISS A, MISS B, BLOCK A in one read: the BLOCK is the third
    address's answer, and its hit holds exactly its payload, not the first slot the caller may
    reuse after its miss."""
    size = GROUP_PART_MAX + 10
    client = ClientSession("client-1", "server-1", 0.0)
    slots = bytearray(3 * size)
    asked = [addr(1), addr(2), addr(1)]
    rid, _ = client.submit(asked, 0.0, into=memoryview(slots))
    payload = os.urandom(size)
    frames: list[Frame] = [Hello("server-1"), Miss(rid, addr(1), MissReason.NOT_FOUND),
                           Miss(rid, addr(2), MissReason.NOT_FOUND),
                           Block(rid, addr(1), blake3.blake3(payload).digest(), payload)]
    results = [r for _, res, _ in taken(client, client.receive(wire(frames), 0.0)) for r in res]
    assert [type(r).__name__ for r in results] == ["Miss", "Miss", "Hit"]
    hit = results[2]
    assert isinstance(hit, Hit) and bytes(hit.payload) == payload
    slots[:size] = b"!" * size   # the caller reuses the first (missed) slot: the hit is not touched
    assert bytes(hit.payload) == payload
    # The same with the caller refilling the missed slot while the BLOCK is still arriving.
    client = ClientSession("client-1", "server-1", 0.0)
    slots = bytearray(2 * size)
    rid, _ = client.submit([addr(1), addr(1)], 0.0, into=memoryview(slots))
    data = wire([Hello("server-1"), Miss(rid, addr(1), MissReason.NOT_FOUND),
                 Block(rid, addr(1), blake3.blake3(payload).digest(), payload)])
    first = [r for _, res, _ in taken(client, client.receive(data[:-1000], 0.0)) for r in res]
    assert [type(r).__name__ for r in first] == ["Miss"]
    slots[:size] = b"!" * size
    last = [r for _, res, _ in taken(client, client.receive(data[-1000:], 0.0)) for r in res]
    assert len(last) == 1 and isinstance(last[0], Hit) and bytes(last[0].payload) == payload


@pytest.mark.parametrize("header", [
    {"rid": [1], "first": 0, "digests": b"d" * 32, "sizes": [10]},       # unhashable request id
    {"rid": 1, "first": [0], "digests": b"d" * 32, "sizes": [10]},
    {"rid": 1, "first": 0, "digests": b"d" * 32, "sizes": {"10": 1}},
])
def test_a_malformed_blocks_header_for_a_placed_request_is_a_protocol_error(header: dict[str, object]) -> None:
    client = ClientSession("client-1", "server-1", 0.0)
    slots = bytearray(10)
    client.submit([addr(1)], 0.0, into=memoryview(slots))
    raw = msgpack.packb(header, use_bin_type=True)
    data = PREAMBLE.pack(MAGIC, VERSION, FrameType.BLOCKS, 0, len(raw), 10) + raw + b"x" * 10
    out = taken(client, client.receive(wire([Hello("server-1")]) + data, 0.0))
    assert client.closing and isinstance(client.error, ProtocolError) and bytes(slots) == bytes(10)
    assert [[r.reason for r in res] for _, res, _ in out] == [[MissReason.PEER_ERROR]]


def test_a_request_cancelled_mid_frame_stops_writing_into_its_slots() -> None:
    """The caller gave up (timeout) and may refill those slots from another peer: the rest of a
    payload that was being received into them goes to a buffer of its own."""
    client, rid, slots, _parts, data = placed_run(2, 30_000)
    cut = len(data) - 20_000
    assert taken(client, client.receive(data[:cut], 0.0)) == []
    client.cancel(rid)
    slots[:] = b"!" * len(slots)            # the caller writes its slots again
    taken(client, client.receive(data[cut:], 0.0))
    assert bytes(slots) == b"!" * len(slots) and not client.closing


def test_hello_must_come_first_and_name_the_certificates_node() -> None:
    pair = Pair({}, hello_node="someone-else")
    pair.pull([addr(1)])
    pair.run()
    assert pair.server.closing and pair.server.error is not None
    assert pair.server.error.code is ErrorCode.UNAUTHORIZED
    server = ServerSession("server-1", "client-1", 0.0)
    out = server.receive(encode(Pull(1, (addr(1),))), 0.0)
    assert isinstance(out[0], Error) and out[0].code is ErrorCode.PROTOCOL and server.closing


def test_in_flight_window_queues_pulls_and_stops_reading() -> None:
    server = ServerSession("server-1", "client-1", 0.0, max_inflight=2)
    frames: list[Frame] = [Hello("client-1"), *(Pull(rid, (addr(rid),)) for rid in (1, 2, 3, 4))]
    assert isinstance(server.receive(wire(frames), 0.0)[0], Hello)
    assert [p.request_id for p in server.take_pulls()] == [1, 2]
    assert not server.reading
    server.finish(1, 0.0)
    assert [p.request_id for p in server.take_pulls()] == [3]
    server.finish(2, 0.0)
    server.finish(3, 0.0)
    assert [p.request_id for p in server.take_pulls()] == [4] and server.reading
    with pytest.raises(LocalProtocolError):
        server.finish(3, 0.0)


def test_a_request_id_in_flight_cannot_be_reused() -> None:
    server = ServerSession("server-1", "client-1", 0.0)
    out = server.receive(wire([Hello("client-1"), Pull(7, (addr(1),)), Pull(7, (addr(2),))]), 0.0)
    assert isinstance(out[-1], Error) and "reuses request id 7" in out[-1].message and server.closing


def test_slowloris_is_cut_by_the_total_frame_deadline_not_reset_by_each_byte() -> None:
    """A peer sending one byte a second must not keep a frame open forever (a stall timer counted
    from the last byte would): a frame must arrive whole within frame_timeout_s."""
    server = ServerSession("server-1", "client-1", 0.0, frame_timeout_s=TIMEOUT_S)
    data = wire([Hello("client-1")])
    now = 0.0
    for i in range(len(data) - 1):
        assert not server.receive(data[i:i + 1], now)
        deadline = server.next_deadline()
        assert deadline is not None and deadline == pytest.approx(TIMEOUT_S)
        now += 1.0
        if now >= deadline:
            out = server.handle_timer(now)
            assert isinstance(out[0], Error) and out[0].code is ErrorCode.TIMEOUT
            assert server.closing and server.close_reason is MissReason.TIMEOUT
            return
    pytest.fail("the dribbled HELLO was never cut")


def test_a_peer_that_does_not_read_is_cut_after_frame_timeout() -> None:
    server = ServerSession("server-1", "client-1", 0.0, frame_timeout_s=TIMEOUT_S)
    server.receive(wire([Hello("client-1")]), 0.0)
    assert server.next_deadline(blocked_since=1.0) == pytest.approx(1.0 + TIMEOUT_S)
    assert not server.handle_timer(5.0, blocked_since=1.0)
    assert isinstance(server.handle_timer(11.5, blocked_since=1.0)[0], Error) and server.closing


def test_idle_connections_close_client_first() -> None:
    pair = Pair({})
    pair.pull([addr(1)])
    pair.run()
    assert pair.client.next_deadline() == pytest.approx(15.0)   # half the server's idle timeout
    frames, touched = pair.client.handle_timer(15.0)
    assert frames == [Bye("idle")] and not touched and pair.client.closing
    assert pair.server.next_deadline() == pytest.approx(30.0)
    assert pair.server.handle_timer(30.0) == [Bye("idle")] and pair.server.closing


def test_a_stalled_server_ends_pending_requests_in_timeout_misses() -> None:
    client = ClientSession("client-1", "server-1", 0.0, frame_timeout_s=TIMEOUT_S)
    rid, _ = client.submit([addr(1), addr(2)], 0.0)
    taken(client, client.receive(encode(Hello("server-1")), 1.0))
    assert client.next_deadline() == pytest.approx(1.0 + TIMEOUT_S)
    client.pause(2.0)   # the caller is slow to take results: no stall meanwhile
    assert client.next_deadline() is None
    client.resume(7.0)
    assert client.next_deadline() == pytest.approx(6.0 + TIMEOUT_S)
    results = taken(client, client.handle_timer(16.0)[1])
    assert [(r, [m.reason for m in res if isinstance(m, Miss)], d) for r, res, d in results] == \
        [(rid, [MissReason.TIMEOUT] * 2, True)]


def test_lying_server_payload_is_a_digest_mismatch_miss_and_strangers_are_protocol_errors() -> None:
    client = ClientSession("client-1", "server-1", 0.0)
    rid, _ = client.submit([addr(1)], 0.0)
    lie = Block(rid, addr(1), blake3.blake3(b"truth").digest(), b"lie!!")
    out = taken(client, client.receive(wire([Hello("server-1"), lie]), 0.0))
    assert [(r, [m.reason for m in res if isinstance(m, Miss)]) for r, res, _ in out] == \
        [(rid, [MissReason.DIGEST_MISMATCH])]
    rid2, _ = client.submit([addr(2)], 0.0)
    stranger = Block(rid2, addr(3), blake3.blake3(b"x").digest(), b"x")   # never asked for
    out = taken(client, client.receive(encode(stranger), 0.0))
    assert client.closing and client.error is not None
    assert [(r, [m.reason for m in res if isinstance(m, Miss)]) for r, res, _ in out if res] == \
        [(rid2, [MissReason.PEER_ERROR])]


def test_server_error_or_lost_connection_fails_only_what_is_pending() -> None:
    client = ClientSession("client-1", "server-1", 0.0)
    rid, _ = client.submit([addr(1), addr(2)], 0.0)
    hit = Stored(b"payload")
    out = taken(client, client.receive(wire([Hello("server-1"), Block(rid, addr(1), hit.digest, hit.payload),
                               Error(0, ErrorCode.INTERNAL, "going away")]), 0.0))
    flat = [r for _, res, _ in out for r in res]
    assert isinstance(flat[0], Hit)
    assert isinstance(flat[1], Miss) and flat[1].reason is MissReason.PEER_ERROR and len(flat) == 2


def test_quic_style_stream_sessions_carry_one_pull_and_need_no_hello() -> None:
    server = ServerSession("server-1", "client-1", 0.0, hello=False, one_pull=True)
    server.receive(encode(Pull(5, (addr(1),))), 0.0)
    assert [p.request_id for p in server.take_pulls()] == [5]
    out = server.receive(encode(Pull(6, (addr(1),))), 0.0)
    assert isinstance(out[0], Error) and out[0].request_id == 5 and server.closing
    empty = ServerSession("server-1", "client-1", 0.0, hello=False, one_pull=True)
    assert isinstance(empty.end_of_stream(0.0)[0], Error)


@pytest.mark.parametrize("last", [Bye("done"), Error(5, ErrorCode.INTERNAL, "gave up")], ids=["bye", "error"])
def test_a_pull_followed_at_once_by_bye_or_error_is_never_started(last: Frame) -> None:
    server = ServerSession("server-1", "client-1", 0.0, hello=False, one_pull=True)
    out = server.receive(encode(Pull(5, (addr(1),))) + encode(last), 0.0)
    assert out == [] and server.closing and server.error is None
    assert server.take_pulls() == []   # nobody waits for its answers


def test_a_quic_stream_may_open_with_the_clients_hello_whose_limit_then_applies() -> None:
    big, small = Stored(b"b" * 5000), Stored(b"s" * 100)
    server = ServerSession("server-1", "client-1", 0.0, hello=False, one_pull=True)
    out = server.receive(encode(Hello("client-1", VERSION, 1000)) + encode(Pull(5, (addr(1), addr(2)))), 0.0)
    assert out == [] and [p.request_id for p in server.take_pulls()] == [5]
    frames = server.answer(5, [addr(1), addr(2)], [big, small], 0.0)
    assert isinstance(frames[0], Miss) and frames[0].reason is MissReason.TOO_LARGE
    assert isinstance(frames[1], Block)
    stranger = ServerSession("server-1", "client-1", 0.0, hello=False, one_pull=True)
    out = stranger.receive(encode(Hello("client-2", VERSION, 1000)), 0.0)
    assert isinstance(out[0], Error) and out[0].code is ErrorCode.UNAUTHORIZED
    late = ServerSession("server-1", "client-1", 0.0, hello=False, one_pull=True)
    out = late.receive(encode(Pull(5, (addr(1),))) + encode(Hello("client-1")), 0.0)
    assert isinstance(out[0], Error) and out[0].code is ErrorCode.PROTOCOL


def test_the_server_session_hands_out_batches_round_robin_and_ends_each_pull() -> None:
    """Adapters keep no cursor: the session says which pull to answer next and what of it is left,
    takes turns between pulls (one caller's long pull does not hold up another's), and a pull's
    last answer carries its END."""
    server = ServerSession("server-1", "client-1", 0.0)
    store = {addr(i): Stored(bytes([i]) * 100) for i in range(6)}
    server.receive(wire([Hello("client-1"), Pull(1, tuple(addr(i) for i in range(4))), Pull(2, (addr(4), addr(5)))]),
                   0.0)
    assert server.next_batch() is None   # nothing handed out (admitted) yet
    assert [p.request_id for p in server.take_pulls()] == [1, 2]
    order, ends = [], []
    while (batch := server.next_batch()) is not None:
        rid, rest = batch
        order.append((rid, len(rest)))
        out = server.answer(rid, rest[:1], [store[rest[0]]], 1.0)   # a fetch batch of one block
        ends += [f.request_id for f in out if isinstance(f, End)]
    assert order == [(1, 4), (2, 2), (1, 3), (2, 1), (1, 2), (1, 1)]
    assert ends == [2, 1] and not server.active and server.next_batch() is None
    with pytest.raises(LocalProtocolError):
        server.answer(1, [addr(0)], [store[addr(0)]], 1.0)


def test_an_empty_pull_is_one_empty_batch_answered_by_its_end() -> None:
    server = ServerSession("server-1", "client-1", 0.0)
    server.receive(wire([Hello("client-1"), Pull(1, ())]), 0.0)
    server.take_pulls()
    assert server.next_batch() == (1, ())
    assert server.answer(1, (), [], 0.0) == [End(1)] and server.next_batch() is None


def test_the_client_session_keeps_each_requests_results_until_its_caller_takes_them() -> None:
    """Adapters keep no copy of results: each request's outcome is the session's, in the order
    asked, done once every address is answered, and forgotten when the caller is done with it."""
    blocks = {addr(i): Stored(os.urandom(100)) for i in range(3)}
    pair = Pair(dict(blocks))
    first = pair.pull([addr(0), addr(7)])
    second = pair.pull([addr(1), addr(2)])
    pair.run()
    one, two = pair.client.outcome(first), pair.client.outcome(second)
    assert [r.address for r in one.results] == [addr(0), addr(7)] and one.done and one.answered
    assert isinstance(one.results[1], Miss) and one.results[1].reason is MissReason.NOT_FOUND
    assert [bytes(r.payload) for r in two.results if isinstance(r, Hit)] == [blocks[addr(1)].payload,
                                                                            blocks[addr(2)].payload]
    assert pair.client.buffered == one.num_bytes + two.num_bytes == 300   # hits' payload bytes not taken
    tally = pair.client.take_tally()   # what an adapter counts in its metrics, once
    assert (tally.num_hits, tally.num_bytes, tally.misses) == (3, 300, {MissReason.NOT_FOUND: 1})
    assert pair.client.take_tally().num_hits == 0
    assert isinstance(one.take(), Hit)   # the caller takes what it reads
    assert len(pair.client.outcome(first).results) == 1 and pair.client.buffered == 200
    pair.client.cancel(first)
    with pytest.raises(KeyError):
        pair.client.outcome(first)
    pair.client.cancel(second)   # a caller that gives up leaves no bytes counted
    assert pair.client.buffered == 0


def test_a_request_lost_with_its_connection_was_never_answered() -> None:
    """A pooled connection already gone when the PULL went out answers nothing (the caller may
    pull again on a new one); a request the server answered, even with misses, was answered."""
    client = ClientSession("client-1", "server-1", 0.0)
    rid, _ = client.submit([addr(1)], 0.0)
    client.receive(wire([Hello("server-1"), Bye("idle")]), 0.0)
    outcome = client.outcome(rid)
    assert outcome.done and not outcome.answered
    assert [r.reason for r in outcome.results if isinstance(r, Miss)] == [MissReason.PEER_GONE]
    client = ClientSession("client-1", "server-1", 0.0)
    rid, _ = client.submit([addr(1), addr(2)], 0.0)
    client.receive(wire([Hello("server-1"), Miss(rid, addr(1), MissReason.NOT_FOUND)]), 0.0)
    client.connection_lost(MissReason.PEER_GONE)
    outcome = client.outcome(rid)
    assert outcome.done and outcome.answered and len(outcome.results) == 2


def test_a_refused_pull_is_answered_overloaded_and_frees_its_slot() -> None:
    server = ServerSession("server-1", "client-1", 0.0, max_inflight=1)
    server.receive(wire([Hello("client-1"), Pull(1, (addr(1),)), Pull(2, (addr(2),))]), 0.0)
    assert [p.request_id for p in server.take_pulls()] == [1] and not server.reading
    out = server.refuse(1, 0.0, "over its budget")
    assert out == [Error(1, ErrorCode.OVERLOADED, "over its budget")] and not server.closing
    assert [p.request_id for p in server.take_pulls()] == [2]   # the queued PULL starts
    with pytest.raises(LocalProtocolError):
        server.refuse(1, 0.0, "again")
    stream = ServerSession("server-1", "client-1", 0.0, hello=False, one_pull=True)
    stream.receive(encode(Pull(5, (addr(1),))), 0.0)
    stream.take_pulls()
    assert stream.refuse(5, 0.0, "busy")[0].code is ErrorCode.OVERLOADED and stream.closing   # the stream is done


class Signed(Stored):
    """A stored block with its producer's record (what a Store hands out)."""

    def __init__(self, payload: bytes, provenance: Provenance | None) -> None:
        super().__init__(payload)
        self.provenance = provenance


def test_each_hit_carries_its_blocks_record_even_across_many_distinct_blocks() -> None:
    # 600 blocks of 2 layers each, asked layer-major: every part of a BLOCKS frame is another block,
    # so the records alone would pass the header limit if frames were not cut for them.
    store: dict[BlockAddress, Fetched] = {}
    records = {}
    for i in range(600):
        payloads = [os.urandom(512) for _ in range(2)]
        records[i] = None if i % 7 == 3 else sign_block(
            b"n" * 32, addr(i).hash, [blake3.blake3(p).digest() for p in payloads], "node-p", b"C" * 600,
            lambda m: b"s" * 64)
        for layer, p in enumerate(payloads):
            store[addr(i, layer)] = Signed(p, records[i])
    pair = Pair(store)
    asked = [addr(i, layer) for layer in range(2) for i in range(600)]
    rid = pair.pull(asked[:1024])
    pair.run()
    got = pair.results[rid]
    assert len(got) == 1024 and all(isinstance(r, Hit) for r in got)
    for r in got:
        i = next(i for i in range(600) if addr(i).hash == r.address.hash)
        assert isinstance(r, Hit) and r.provenance == records[i]


class SignedStored(Stored):
    def __init__(self, payload: bytes, provenance: Provenance | None) -> None:
        super().__init__(payload)
        self.provenance = provenance


def test_a_pull_under_a_namespace_is_served_only_blocks_whose_record_names_it() -> None:
    ns_a, ns_b = b"a" * 32, b"b" * 32
    def stored(i: int, ns: bytes | None) -> SignedStored:
        payload = os.urandom(100)
        record = None if ns is None else sign_block(ns, addr(i).hash, [blake3.blake3(payload).digest()], "node-p",
                                                    b"", lambda m: b"sig")
        return SignedStored(payload, record)
    store: dict[BlockAddress, Fetched] = {addr(0): stored(0, ns_a), addr(1): stored(1, ns_b), addr(2): stored(2, None)}
    pair = Pair(store)
    under_a, under_b, unnamed = (pair.pull([addr(i) for i in range(3)], ns) for ns in (ns_a, ns_b, b""))
    pair.run()
    def hits(rid: int) -> list[bool]:
        return [isinstance(r, Hit) for r in pair.results[rid]]
    assert hits(under_a) == [True, False, False]
    assert hits(under_b) == [False, True, False]
    assert hits(unnamed) == [True, True, True]   # a PULL that names no namespace is checked by its puller only
    assert all(r.reason is MissReason.NOT_FOUND for r in pair.results[under_a] if not isinstance(r, Hit))
    strict = Pair(store, require_namespace=True)
    unnamed, under_a = strict.pull([addr(i) for i in range(3)]), strict.pull([addr(0)], ns_a)
    strict.run()
    assert not any(isinstance(r, Hit) for r in strict.results[unnamed])
    assert [isinstance(r, Hit) for r in strict.results[under_a]] == [True]


def test_a_pull_namespace_must_be_a_32_byte_root() -> None:
    raw = encode(Pull(1, (addr(0),), b"a" * 32))
    assert FrameDecoder().feed(raw) == [Pull(1, (addr(0),), b"a" * 32)]
    with pytest.raises(ProtocolError, match="namespace"):
        FrameDecoder().feed(encode(Pull(1, (addr(0),), b"short")))


def test_a_block_for_a_request_never_sent_is_refused_before_its_record_is_decoded() -> None:
    client = ClientSession("client-1", "server-1", 0.0)
    rid, _ = client.submit([addr(1)], 0.0)
    part = b"p" * 10
    record = sign_block(b"n" * 32, addr(1).hash, [blake3.blake3(part).digest()], "node-a", b"C" * 4000,
                        lambda m: b"s" * 64)
    stray = Block(rid + 7, addr(1), blake3.blake3(part).digest(), part, record)
    out = taken(client, client.receive(wire([Hello("server-1"), stray]), 0.0))
    assert client.closing and client.error is not None and "never sent" in str(client.error)
    assert client.decoder.held_record_bytes == 0   # its record was never decoded, nor kept
    assert [[r.reason for r in res] for _, res, _ in out] == [[MissReason.PEER_ERROR]]
