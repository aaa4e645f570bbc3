"""TlsLink over real mutual-TLS loopback connections: frames queued while the peer does not read all
arrive intact and in order; records cut anywhere by the socket reads, a close_notify, garbage in
place of records and a record that never ends are each what a user of the link expects."""

from __future__ import annotations

import asyncio
import fcntl
import os
import socket
import termios
from collections.abc import Callable
from pathlib import Path

import pytest
from support import creds, wait_until

from fabric.keys import BlockAddress, BlockHash
from transports.core.base import Peer
from transports.core.codec import Block, End, Frame, FrameDecoder, Hello, Miss, MissReason, encode
from transports.core.metrics import TransportMetrics
from transports.tls.channel import TlsChannel
from transports.tls.handshake import accept_tls, open_tls
from transports.tls.link import FEED_SIZE, READ_AHEAD, TLS_RECORD, TlsLink


def _frames() -> list[Frame]:
    """Payload sizes around the record size and the 113-byte head, with payload-less frames between."""
    out: list[Frame] = []
    sizes = [64 << 10, 1, 0, TLS_RECORD - 113, TLS_RECORD - 112, TLS_RECORD, 3 * TLS_RECORD + 5, 1 << 20]
    for i, size in enumerate(sizes * 6):
        address = BlockAddress(BlockHash(os.urandom(32)), i)
        out.append(Block(i, address, os.urandom(32), os.urandom(size)))
        if i % 3 == 0:
            out.append(Miss(i, address, MissReason.NOT_FOUND))
    return [*out, End(7)]


def test_frames_queued_behind_a_peer_that_does_not_read_arrive_intact(cert_dir: Path) -> None:
    sent = _frames()
    received: list[Frame] = []
    closed: list[MissReason] = []

    async def main() -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        listener.setblocking(False)
        loop = asyncio.get_running_loop()
        dial = asyncio.ensure_future(open_tls(Peer("node-a", "127.0.0.1", listener.getsockname()[1]),
                                              creds(cert_dir, "client-1"), 5))
        raw, _ = await loop.sock_accept(listener)
        server_sock = await accept_tls(raw, creds(cert_dir, "node-a"), 5)
        client_sock = await dial
        metrics = TransportMetrics()
        sender = TlsLink(server_sock, FrameDecoder(), lambda frames: None, closed.append, 5.0, metrics, "test")
        receiver = TlsLink(client_sock, FrameDecoder(max_payload=2 << 20), received.extend, closed.append, 5.0,
                           metrics, "test", batch_frames=True)
        try:
            sender.start()
            for frame in sent:        # the receiver is not reading yet: the queue backs up
                sender.send(frame)
            assert sender.write_pending
            receiver.start()
            async with asyncio.timeout(10):
                while len(received) < len(sent):
                    await asyncio.sleep(0.01)
        finally:
            sender.close(MissReason.PEER_GONE, "test over")
            receiver.close(MissReason.PEER_GONE, "test over")
            listener.close()

    asyncio.run(main())
    assert len(received) == len(sent)
    for got, want in zip(received, sent, strict=True):
        if isinstance(want, Block):
            assert isinstance(got, Block)
            assert (got.request_id, got.address, got.digest, bytes(got.payload)) == (
                want.request_id, want.address, want.digest, bytes(want.payload))
        else:
            assert got == want


async def _pair(cert_dir: Path) -> tuple[TlsChannel, TlsChannel]:
    """(server channel, client channel) of one real mutual-TLS loopback connection."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    try:
        dial = asyncio.ensure_future(open_tls(Peer("node-a", "127.0.0.1", listener.getsockname()[1]),
                                              creds(cert_dir, "client-1"), 5))
        raw, _ = await asyncio.get_running_loop().sock_accept(listener)
        server = await accept_tls(raw, creds(cert_dir, "node-a"), 5)
        return server, await dial
    finally:
        listener.close()


class Receiver:
    """A TlsLink that reads with `read_size`-byte socket reads, and what it handed over."""

    def __init__(self, channel: TlsChannel, read_size: int) -> None:
        self.frames: list[Frame] = []
        self.closed: list[MissReason] = []
        self.metrics = TransportMetrics()
        self.link = TlsLink(channel, FrameDecoder(max_payload=2 << 20), self.frames.extend, self.closed.append,
                            5.0, self.metrics, "test", read_size=read_size)
        self.link.start()

    def protocol_errors(self) -> float:
        return float(self.metrics.protocol_errors.labels("test")._value.get())


def _ciphertext(channel: TlsChannel, frames: list[Frame]) -> bytes:
    """The TLS records that carry `frames`, written by the peer's own OpenSSL connection."""
    for frame in frames:
        data = memoryview(encode(frame))
        while data:
            data = data[channel.write(data):]
    return channel.take_outgoing()


