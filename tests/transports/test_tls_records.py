"""TLS 1.3 records sealed and opened in process (transports/tls/records.py), checked against RFC 8446
recomputed here from its formulas and against OpenSSL itself (a stock `ssl` peer on a real mutual-TLS
loopback connection, both ways): record sequence numbers and nonces across many records and key
updates, a tampered record refused with nothing of it delivered, post-handshake messages and alerts."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import struct
import threading
import tracemalloc
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand
from support import creds, wait_until

from fabric.keys import BlockAddress, BlockHash
from transports.core.base import Peer
from transports.core.codec import Block, End, Frame, FrameDecoder, Hello, MissReason, encode
from transports.core.metrics import TransportMetrics
from transports.tls import channel as channel_module
from transports.tls import records as records_module
from transports.tls.handshake import accept_tls, auth_failure_reason, open_tls
from transports.tls.link import TlsLink
from transports.tls.records import MAX_CONTENT, SUITES, RecordError, RecordLayer

SUITE = "TLS_AES_256_GCM_SHA384"


def _layers(suite: str = SUITE, secrets: tuple[bytes, bytes] | None = None) -> tuple[RecordLayer, RecordLayer]:
    """(server, client) record layers of one connection: each one's write secret is the other's read secret."""
    client_secret, server_secret = secrets or (os.urandom(48), os.urandom(48))
    server = RecordLayer(suite, client_secret, server_secret, server_side=True)
    client = RecordLayer(suite, server_secret, client_secret, server_side=False)
    return server, client


def _open_all(layer: RecordLayer, wire: bytes) -> bytes:
    dst = memoryview(bytearray(len(wire)))
    pos, n = layer.open_into(memoryview(wire), 0, len(wire), dst)
    assert layer.failure is None and pos == len(wire)
    return bytes(dst[:n])


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_records_follow_rfc8446_nonces_and_keys_across_many_records(suite: str) -> None:
    """Each record opens with the key and IV of HKDF-Expand-Label computed here and the nonce
    IV XOR its sequence number, record after record, and the peer's layer reads back every byte."""
    server, client = _layers(suite)
    data = os.urandom(300 * MAX_CONTENT + 123)
    out = memoryview(bytearray(RecordLayer.run_size(len(data))))
    end = server.seal_run(memoryview(data), out, 0)
    assert end == out.nbytes
    assert _open_all(client, bytes(out)) == data

    aead_class, key_len, algorithm = SUITES[suite]

    def expand(label: bytes, length: int) -> bytes:
        full = b"tls13 " + label
        info = struct.pack(">HB", length, len(full)) + full + b"\x00"
        return HKDFExpand(algorithm(), length, info).derive(server.tx.secret)

    aead, iv = aead_class(expand(b"key", key_len)), int.from_bytes(expand(b"iv", 12), "big")
    pos, seq, plain = 0, 0, b""
    while pos < end:
        header = bytes(out[pos:pos + 5])
        length = int.from_bytes(header[3:], "big")
        assert header[:3] == b"\x17\x03\x03" and length <= MAX_CONTENT + 17
        inner = aead.decrypt((iv ^ seq).to_bytes(12, "big"), bytes(out[pos + 5:pos + 5 + length]), header)
        assert inner[-1] == 23   # application data, no padding
        plain += inner[:-1]
        pos, seq = pos + 5 + length, seq + 1
    assert plain == data and seq == 301


