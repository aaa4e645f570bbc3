"""Framed TLS 1.3 connections on the asyncio event loop, without asyncio's SSL protocol.

`TlsLink` carries kvfabric frames over one non-blocking `ssl.SSLSocket`:

    socket ──SSL_read──► FrameDecoder.get_buffer()  (a payload's own buffer unless its rest is tiny)
                              │ buffer_updated(n) → frames → on_frames(frames)
    send(frame) ─► queue: [head + payload's first bytes, one TLS record][rest: a view] … ─SSL_write─► socket

OpenSSL reads the socket itself and decrypts straight into the payload buffer, so a received
byte is copied once, by the decryption (asyncio's SSL transport first copies into a memory BIO).
The client CPU per MiB of this design, of asyncio's SSL transport with a BufferedProtocol, of a
blocking SSLSocket thread and of a memory-BIO reader are within the noise of each other on loopback
(docs/benchmarks.md); this one is used because it needs no thread per connection and keeps every OpenSSL call
of a connection on one thread.

Invariants:
  * every read and write of the SSLSocket happens on the event loop thread (an OpenSSL
    connection is not thread-safe);
  * after SSL_write reports WANT_WRITE the same chunk is retried first (OpenSSL requires it);
  * `on_closed` is called exactly once, after which nothing is read or sent;
  * `last_rx` / `last_tx` are the loop times of the last progress, for the owner's stall checks.
Reading costs O(1) Python calls per 16 KiB TLS record; writing O(1) per frame plus one per
would-block.

The mutual TLS handshake that makes the SSLSocket is `transports.tls.handshake`.
"""

from __future__ import annotations

import logging
import ssl
from collections import deque
from collections.abc import Callable
from typing import cast

from transports.core.codec import (
    DEFAULT_MAX_PAYLOAD,
    DIRECT_MIN,
    Frame,
    FrameDecoder,
    MissReason,
    ProtocolError,
    encode_parts,
    payload_pieces,
)
from transports.core.link import WRITE_HIGH, LinkBase
from transports.core.metrics import TransportMetrics
from transports.core.provenance_tables import SentRecords
from transports.tls.handshake import auth_failure_reason

logger = logging.getLogger(__name__)

TRANSPORT = "tls-tcp"   # the metrics label of TLS-TCP (server and client)

READ_BUDGET = 4 * 1024 * 1024   # bytes read per loop callback before other tasks get a turn
TLS_RECORD = 16 * 1024          # largest TLS plaintext record


def openssl_calls(sock: ssl.SSLSocket) -> tuple[Callable[[int, memoryview], int], Callable[[memoryview], int]]:
    """`read(len, buffer) -> count` and `write(data) -> count` of the OpenSSL connection under `sock`.

    `SSLSocket.read` / `send` are Python wrappers around `sock._sslobj` (CPython's `_ssl._SSLSocket`,
    there since 3.7): a closed-socket check, and `read` turns an EOF without close_notify into 0.
    A pull makes one read per 16 KiB TLS record, so those wrapper frames are paid 64 times per MiB;
    calling `_sslobj` directly saves that CPU (paired figures in docs/benchmarks.md).
    Callers handle `ssl.SSLEOFError` as end of stream. Falls back to the wrappers if a Python lacks
    `_sslobj`."""
    raw = getattr(sock, "_sslobj", None)
    if raw is None:
        return cast(Callable[[int, memoryview], int], sock.read), sock.send
    return raw.read, raw.write