async def _send_in_pieces(sock: socket.socket, data: bytes, sizes: list[int]) -> None:
    """Send `data` cut into pieces of `sizes` (cycled), letting the receiver run between them."""
    loop, view, i = asyncio.get_running_loop(), memoryview(data), 0
    while view:
        piece, view = view[:sizes[i % len(sizes)]], view[sizes[i % len(sizes)]:]
        await loop.sock_sendall(sock, piece)
        await asyncio.sleep(0)
        i += 1


def _unread(sock: socket.socket) -> int:
    """Bytes waiting in the socket's receive queue."""
    return int.from_bytes(fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"), "little")


def _assert_same(got: list[Frame], want: list[Frame]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if isinstance(w, Block):
            assert isinstance(g, Block) and bytes(g.payload) == bytes(w.payload) and g.digest == w.digest
        else:
            assert g == w


def _through_a_link(cert_dir: Path, sent: list[Frame], decoder: FrameDecoder, *, read_late: bool,
                    watch: Callable[[TlsLink], None] | None = None) -> list[Frame]:
    """Send `sent` from one TlsLink to another over a real mutual-TLS loopback connection: what the
    receiving link (reading with `decoder`) handed over. `read_late`: everything is queued before the
    receiver starts reading; `watch` sees the sending link before it starts."""
    received: list[Frame] = []

    async def main() -> None:
        server, client = await _pair(cert_dir)
        metrics = TransportMetrics()
        sender = TlsLink(server, FrameDecoder(), lambda frames: None, lambda reason: None, 5.0, metrics, "test")
        receiver = TlsLink(client, decoder, received.extend, lambda reason: None, 5.0, metrics, "test")
        if watch is not None:
            watch(sender)
        try:
            sender.start()
            if not read_late:
                receiver.start()
            sender.send_many(sent)
            if read_late:
                receiver.start()
            await wait_until(lambda: len(received) == len(sent), 10)
        finally:
            sender.close(MissReason.PEER_GONE, "test over")
            receiver.close(MissReason.PEER_GONE, "test over")

    asyncio.run(main())
    return received


class _CountingDecoder(FrameDecoder):
    """A decoder that counts the bytes handed to it through its staging area (`feed`)."""

    def __init__(self, **kwargs: int) -> None:
        super().__init__(**kwargs)
        self.staged = 0

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        self.staged += memoryview(data).nbytes
        return super().feed(data)


def test_payload_records_are_opened_into_the_payload_not_staged_after_its_head(cert_dir: Path) -> None:
    """Blocks that arrive together with their heads in one socket read: only the heads go through
    the decoder's staging area; the records of each payload are opened into (or, the last one,
    whose content-type byte needs a byte more, copied into) the payload's own buffer."""
    sent = [Block(i, BlockAddress(BlockHash(os.urandom(32)), i), os.urandom(32), os.urandom(1 << 20))
            for i in range(8)]
    decoder = _CountingDecoder(max_payload=2 << 20)
    # queued before the receiver reads: heads and payloads share reads
    received = _through_a_link(cert_dir, sent, decoder, read_late=True)
    assert [bytes(f.payload) for f in received if isinstance(f, Block)] == [bytes(f.payload) for f in sent]
    assert decoder.staged <= len(sent) * 1024, f"{decoder.staged} bytes staged for {len(sent)} blocks"


def test_a_long_answer_is_sealed_a_send_batch_at_a_time(cert_dir: Path) -> None:
    """Past the head of a burst, records are sealed a whole send batch (up to WRITE_BATCH) per call
    into one send buffer, not FEED_SIZE at a time: fewer passes through the sealing code per MiB."""
    sent = [Block(i, BlockAddress(BlockHash(os.urandom(32)), i), os.urandom(32), os.urandom(1 << 20))
            for i in range(16)]
    runs: list[int] = []

    def count_runs(sender: TlsLink) -> None:
        records = sender._records
        assert records is not None, "the link seals its own records"
        seal_run = records.seal_run

        def counted(data: memoryview, out: memoryview, at: int) -> int:
            runs.append(data.nbytes)
            return seal_run(data, out, at)

        records.seal_run = counted   # type: ignore[method-assign]

    received = _through_a_link(cert_dir, sent, FrameDecoder(max_payload=2 << 20), read_late=False, watch=count_runs)
    assert [bytes(f.payload) for f in received if isinstance(f, Block)] == [bytes(f.payload) for f in sent]
    assert max(runs) > FEED_SIZE, f"the largest run sealed in one call was {max(runs)} bytes"


class _SendCounter:
    """A link's socket, passed through, that remembers each `sendmsg`: the bytes offered, and taken."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.offered: list[int] = []
        self.taken: list[int] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self._sock, name)

    def sendmsg(self, buffers: list[memoryview]) -> int:
        self.offered.append(sum(memoryview(b).nbytes for b in buffers))
        n = self._sock.sendmsg(buffers)
        self.taken.append(n)
        return n


def test_an_answers_end_leaves_with_its_last_block(cert_dir: Path) -> None:
    """A 64 KiB block fills the first send batch of an answer; the END after it goes in that same
    send, not in one of its own (which would wake the reader once more before its answer is whole)."""
    sent: list[Frame] = [Block(1, BlockAddress(BlockHash(os.urandom(32)), 0), os.urandom(32), os.urandom(64 << 10)),
                         End(1)]
    counter: list[_SendCounter] = []

    def count_sends(sender: TlsLink) -> None:
        counter.append(_SendCounter(sender._sock))
        sender._sock = counter[0]   # type: ignore[assignment]

    received = _through_a_link(cert_dir, sent, FrameDecoder(max_payload=1 << 20), read_late=False, watch=count_sends)
    assert [type(f) for f in received] == [Block, End]
    sends = counter[0]
    # All of the answer's ciphertext was offered to the first send (the socket may take less at once)
    assert sends.offered[0] == sum(sends.taken), f"sends offered {sends.offered} bytes and took {sends.taken}"


def _trickle(cert_dir: Path, sent: list[Frame], read_size: int, sizes: list[int],
             watch: Callable[[Receiver, TlsChannel], None] | None = None) -> None:
    """Send the records of `sent` in pieces of `sizes` (cycled, a loop turn between them) to a
    Receiver reading `read_size` bytes at a time (`watch` sees it before the first piece); every
    frame must arrive whole and in order."""
    async def main() -> None:
        server, client = await _pair(cert_dir)
        receiver = Receiver(server, read_size)
        if watch is not None:
            watch(receiver, server)
        try:
            await _send_in_pieces(client.sock, _ciphertext(client, sent), sizes)
            await wait_until(lambda: len(receiver.frames) >= len(sent))
            assert not receiver.closed
        finally:
            receiver.link.close(MissReason.PEER_GONE, "test over")
            client.close()
        _assert_same(receiver.frames, sent)

    asyncio.run(main())


@pytest.mark.parametrize("read_size,sizes", [(4096, [1, 5, 4, 16384 + 22, 7, 100_000]), (1 << 20, [3000, 17, 1])],
                         ids=["reads-shorter-than-a-record", "records-cut-by-the-sender"])
def test_records_split_across_socket_reads_arrive_whole(cert_dir: Path, read_size: int, sizes: list[int]) -> None:
    """Record headers, record bodies and frames cut at every kind of boundary by what one socket
    read returns still decrypt and decode into the frames sent."""
    _trickle(cert_dir, _frames()[:20], read_size, sizes)


@pytest.mark.parametrize("read_ahead", [False, True], ids=["reads-as-it-lands", "reads-ahead"])
def test_a_reader_that_expects_more_answers_is_woken_per_read_ahead_not_per_segment(cert_dir: Path,
                                                                                     read_ahead: bool) -> None:
    """Two 1 MiB blocks trickle in, one TLS record per loop turn. A reader told that more answers
    follow (`more_due`) is woken about once per READ_AHEAD bytes of a payload, and at every
    record only for a payload's last READ_AHEAD bytes; the frames arrive whole either way."""
    sent: list[Frame] = [Block(i, BlockAddress(BlockHash(os.urandom(32)), i), os.urandom(32), os.urandom(1 << 20))
                         for i in range(2)]
    wakeups: list[int] = []   # bytes waiting in the socket at each wake-up

    def count_wakeups(receiver: Receiver, channel: TlsChannel) -> None:
        link = receiver.link
        link.more_due = lambda: read_ahead
        on_readable = link._on_readable

        def counted() -> None:
            wakeups.append(_unread(channel.sock))
            on_readable()

        link.pause_reading()
        link._on_readable = counted   # type: ignore[method-assign]
        link.resume_reading()

    _trickle(cert_dir, sent, 1 << 20, [TLS_RECORD + 22], count_wakeups)
    records = 2 * (1 << 20) // TLS_RECORD
    if read_ahead:   # per payload: its first record, each READ_AHEAD after it, then its last records one by one
        most = 2 * (1 + (1 << 20) // READ_AHEAD + READ_AHEAD // TLS_RECORD + 1)
        assert len(wakeups) <= most, f"{len(wakeups)} wake-ups for {records} records"
        assert max(wakeups) >= READ_AHEAD - TLS_RECORD, wakeups
    else:
        assert len(wakeups) >= records // 4, f"{len(wakeups)} wake-ups for {records} records"


@pytest.mark.parametrize("cut", [False, True], ids=["between-frames", "inside-a-frame"])
def test_close_notify_ends_the_stream_cleanly_only_between_frames(cert_dir: Path, cut: bool) -> None:
    """A close_notify after whole frames is the end of the stream (every frame delivered, no
    protocol error); one inside a frame is a truncated frame: a protocol error for that peer."""
    sent: list[Frame] = [Hello("client-1"), *_frames()[:4]]

    async def main() -> None:
        server, client = await _pair(cert_dir)
        receiver = Receiver(server, 1 << 20)
        try:
            wire = encode(sent[-1])
            records = _ciphertext(client, sent[:-1])
            if cut:   # the last frame's first half, then close_notify
                client.write(memoryview(wire)[:len(wire) // 2])
                records += client.take_outgoing()
            client.notify_close()
            await asyncio.get_running_loop().sock_sendall(client.sock, records + client.take_outgoing())
            await wait_until(lambda: bool(receiver.closed))
        finally:
            client.close(notify=False)
        want = sent[:-1]
        _assert_same(receiver.frames, want)
        assert receiver.closed == [MissReason.PEER_ERROR if cut else MissReason.PEER_GONE]
        assert receiver.protocol_errors() == (1 if cut else 0)

    asyncio.run(main())


@pytest.mark.parametrize("garbage", [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
                                     b"\x17\x03\x03\x00\x40" + os.urandom(64)],
                         ids=["not-tls", "a-record-that-does-not-authenticate"])
def test_garbage_in_place_of_records_closes_the_link_as_a_peer_error(cert_dir: Path, garbage: bytes) -> None:
    """Bytes that are not TLS records of this connection, after a good frame: the good frame is
    delivered, then the link closes as a peer error and hands over nothing from the garbage."""
    async def main() -> None:
        server, client = await _pair(cert_dir)
        receiver = Receiver(server, 1 << 20)
        try:
            good = _ciphertext(client, [Hello("client-1")])
            await asyncio.get_running_loop().sock_sendall(client.sock, good + garbage)
            await wait_until(lambda: bool(receiver.closed))
        finally:
            client.close(notify=False)
        assert receiver.frames == [Hello("client-1")]
        assert receiver.closed == [MissReason.PEER_ERROR]

    asyncio.run(main())


def test_a_record_that_never_ends_delivers_nothing_and_keeps_the_link_open(cert_dir: Path) -> None:
    """A peer that stops inside a TLS record: the whole records before it are delivered, nothing
    of the unfinished one, and the link waits (its owner's idle and frame deadlines cut such a
    peer: test_hostile_peers.py); the rest of the record, when it comes, completes the frame."""
    sent: list[Frame] = [Hello("client-1"), End(3)]   # one record each

    async def main() -> None:
        server, client = await _pair(cert_dir)
        receiver = Receiver(server, 1 << 20)
        loop = asyncio.get_running_loop()
        try:
            first = _ciphertext(client, sent[:1])
            rest = _ciphertext(client, sent[1:])
            await loop.sock_sendall(client.sock, first + rest[:len(rest) // 2])
            await wait_until(lambda: len(receiver.frames) == 1)
            # The receiver took what arrived: its socket is empty, OpenSSL holds the part.
            await wait_until(lambda: _unread(server.sock) == 0)
            assert len(receiver.frames) == 1 and not receiver.closed and not receiver.link.mid_frame
            await loop.sock_sendall(client.sock, rest[len(rest) // 2:])
            await wait_until(lambda: len(receiver.frames) == 2)
            assert not receiver.closed
        finally:
            receiver.link.close(MissReason.PEER_GONE, "test over")
            client.close()
        _assert_same(receiver.frames, sent)

    asyncio.run(main())