def test_sealing_a_run_copies_each_record_once_without_temporary_buffers() -> None:
    """Sealing 1 MiB allocates nothing per record: each record's plaintext is copied once into the
    layer's staging area (a bytearray's slice assignment from a view would first copy it into a
    temporary bytearray of 16 KiB, one per record), and the records still open to the same bytes."""
    server, client = _layers()
    data = memoryview(os.urandom(64 * MAX_CONTENT + 5))
    out = memoryview(bytearray(RecordLayer.run_size(data.nbytes)))
    server.seal_run(data[:MAX_CONTENT], out, 0)   # warm: first calls may allocate caches of their own
    server, client = _layers()
    tracemalloc.start()
    try:
        end = server.seal_run(data, out, 0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MAX_CONTENT // 4, f"sealing allocated {peak} bytes at its peak"
    assert _open_all(client, bytes(out[:end])) == bytes(data)


def test_a_tampered_record_is_refused_and_nothing_of_it_is_delivered() -> None:
    secrets = (os.urandom(48), os.urandom(48))
    server, _ = _layers(secrets=secrets)
    first, second = os.urandom(MAX_CONTENT), os.urandom(MAX_CONTENT)
    wire = bytearray(RecordLayer.run_size(2 * MAX_CONTENT))
    server.seal_run(memoryview(first + second), memoryview(wire), 0)
    second_record = 5 + MAX_CONTENT + 17
    for where in (second_record + 100, len(wire) - 1, second_record + 2):   # its body, its tag, its header
        _, reader = _layers(secrets=secrets)
        tampered = bytearray(wire)
        tampered[where] ^= 0x01
        dst = memoryview(bytearray(b"\xaa" * (4 * MAX_CONTENT)))
        pos, n = reader.open_into(memoryview(tampered), 0, len(tampered), dst)
        assert (pos, bytes(dst[:n])) == (second_record, first)   # the good record only
        assert bytes(dst[n:n + MAX_CONTENT + 1]) == bytes(MAX_CONTENT + 1)   # none of the bad one's plaintext
        assert isinstance(reader.failure, RecordError) and reader.failure.alert == 20   # bad_record_mac
        assert "BAD_RECORD_MAC" in str(reader.failure)
        assert reader.open_into(memoryview(tampered), pos, len(tampered), dst) == (pos, 0)   # and it stays refused


def _seal_padded(layer: RecordLayer, content: bytes, ctype: int, padding: int) -> bytes:
    """One record of `content`, its type and `padding` zero bytes (RFC 8446 §5.4), as a peer may send."""
    inner = content + bytes([ctype]) + bytes(padding)
    header = struct.pack(">BHH", 23, 0x0303, len(inner) + 16)
    return header + layer.tx.aead.encrypt(layer.tx.nonce(), inner, header)


def test_full_size_records_that_are_padded_or_carry_a_message_open_amid_a_run_of_full_ones() -> None:
    """Full-size records (16 KiB of data) open in a run straight into the payload; one of the same
    size on the wire that is padded, or that carries a KeyUpdate, does not pass for data."""
    server, client = _layers()
    first, second, third = (os.urandom(MAX_CONTENT) for _ in range(3))
    run = memoryview(bytearray(RecordLayer.run_size(MAX_CONTENT)))
    wire = b""
    for data in (first, second):
        end = server.seal_run(memoryview(data), run, 0)
        wire += bytes(run[:end])
    padded = os.urandom(MAX_CONTENT - 300)
    wire += _seal_padded(server, padded, 23, 300)    # as long as a full record, 300 bytes of padding
    update = bytes([24, 0, 0, 1, 0])
    wire += _seal_padded(server, update, 22, MAX_CONTENT - len(update))   # a KeyUpdate, padded to full size
    server.tx.update()
    end = server.seal_run(memoryview(third), run, 0)
    wire += bytes(run[:end])
    assert len(wire) == 5 * (5 + MAX_CONTENT + 17)   # five records of the same size
    assert _open_all(client, wire) == first + second + padded + third
    assert client.failure is None and not client.outbox   # the update was taken, and not asked to be answered


def test_a_long_run_of_full_records_with_a_short_or_tampered_one_amid_them_opens_up_to_it() -> None:
    """Runs of full records are checked header by header in one pass: a short record amid them, or
    one whose header was altered on the way, is found where it is; the records before it open into
    the payload, a short one opens the general way, a tampered one is refused with nothing of it kept."""
    secrets = (os.urandom(48), os.urandom(48))
    server, client = _layers(secrets=secrets)
    blocks = [os.urandom(MAX_CONTENT) for _ in range(12)]
    short = os.urandom(1000)
    out = memoryview(bytearray(RecordLayer.run_size(12 * MAX_CONTENT + 1000)))
    end = server.seal_run(memoryview(b"".join(blocks[:6])), out, 0)
    end = server.seal_run(memoryview(short), out, end)
    end = server.seal_run(memoryview(b"".join(blocks[6:])), out, end)
    wire = bytes(out[:end])
    assert _open_all(client, wire) == b"".join(blocks[:6]) + short + b"".join(blocks[6:])

    server, _ = _layers(secrets=secrets)   # twelve full records, the 8th's header altered
    full = bytearray(RecordLayer.run_size(12 * MAX_CONTENT))
    server.seal_run(memoryview(b"".join(blocks)), memoryview(full), 0)
    record = 5 + MAX_CONTENT + 17
    for where, alert in ((7 * record + 2, 20), (7 * record + 4, 20), (7 * record, 10)):   # version, length, type
        _, reader = _layers(secrets=secrets)
        tampered = bytearray(full)
        tampered[where] ^= 0x01
        dst = memoryview(bytearray(b"\xaa" * (13 * MAX_CONTENT)))
        pos, n = reader.open_into(memoryview(tampered), 0, len(tampered), dst)
        assert (pos, bytes(dst[:n])) == (7 * record, b"".join(blocks[:7]))
        # Nothing of the 8th record's plaintext (dst[n] may hold the 7th's content type, past what counts).
        assert set(bytes(dst[n + 1:n + MAX_CONTENT + 1])) <= {0, 0xaa}
        assert isinstance(reader.failure, RecordError) and reader.failure.alert == alert


def test_a_payloads_last_full_record_opens_in_the_same_call_its_type_byte_kept_out_of_the_buffer() -> None:
    """A full record whose data exactly fills what is left of the buffer (its type byte would not
    fit) opens in the same call, through the scratch record, and nothing lands past the buffer; a
    tampered one leaves the buffer as it was, and one whose data may not fit is left to `open_one`."""
    secrets = (os.urandom(48), os.urandom(48))
    server, client = _layers(secrets=secrets)
    data = os.urandom(3 * MAX_CONTENT)
    wire = bytearray(RecordLayer.run_size(len(data)))
    end = server.seal_run(memoryview(data), memoryview(wire), 0)
    memory = bytearray(b"\xaa" * (4 * MAX_CONTENT))
    dst = memoryview(memory)[:3 * MAX_CONTENT]
    assert client.open_into(memoryview(wire), 0, end, dst) == (end, 3 * MAX_CONTENT)
    assert bytes(memory[:3 * MAX_CONTENT]) == data and memory[3 * MAX_CONTENT:] == b"\xaa" * MAX_CONTENT

    _, reader = _layers(secrets=secrets)
    tampered = bytearray(wire)
    tampered[end - 1] ^= 0x01   # the last record's tag
    memory[:] = b"\xaa" * len(memory)
    pos, n = reader.open_into(memoryview(tampered), 0, end, memoryview(memory)[:3 * MAX_CONTENT])
    assert (pos, n) == (end - (5 + MAX_CONTENT + 17), 2 * MAX_CONTENT) and reader.failure is not None
    # Nothing of the refused record (the byte after the data holds the second record's content type).
    assert memory[2 * MAX_CONTENT + 1:] == b"\xaa" * (2 * MAX_CONTENT - 1)

    server, client = _layers()
    content = os.urandom(MAX_CONTENT)
    padded = _seal_padded(server, content, 23, 1)   # its data fits, its type and padding do not
    assert client.open_into(memoryview(padded), 0, len(padded), memoryview(bytearray(MAX_CONTENT))) == (0, 0)
    stop, plain = client.open_one(memoryview(padded), 0, len(padded))
    assert stop == len(padded) and bytes(plain) == content


def test_key_update_asked_by_the_peer_is_answered_and_both_directions_move_on() -> None:
    server, client = _layers()
    wire = server.seal_control(22, bytes([24, 0, 0, 1, 1]))   # KeyUpdate, update_requested
    server.tx.update()
    wire += server.seal_control(23, b"after the update")
    assert _open_all(client, wire) == b"after the update"
    assert len(client.outbox) == 1   # its own KeyUpdate, sealed under its old key
    answer = client.outbox.pop() + client.seal_control(23, b"answered")
    assert _open_all(server, answer) == b"answered"
    assert not server.outbox   # not asked: nothing to answer


def test_post_handshake_messages_tickets_dropped_others_refused() -> None:
    server, client = _layers()
    ticket = bytes([4, 0, 0, 8]) + os.urandom(8)
    # a ticket split over two records, then data: the client drops the ticket, keeps the data
    wire = server.seal_control(22, ticket[:5]) + server.seal_control(22, ticket[5:]) + server.seal_control(23, b"x")
    assert _open_all(client, wire) == b"x" and client.failure is None
    # a ticket sent to a server, a CertificateRequest, a KeyUpdate with a bad value: refused
    for to_server, body, alert in ((True, ticket, 10), (False, bytes([13, 0, 0, 1, 0]), 10),
                                   (False, bytes([24, 0, 0, 1, 7]), 47)):
        server, client = _layers()
        sender, reader = (client, server) if to_server else (server, client)
        sealed = sender.seal_control(22, body)
        reader.open_into(memoryview(sealed), 0, len(sealed), memoryview(bytearray(64)))
        assert isinstance(reader.failure, RecordError) and reader.failure.alert == alert


def test_alerts_close_notify_ends_the_stream_others_are_errors_named_as_openssl_names_them() -> None:
    server, client = _layers()
    wire = server.seal_control(23, b"last") + server.close_notify() + server.seal_control(23, b"never")
    dst = memoryview(bytearray(64))
    pos, n = client.open_into(memoryview(wire), 0, len(wire), dst)
    assert bytes(dst[:n]) == b"last" and client.peer_closed and pos < len(wire)
    server, client = _layers()
    revoked = server.alert(44)
    client.open_into(memoryview(revoked), 0, len(revoked), dst)
    assert isinstance(client.failure, RecordError) and client.failure.alert is None
    assert auth_failure_reason(client.failure) == "revoked"


def test_records_outside_the_protocol_are_refused_from_their_header() -> None:
    for header in (b"\x14\x03\x03\x00\x01", b"\x17\x03\x03\x41\x11", b"\x17\x03\x03\x00\x10", b"GET /"):
        _, client = _layers()
        client.open_into(memoryview(header), 0, len(header), memoryview(bytearray(64)))
        assert isinstance(client.failure, RecordError) and client.failure.alert in (10, 22, 50)


# -- against OpenSSL itself, over real mutual-TLS loopback connections ----------------------------------


def _frames(count: int) -> list[Frame]:
    sizes = [1, 5000, MAX_CONTENT, 3 * MAX_CONTENT + 7, 1 << 20]
    frames: list[Frame] = [Block(i, BlockAddress(BlockHash(os.urandom(32)), i), os.urandom(32),
                                 os.urandom(sizes[i % len(sizes)])) for i in range(count)]
    return [*frames, End(99)]


def _same(got: list[Frame], want: list[Frame]) -> bool:
    def key(f: Frame) -> object:
        return (f.request_id, f.address, f.digest, bytes(f.payload)) if isinstance(f, Block) else f
    return [key(f) for f in got] == [key(f) for f in want]


def _stock_peer(sock: ssl.SSLSocket, want: int, reply: list[Frame], got: list[Frame]) -> None:
    """A stock `ssl` socket's end: read `want` frames, answer `reply`, then a close_notify."""
    sock.settimeout(30)
    decoder = FrameDecoder(max_payload=4 << 20)
    while len(got) < want:
        data = sock.recv(1 << 20)
        if not data:
            break
        got += decoder.feed(data)
    for frame in reply:
        sock.sendall(encode(frame))
    sock.unwrap().close()


@pytest.mark.parametrize("our_side,own", [("client", True), ("server", True), ("client", False)],
                         ids=["our-client", "our-server", "our-client-records-left-to-openssl"])
def test_a_stock_ssl_peer_and_our_record_layer_interoperate(cert_dir: Path, our_side: str, own: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames both ways between a TlsLink sealing its own records (a KeyUpdate every 5 records,
    so OpenSSL checks those too) and a blocking `ssl` socket; the stock side's session tickets
    and close_notify reach our side as such. The same with the records left to OpenSSL."""
    monkeypatch.setattr(records_module, "KEY_UPDATE_RECORDS", 5)
    monkeypatch.setattr(channel_module, "OWN_RECORDS", own)
    ours, theirs = _frames(12), _frames(9)
    stock_got: list[Frame] = []
    received: list[Frame] = []
    closed: list[MissReason] = []

    async def main() -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        loop = asyncio.get_running_loop()
        if our_side == "client":
            def serve() -> None:
                raw, _ = listener.accept()
                with creds(cert_dir, "node-a").ssl_context(server=True).wrap_socket(raw, server_side=True) as s:
                    _stock_peer(s, len(ours), theirs, stock_got)
            thread = threading.Thread(target=serve)
            thread.start()
            channel = await open_tls(Peer("node-a", "127.0.0.1", port), creds(cert_dir, "client-1"), 10)
        else:
            def dial() -> None:
                raw = socket.create_connection(("127.0.0.1", port))
                ctx = creds(cert_dir, "client-1").ssl_context(server=False)
                with ctx.wrap_socket(raw, server_hostname="node-a") as s:
                    _stock_peer(s, len(ours), theirs, stock_got)
            thread = threading.Thread(target=dial)
            thread.start()
            listener.setblocking(False)
            raw, _ = await loop.sock_accept(listener)
            channel = await accept_tls(raw, creds(cert_dir, "node-a"), 10)
        link = TlsLink(channel, FrameDecoder(max_payload=4 << 20), received.extend, closed.append, 10.0,
                       TransportMetrics(), "test", batch_frames=True)
        try:
            assert (channel.records is not None) == own   # this side seals and opens the records itself
            link.start()
            link.send_many(ours)
            await wait_until(lambda: bool(closed), 30)
        finally:
            link.close(MissReason.PEER_GONE, "test over")
            listener.close()
            await asyncio.to_thread(thread.join, 30)

    asyncio.run(main())
    assert _same(stock_got, ours)
    assert _same(received, theirs)
    assert closed == [MissReason.PEER_GONE]   # the stock side's close_notify after whole frames


async def _recv(sock: socket.socket) -> bytes:
    return await asyncio.get_running_loop().sock_recv(sock, 4096)


def test_a_tampered_record_from_an_openssl_peer_closes_the_link_and_tells_the_peer(cert_dir: Path) -> None:
    """One flipped bit in a payload's record: the frames before it arrive, the tampered frame never
    does, the link closes as a peer error, and the peer's OpenSSL reads a bad_record_mac alert."""
    sent: list[Frame] = [Hello("client-1"), *_frames(2)]
    received: list[Frame] = []
    closed: list[MissReason] = []

    async def main() -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        listener.setblocking(False)
        dial = asyncio.ensure_future(open_tls(Peer("node-a", "127.0.0.1", listener.getsockname()[1]),
                                              creds(cert_dir, "client-1"), 10))
        raw, _ = await asyncio.get_running_loop().sock_accept(listener)
        server = await accept_tls(raw, creds(cert_dir, "node-a"), 10)
        client = await dial   # never handed to a link: OpenSSL seals its records, as a stock peer's
        link = TlsLink(server, FrameDecoder(max_payload=4 << 20), received.extend, closed.append, 10.0,
                       TransportMetrics(), "test")
        try:
            wire = bytearray()
            for frame in sent:
                data = memoryview(encode(frame))
                while data:
                    data = data[client.write(data):]
                wire += client.take_outgoing()
            wire[-200] ^= 0x04   # inside the last Block's payload
            link.start()
            await asyncio.get_running_loop().sock_sendall(client.sock, bytes(wire))
            await wait_until(lambda: bool(closed))
            with pytest.raises(ssl.SSLError, match=r"(?i)bad.record.mac"):   # after the session tickets
                while True:
                    try:
                        client.obj.read(1024)
                    except ssl.SSLWantReadError:
                        got = await asyncio.wait_for(_recv(client.sock), 10)
                        assert got, "the link closed without an alert"
                        client.incoming.write(got)
        finally:
            link.close(MissReason.PEER_GONE, "test over")
            client.close(notify=False)
            listener.close()

    asyncio.run(main())
    assert _same(received, sent[:-2])   # Hello and the first Block; not the tampered one
    assert closed == [MissReason.PEER_ERROR]


def test_a_client_random_logged_twice_gets_no_secrets_for_either_handshake() -> None:
    """A client chooses its hello random: a replayed one must not hand one connection's keys to another
    (both would seal under one key and nonce sequence). Lines are appended to the real in-memory key log
    as OpenSSL writes them."""
    from transports.tls import keylog

    if not keylog.available():
        pytest.skip("no memfd_create on this platform (Linux feature)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    assert keylog.watch(context)
    path = context.keylog_filename

    def log(random: bytes, client: bytes, server: bytes) -> None:
        with open(path, "ab") as f:
            f.write(b"CLIENT_TRAFFIC_SECRET_0 %s %s\n" % (random.hex().encode(), client.hex().encode()))
            f.write(b"SERVER_TRAFFIC_SECRET_0 %s %s\n" % (random.hex().encode(), server.hex().encode()))

    fresh, replayed, late = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
    log(fresh, b"c" * 32, b"s" * 32)
    assert keylog.traffic_secrets(context, fresh) == (b"c" * 32, b"s" * 32)
    log(replayed, b"a" * 32, b"b" * 32)
    log(replayed, b"x" * 32, b"y" * 32)           # a second hello with the same random, before either took
    assert keylog.traffic_secrets(context, replayed) is None
    assert keylog.traffic_secrets(context, replayed) is None
    log(late, b"d" * 32, b"e" * 32)
    assert keylog.traffic_secrets(context, late) == (b"d" * 32, b"e" * 32)
    log(late, b"f" * 32, b"g" * 32)               # the same random after its secrets were handed out
    assert keylog.traffic_secrets(context, late) is None