class TlsLink(LinkBase):
    """Frames in and out of one non-blocking SSLSocket; knows nothing about pulls.

    `on_frames(frames)` may raise ProtocolError; `on_closed(reason)` is called exactly once."""

    def __init__(self, sock: ssl.SSLSocket, decoder: FrameDecoder, on_frames: Callable[[list[Frame]], None],
                 on_closed: Callable[[MissReason], None], frame_timeout_s: float, metrics: TransportMetrics,
                 transport: str, max_payload: int = DEFAULT_MAX_PAYLOAD, batch_frames: bool = False,
                 write_high: int = WRITE_HIGH) -> None:
        self._init_link(transport, metrics, write_high)
        self.batch_frames = batch_frames  # hand over all frames of one read callback at once
        self._sock = sock
        self._read, self._write = openssl_calls(sock)
        self._fd = sock.fileno()
        self._decoder = decoder
        self._on_frames = on_frames
        self._on_closed = on_closed
        self.max_payload = max_payload
        self.frame_timeout_s = frame_timeout_s
        self._out: deque[memoryview] = deque()
        self._sent = SentRecords()   # records this stream carried: later frames name them by number
        self._out_bytes = 0
        self._writer_on = False
        self._read_wants_write = False
        self._write_wants_read = False
        self._reading = False
        self._got_bytes = False

    # -- reading
    def start(self) -> None:
        self.resume_reading()

    def pause_reading(self) -> None:
        if self._reading and not self.closed:
            self._reading = False
            self._loop.remove_reader(self._fd)

    def resume_reading(self) -> None:
        if not self._reading and not self.closed:
            self._reading = True
            self._loop.add_reader(self._fd, self._on_readable)
            self._loop.call_soon(self._on_readable)  # OpenSSL may already hold decrypted bytes

    @property
    def mid_frame(self) -> bool:
        return self._decoder.mid_frame

    def _on_readable(self) -> None:
        budget = READ_BUDGET
        frames: list[Frame] = []
        self._got_bytes = got_any = False
        decoder = self._decoder
        read = self._read
        while self._reading and not self.closed and budget > 0:
            buf = decoder.get_buffer()
            size = len(buf)
            n, more, eof = 0, True, False
            try:
                n = read(size, buf)
                # A payload view (not the staging buffer): fill it record after record (one TLS
                # record per read) and tell the decoder once. A short rest is left to the staging
                # buffer: its record may carry the next frame's head too (see `_queue`), one read.
                if 0 < n < size and decoder.receiving_payload:
                    while size - n >= DIRECT_MIN:
                        got = read(size - n, buf[n:])
                        if not got:
                            break
                        n += got
            except ssl.SSLWantReadError:
                more = False
            except ssl.SSLWantWriteError:  # TLS wants to send first (e.g. a key update reply)
                more = False
                self._read_wants_write = True
                self._update_writer()
            except ssl.SSLEOFError:  # TCP closed without a TLS close_notify: end of stream, as SSLSocket has it
                eof = True
            except ssl.SSLError as e:
                self._deliver(frames)
                self._tls_failed(e)
                return
            except OSError as e:
                self._deliver(frames)
                self.close(MissReason.PEER_GONE, f"read failed: {e}")
                return
            try:
                if n:
                    got_any = self._got_bytes = True
                    frames += decoder.buffer_updated(n)
                    budget -= n
                    if not self.batch_frames and frames:
                        self._deliver(frames)
                        frames = []
                if eof or (not n and more):  # a read of 0 bytes: end of stream
                    self._deliver(frames)
                    decoder.close()
                    self.close(MissReason.PEER_GONE, "peer closed the connection")
                    return
            except ProtocolError as e:
                self._deliver(frames)
                self.protocol_error(e)
                return
            if not more:
                break
        else:
            if budget <= 0:  # OpenSSL may hold decrypted bytes that the fd will not signal
                self._loop.call_soon(self._on_readable)
        if got_any:
            self.last_rx = self._loop.time()   # once per callback: a callback reads at most READ_BUDGET
        self._deliver(frames)
        if self._write_wants_read:
            self._write_wants_read = False
            self._flush()

    def _deliver(self, frames: list[Frame]) -> None:
        """Hand over the frames of a read (none, when it only carried part of a frame: the owner
        still learns that bytes arrived, for its total frame deadline)."""
        if (not frames and not self._got_bytes) or self.closed:
            return
        self._got_bytes = False
        try:
            self._on_frames(frames)
        except ProtocolError as e:
            self.protocol_error(e)

    def _tls_failed(self, err: ssl.SSLError) -> None:
        if isinstance(err, ssl.SSLEOFError):
            self.close(MissReason.PEER_GONE, "peer closed the connection")
            return
        reason = auth_failure_reason(err)
        if reason != "handshake":  # the peer refused our certificate with an alert
            self._metrics.auth_failures.labels(self.transport, f"refused_{reason}").inc()
            logger.warning("peer refused our certificate: %s", err)
        self.close(MissReason.PEER_ERROR, f"TLS error: {err}")

    # -- writing
    def send(self, frame: Frame) -> None:
        self.send_many([frame])

    def send_many(self, frames: list[Frame]) -> None:
        """Queue `frames`, then write what the socket takes: queued together, each frame's tail
        shares a TLS record with the next frame's head."""
        if self.closed or not frames:
            return
        if not self._out:  # the send-stall timer runs from the moment something waits to be sent
            self.last_tx = self._loop.time()
        self._empty.clear()
        for frame in frames:
            self._queue(frame)
        if not self._writer_on:
            self._flush()

    def _queue(self, frame: Frame) -> None:
        head, payload = encode_parts(frame, max_payload=self.max_payload, sent=self._sent)
        out = self._out
        short: bytes | memoryview = head   # under a record: topped up by what follows
        if len(out) > 1 and out[-1].nbytes + len(head) < TLS_RECORD:
            # The last queued chunk (not the head of the queue, which OpenSSL may be retrying) is
            # small, e.g. the previous frame's tail: it shares this frame's first record.
            carried = out.pop()
            self._out_bytes -= carried.nbytes
            short = bytes(carried) + head
        # A BLOCK's head rides in one TLS record with the payload's first bytes: a record of its own
        # would cost a write, a read and their Python calls on both sides for ~100 bytes. Each
        # payload buffer (a BLOCKS frame has one per part) is queued as whole records without a
        # copy; only a piece shorter than a record is joined with the next buffer's lead (a 64 KiB
        # payload + its 113-byte head fill 4 records and 113 bytes). The frame's last short piece
        # is queued as it is: while the queue is backed up, it joins the next frame's first record.
        pieces = payload_pieces(payload)
        if isinstance(payload, tuple) and short:
            # A BLOCKS frame (~1 MiB) can afford its head a record of its own; its parts then start
            # on record boundaries, and parts of a multiple of 16 KiB are queued without any copy.
            self._append(memoryview(short))
            short = b""
        for piece in pieces:
            view = memoryview(piece).cast("B")
            if short:
                room = TLS_RECORD - len(short)
                if view.nbytes < room:   # the whole piece fits in the record being filled
                    short = bytes(short) + view
                    continue
                lead = max(0, room)
                self._append(memoryview(bytes(short) + view[:lead]))
                short, view = b"", view[lead:]
            whole = view.nbytes - view.nbytes % TLS_RECORD
            if whole:
                self._append(view[:whole])
            short = view[whole:]
        if short:
            self._append(memoryview(short))

    def _append(self, chunk: memoryview) -> None:
        self._out.append(chunk)
        self._out_bytes += chunk.nbytes

    def _queued_bytes(self) -> int:
        return self._out_bytes

    def _flush(self) -> None:
        while self._out and not self.closed:
            chunk = self._out[0]
            try:
                # After WANT_WRITE, OpenSSL needs the very same chunk again: it stays at the head.
                n = self._write(chunk)
            except ssl.SSLWantWriteError:
                break
            except ssl.SSLWantReadError:  # TLS must read first; the next readable event retries
                self._write_wants_read = True
                break
            except ssl.SSLError as e:
                self._tls_failed(e)
                return
            except OSError as e:
                self.close(MissReason.PEER_GONE, f"write failed: {e}")
                return
            self.last_tx = self._loop.time()
            self._out_bytes -= n
            if n == len(chunk):
                self._out.popleft()
            else:
                self._out[0] = chunk[n:]
        if self._out_bytes <= self.write_high:
            self._drained.set()
        if not self._out:
            self._empty.set()
        self._update_writer()

    def _on_writable(self) -> None:
        if self._read_wants_write:
            self._read_wants_write = False
            self._loop.call_soon(self._on_readable)
        self._flush()

    def _update_writer(self) -> None:
        want = not self.closed and ((bool(self._out) and not self._write_wants_read) or self._read_wants_write)
        if want and not self._writer_on:
            self._loop.add_writer(self._fd, self._on_writable)
        elif not want and self._writer_on:
            self._loop.remove_writer(self._fd)
        self._writer_on = want

    # -- closing
    def close(self, reason: MissReason, why: str) -> None:
        if self.closed:
            return
        logger.debug("closing connection: %s", why)
        self.pause_reading()
        self.closed = True
        self._update_writer()
        self._out.clear()
        self._out_bytes = 0
        self._drained.set()
        self._empty.set()
        self._sock.close()
        self._on_closed(reason)
