"""Framed TLS 1.3 connections on the asyncio event loop, in large socket reads and writes.

`TlsLink` carries kvfabric frames over one `TlsChannel` (OpenSSL over memory BIOs, channel.py):

    socket ──recv_into(READ_SIZE)──► read buffer ──FEED_SIZE at a time──► incoming BIO
           ──SSL_read──► FrameDecoder.get_buffer()  (a payload's own buffer from its first byte)
                              │ buffer_updated(n) → frames → on_frames(frames)
    send(frame) ─► plaintext queue: [head][payload pieces: views] …
           ─SSL_write, FEED_SIZE at a time─► outgoing BIO ─read()─► ciphertext ─sendmsg─► socket

One socket read takes up to READ_SIZE bytes, many TLS records; one `sendmsg` sends a batch of
them: an answer starts with FIRST_BATCH (the peer opens it while this side seals the next), goes
on FEED_SIZE at a time, and after BURST_HEAD (or once the socket is full) WRITE_BATCH at a time: a
few system calls per MiB, where OpenSSL on the socket makes two reads and one write per record. A
reader whose owner expects more answers wakes per READ_AHEAD bytes of a payload (`_read_ahead`).

Invariants:
  * every OpenSSL call of a connection happens on the event loop thread (it is not thread-safe);
  * ciphertext leaves in the order OpenSSL made it (a key update reply made by a read included);
  * about WRITE_BATCH bytes at most are encrypted ahead of what the socket took;
  * `on_closed` is called exactly once, after which nothing is read or sent;
  * `last_rx` / `last_tx` are the loop times of the last progress, for the owner's stall checks.

Where the channel hands over its records (`TlsChannel.take_records`), OpenSSL is out of the data
path and records are opened and sealed in this process (records.py):

    socket ──recv_into──► read buffer ──RecordLayer.open_into──► FrameDecoder.get_buffer()
    send(frame) ─► plaintext queue ──RecordLayer.seal_run (a payload's records in one call)──► send buffer
           ─sendmsg─► socket      (send buffers are reused once the socket took them)

A batch is sealed in one pass into one send buffer. A payload's records are decrypted straight into
its buffer, each exactly once (a payload's last, if full, through a scratch record: its type byte
would not fit); a record that fails authentication closes the connection (bad_record_mac to the
peer) before any of its bytes count. The mutual TLS handshake is `transports.tls.handshake`'s.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
from collections import deque
from collections.abc import Callable

from transports.core.buffers import uninitialised_bytearray
from transports.core.codec import (
    DEFAULT_MAX_PAYLOAD,
    Frame,
    FrameDecoder,
    MissReason,
    ProtocolError,
    encode_parts,
    payload_pieces,
)
from transports.core.link import WRITE_HIGH, LinkBase
from transports.core.metrics import TransportMetrics
from transports.tls.channel import TlsChannel
from transports.tls.handshake import auth_failure_reason
from transports.tls.records import MAX_CONTENT, MAX_RECORD, RecordError, RecordLayer
from transports.trust.provenance_tables import SentRecords

logger = logging.getLogger(__name__)

TRANSPORT = "tls-tcp"   # the metrics label of TLS-TCP (server and client)

READ_BUDGET = 4 * 1024 * 1024   # bytes read per loop callback before other tasks get a turn
READ_SIZE = 1024 * 1024         # one socket read: up to 64 full TLS records
FEED_SIZE = 256 * 1024          # ciphertext moved into the BIO, or encrypted out of it, at a time
FIRST_BATCH = 64 * 1024         # ciphertext of the first sendmsg of a burst: the peer starts opening it soonest
BURST_HEAD = 1024 * 1024        # bytes of a burst sent FEED_SIZE at a time, then WRITE_BATCH at a time
WRITE_BATCH = 1024 * 1024       # ciphertext sent by one sendmsg once a burst is long, or the socket full
TLS_RECORD = 16 * 1024          # largest TLS plaintext record
SMALL = 4 * 1024                # queued pieces under this are joined into one record
RECHECK_AFTER = 64 * 1024       # ciphertext opened after a short read before the socket is tried again
STAGE_SPAN = 4 * 1024           # ciphertext opened into the decoder's staging area beyond its next record
READ_AHEAD = 256 * 1024         # payload bytes the kernel gathers before it wakes a reader expecting more
SEND_BUFFER = WRITE_BATCH + 2 * MAX_RECORD   # one batch of sealed records (own record layer)
SPARE_SEND_BUFFERS = 3          # send buffers kept for reuse once the socket took them


class TlsLink(LinkBase):
    """Frames in and out of one TLS channel; knows nothing about pulls.

    `on_frames(frames)` may raise ProtocolError; `on_closed(reason)` is called exactly once.
    `read_size`: bytes one socket read may take (a server, which receives only PULLs, needs less)."""

    def __init__(self, channel: TlsChannel, decoder: FrameDecoder, on_frames: Callable[[list[Frame]], None],
                 on_closed: Callable[[MissReason], None], frame_timeout_s: float, metrics: TransportMetrics,
                 transport: str, max_payload: int = DEFAULT_MAX_PAYLOAD, batch_frames: bool = False,
                 write_high: int = WRITE_HIGH, read_size: int = READ_SIZE) -> None:
        self._init_link(transport, metrics, write_high)
        self.batch_frames = batch_frames  # hand over all frames of one read callback at once
        self._channel = channel
        self._sock: socket.socket = channel.sock
        self._incoming = channel.incoming
        self._read, self._write = channel.read, channel.write
        self._fd = channel.fileno()
        self._decoder = decoder
        self._on_frames, self._on_closed = on_frames, on_closed
        self.max_payload, self.frame_timeout_s = max_payload, frame_timeout_s
        taken = channel.take_records()
        self._records: RecordLayer | None = None if taken is None else taken[0]
        if taken is None:
            self._rbuf = memoryview(bytearray(read_size))
        else:   # room for a partial record kept from the last read, then a whole read
            leftover = taken[1]
            self._rbuf = memoryview(bytearray(max(read_size, len(leftover)) + MAX_RECORD))
            self._rbuf[:len(leftover)] = leftover
        self._read_size = read_size
        self._filled = self._fed = 0   # bytes of the last socket read, and how many went to the BIO
        self._rpos, self._rend = 0, 0 if taken is None else len(taken[1])   # unopened ciphertext (own records)
        self._spare: list[bytearray] = []   # send buffers the socket has taken (own records)
        self._out, self._at = memoryview(b""), 0   # the send buffer being sealed into, and where (own records)
        self._socket_dry = self._at_eof = False
        self._plain: deque[memoryview] = deque()    # queued, not yet encrypted
        self._plain_bytes = 0
        self._cipher: deque[memoryview] = deque()   # encrypted, not yet taken by the socket
        self._cipher_bytes = 0
        self._sent = SentRecords()   # records this stream carried: later frames name them by number
        self._batch = FIRST_BATCH    # ciphertext to have ready before a sendmsg (see _flush)
        self._burst = 0              # bytes sent in this burst (see _flush)
        self._heard = False          # frames came from the peer since this burst began
        self._writer_on = self._reading = self._got_bytes = False
        self._tls_broken = False     # no close_notify after a TLS error
        self._wake_at = 1            # the socket's SO_RCVLOWAT (see _read_ahead); 0: not settable

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
            self._loop.call_soon(self._on_readable)  # the incoming BIO may hold whole records already

    @property
    def mid_frame(self) -> bool:
        return self._decoder.mid_frame

    def _feed(self) -> bool:
        """Move the next FEED_SIZE bytes of the last socket read into the incoming BIO (reading the
        socket once that read is used up; its end as EOF); False when the socket has nothing now."""
        if self._fed == self._filled:
            if self._at_eof:   # OpenSSL wants more after the end of the stream: it ends here
                raise ssl.SSLEOFError("the peer closed TCP inside a TLS record")
            if self._socket_dry:
                return False
            try:
                n = self._sock.recv_into(self._rbuf)
            except (BlockingIOError, InterruptedError):
                return False
            if not n:
                self._incoming.write_eof()
                self._at_eof = True
                return True
            # A short read emptied the socket: the next one would find nothing until the fd says so.
            self._socket_dry = n < self._rbuf.nbytes
            self._fed, self._filled = 0, n
        end = min(self._filled, self._fed + FEED_SIZE)
        self._incoming.write(self._rbuf[self._fed:end])
        self._fed = end
        return True

    def _on_readable(self) -> None:
        if self._records is not None:
            self._on_readable_records(self._records)
            return
        budget = READ_BUDGET
        frames: list[Frame] = []
        self._got_bytes = got_any = False
        self._socket_dry = False
        decoder, read = self._decoder, self._read
        try:
            while self._reading and not self.closed:
                if budget <= 0:   # the BIO may hold records that the fd will not signal
                    self._loop.call_soon(self._on_readable)
                    break
                buf = decoder.get_buffer()
                size = len(buf)
                n = 0
                ended = dry = False
                try:
                    n = read(size, buf)   # one TLS record at most, decrypted into `buf`
                    if not n:
                        ended = True      # the peer's close_notify
                    elif decoder.receiving_payload:
                        # The payload's own buffer: fill it record after record, tell the decoder once.
                        while n < size:
                            got = read(size - n, buf[n:])
                            if not got:
                                ended = True
                                break
                            n += got
                except ssl.SSLWantReadError:   # no whole record in the BIO
                    dry = True
                if n:
                    got_any = self._got_bytes = True
                    frames += decoder.buffer_updated(n)
                    budget -= n
                    if frames and not self.batch_frames:
                        self._deliver(frames)
                        frames = []
                if ended:
                    raise ssl.SSLEOFError("peer sent close_notify")
                if dry and not self._feed():
                    break
        except (ssl.SSLError, OSError, ProtocolError) as e:
            self._read_ended(frames, e)
            return
        if got_any:
            self.last_rx = self._loop.time()   # once per callback: a callback reads at most READ_BUDGET
        self._deliver(frames)
        if self._channel.outgoing.pending and not self.closed:   # a reply OpenSSL made while reading
            self._flush()

    def _read_ended(self, frames: list[Frame], e: BaseException) -> None:
        """A read path stopped on `e`: hand over what was decoded before it, then end as `e` says."""
        self._deliver(frames)
        if isinstance(e, ssl.SSLEOFError):
            try:
                self._decoder.close()
            except ProtocolError as err:
                self.protocol_error(err)
                return
            self.close(MissReason.PEER_GONE, "peer closed the connection")
        elif isinstance(e, ssl.SSLError):
            self._tls_failed(e)
        elif isinstance(e, ProtocolError):
            self.protocol_error(e)
        else:
            self.close(MissReason.PEER_GONE, f"read failed: {e}")

    def _deliver(self, frames: list[Frame]) -> None:
        """Hand over the frames of a read (none: part of a frame came, for the owner's deadlines)."""
        if (not frames and not self._got_bytes) or self.closed:
            return
        self._got_bytes = False
        self._heard = self._heard or bool(frames)
        try:
            self._on_frames(frames)
        except ProtocolError as e:
            self.protocol_error(e)

    # -- reading through this process's record layer
    def _recv_records(self) -> bool:
        """Read the socket after the unopened ciphertext (moved to the front first); False when the
        socket has nothing now. Raises SSLEOFError at the end of the stream (no close_notify)."""
        if self._socket_dry:
            return False
        src, pos, end = self._rbuf, self._rpos, self._rend
        if pos:
            src[:end - pos] = src[pos:end]   # at most a partial record: only then is more needed
            pos, end = 0, end - pos
            self._rpos, self._rend = pos, end
        room = min(src.nbytes - end, self._read_size)
        try:
            n = self._sock.recv_into(src[end:], room)
        except (BlockingIOError, InterruptedError):
            return False
        if not n:
            raise ssl.SSLEOFError("the peer closed TCP inside a TLS record" if end else
                                  "the peer closed TCP without a close_notify")
        self._socket_dry = n < room   # a short read emptied the socket
        self._rend = end + n
        return True

    def _on_readable_records(self, records: RecordLayer) -> None:
        budget = READ_BUDGET
        frames: list[Frame] = []
        self._got_bytes = got_any = False
        self._socket_dry = False
        decoder, src, open_into = self._decoder, self._rbuf, records.open_into
        try:
            while self._reading and not self.closed:
                if budget <= 0:   # the buffer may hold records that the fd will not signal
                    self._loop.call_soon(self._on_readable)
                    break
                start, end = self._rpos, self._rend
                buf = decoder.get_buffer()
                if not decoder.receiving_payload:
                    # The decoder's staging area: the next record, and more only within STAGE_SPAN
                    # bytes, so that a payload's records after its frame's head are opened into the
                    # payload's own buffer once the head is parsed (small records still go in one call).
                    first = records.record_end(src, start, end)
                    if first >= 0:
                        end = min(end, max(first, start + STAGE_SPAN))
                pos, n = open_into(src, start, end, buf)
                self._rpos = pos
                budget -= pos - start   # ciphertext: records without data (tickets, empty ones) count too
                if n:
                    got_any = self._got_bytes = True
                    frames += decoder.buffer_updated(n)
                    # No whole record left: read now, not on the next pass; after a large read, even if
                    # it was short (the peer has likely sent more: one recv, not a turn of the loop).
                    stop = records.record_end(src, pos, self._rend)
                    if (stop < 0 or stop > self._rend) and records.failure is None and not records.peer_closed:
                        if pos - start >= RECHECK_AFTER:
                            self._socket_dry = False
                        if not self._recv_records():
                            break
                elif pos == start and records.failure is None and not records.peer_closed:
                    stop = records.record_end(src, pos, self._rend)
                    if 0 <= stop <= self._rend:   # a whole record, larger than what is left of `buf`
                        self._rpos, plain = records.open_one(src, pos, self._rend)
                        got_any = self._got_bytes = True
                        frames += self._take_plain(plain)
                        budget -= stop - pos
                    elif not self._recv_records():
                        break
                if frames and not self.batch_frames:
                    self._deliver(frames)
                    frames = []
                if records.failure is not None or records.peer_closed:
                    raise ssl.SSLEOFError("peer sent close_notify") if records.failure is None else records.failure
        except (ssl.SSLError, OSError, ProtocolError) as e:
            self._read_ended(frames, e)
            return
        if got_any:
            self.last_rx = self._loop.time()
        self._deliver(frames)
        if not self.closed:
            self._read_ahead()
        if records.outbox and not self.closed:   # a KeyUpdate answering the peer's
            self._flush()

    def _read_ahead(self) -> None:
        """While more answers are due and READ_AHEAD or more of this payload is still to come (its
        ciphertext is at least its plaintext, less the unopened bytes here), the socket wakes the loop
        once READ_AHEAD bytes are there, not per segment (a wake-up costs the sender too). The wait
        always ends; a payload's last READ_AHEAD bytes, and a get of one block, are read as they land."""
        ahead = self._decoder.payload_left - (self._rend - self._rpos)
        want = READ_AHEAD if ahead >= READ_AHEAD and self.more_due() else 1
        if want != self._wake_at and self._wake_at:
            try:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
            except (OSError, AttributeError):   # not settable here: every segment wakes the loop
                want = 0
            self._wake_at = want

    def _take_plain(self, plain: memoryview) -> list[Frame]:
        """Hand `plain` (opened elsewhere than the decoder's buffer) to the decoder."""
        frames: list[Frame] = []
        decoder = self._decoder
        while plain:
            buf = decoder.get_buffer()
            k = min(buf.nbytes, plain.nbytes)
            buf[:k] = plain[:k]
            frames += decoder.buffer_updated(k)
            plain = plain[k:]
        return frames

    def _tls_failed(self, err: ssl.SSLError) -> None:
        records = self._records
        if isinstance(err, RecordError) and err.alert is not None and records is not None and not self._cipher:
            with contextlib.suppress(OSError, RecordError):   # tell the peer why, if the socket takes it now
                self._sock.send(records.alert(err.alert))
        self._tls_broken = True
        reason = auth_failure_reason(err)
        if reason != "handshake":  # the peer refused our certificate with an alert
            self._metrics.auth_failures.labels(self.transport, f"refused_{reason}").inc()
            logger.warning("peer refused our certificate: %s", err)
        self.close(MissReason.PEER_ERROR, f"TLS error: {err}")

    # -- writing
    def send(self, frame: Frame) -> None:
        self.send_many([frame])

    def send_many(self, frames: list[Frame]) -> None:
        """Queue `frames`, then send what the socket takes."""
        if self.closed or not frames:
            return
        if not self._plain and not self._cipher:
            if self._heard:   # the peer spoke since the last burst began: this is an answer, a burst of its own
                self._batch, self._burst, self._heard = FIRST_BATCH, 0, False
            self.last_tx = self._loop.time()   # the send-stall timer runs from the moment something waits
        self._empty.clear()
        for frame in frames:
            self._queue(frame)
        if not self._writer_on:
            self._flush()

    def _queue(self, frame: Frame) -> None:
        # A frame's head is a piece of its own and each payload buffer (a BLOCKS frame has one per
        # part) is queued as a view, not copied. A payload then starts on a TLS record boundary,
        # so the peer decrypts it straight into its buffer from its first byte; small pieces in a
        # row (a head and a short payload, MISS and END frames) are joined into one record.
        head, payload = encode_parts(frame, max_payload=self.max_payload, sent=self._sent)
        self._plain.append(memoryview(head))
        self._plain_bytes += len(head)
        for piece in payload_pieces(payload):
            view = memoryview(piece).cast("B")
            if view.nbytes:
                self._plain.append(view)
                self._plain_bytes += view.nbytes

    def _queued_bytes(self) -> int:
        return self._plain_bytes + self._cipher_bytes

    def _encrypt(self, limit: int) -> None:
        """Encrypt about `limit` bytes of queued pieces through OpenSSL; queue what it wrote for the socket."""
        plain, write = self._plain, self._write
        done = 0
        small = bytearray()
        while plain and done < limit:
            piece = plain[0]
            if piece.nbytes < SMALL:
                plain.popleft()
                small += piece
                done += piece.nbytes
                continue
            if small:
                write(memoryview(small))
                small = bytearray()
            # A large payload goes in steps of whole records, about `limit` at a time: the BIO stays
            # cache-sized and every record but a payload's last is full.
            step = max((limit - done) // TLS_RECORD * TLS_RECORD, TLS_RECORD)
            if piece.nbytes > step:
                plain[0] = piece[step:]
                piece = piece[:step]
            else:
                plain.popleft()
            n = write(piece)   # a memory BIO never blocks: OpenSSL takes it all, record by record
            done += n
            if n < piece.nbytes:   # not expected (partial writes are not enabled): the rest goes next
                plain.appendleft(piece[n:])
        self._plain_bytes -= done
        if small:
            write(memoryview(small))
        self._take_outgoing()

    def _seal(self, records: RecordLayer, limit: int) -> None:
        """Seal about `limit` bytes of queued pieces into send buffers: small pieces in a row joined,
        a large one in full records from its first byte (the peer opens it into its buffer)."""
        plain = self._plain
        self._out, self._at = self._send_buffer(), 0
        done = 0
        small: list[memoryview] = []
        small_bytes = 0
        while plain and done < limit:
            piece = plain[0]
            size = piece.nbytes
            if size < SMALL and small_bytes + size <= MAX_CONTENT:
                plain.popleft()
                small.append(piece)
                small_bytes += size
                done += size
                continue
            if small:
                self._seal_small(records, small, small_bytes)
                small, small_bytes = [], 0
                continue
            # whole records up to `limit` (at least one) before a KeyUpdate is due; a payload's last goes with the rest
            left = records.records_before_update()
            if not left:
                self._place(records.update_keys())
                left = records.records_before_update()
            step = min(max((limit - done) // MAX_CONTENT, 1), left) * MAX_CONTENT
            if size > step + (MAX_CONTENT if step < left * MAX_CONTENT else 0):
                plain[0] = piece[step:]
                piece, size = piece[:step], step
            else:
                plain.popleft()
            self._make_room(records.run_size(size))
            self._at = records.seal_run(piece, self._out, self._at)
            done += size
        if small:
            self._seal_small(records, small, small_bytes)
        self._plain_bytes -= done
        out, at = self._out, self._at
        if at:
            self._queue_cipher(out[:at])
        else:
            self._spare.append(out.obj)   # type: ignore[arg-type]  # a send buffer: a bytearray

    def _seal_small(self, records: RecordLayer, pieces: list[memoryview], size: int) -> None:
        if not records.records_before_update():
            self._place(records.update_keys())
        self._make_room(records.sealed_size(size))
        self._at = records.seal_pieces(pieces, self._out, self._at)

    def _make_room(self, need: int) -> None:
        """Queue the current send buffer and start another when `need` more bytes would not fit."""
        if self._at + need > self._out.nbytes:
            self._queue_cipher(self._out[:self._at])
            self._out, self._at = self._send_buffer(), 0

    def _place(self, record: bytes) -> None:
        self._make_room(len(record))
        self._out[self._at:self._at + len(record)] = record
        self._at += len(record)

    def _send_buffer(self) -> memoryview:
        return memoryview(self._spare.pop() if self._spare else uninitialised_bytearray(SEND_BUFFER))

    def _queue_cipher(self, data: memoryview) -> None:
        if data.nbytes:
            self._cipher.append(data)
            self._cipher_bytes += data.nbytes

    def _take_outgoing(self) -> None:
        records = self._records
        if records is not None:
            for record in records.outbox:
                self._queue_cipher(memoryview(record))
            records.outbox.clear()
            return
        out = self._channel.outgoing
        if out.pending:
            self._queue_cipher(memoryview(out.read()))

    def _flush(self) -> None:
        """Encrypt and send until the socket is full or nothing waits, a batch per sendmsg, as the
        module docstring says (a burst: what is sent after the peer last spoke). A tail under SMALL
        bytes (an answer's END) joins the batch before it: one wake-up less for the peer."""
        cipher, records, spare = self._cipher, self._records, self._spare
        while not self.closed:
            try:
                if records is None or records.outbox:
                    self._take_outgoing()
                # Own records are sealed a batch at a time (into one send buffer); OpenSSL's go
                # through the BIO FEED_SIZE at a time.
                while self._plain and (self._cipher_bytes < self._batch or self._plain_bytes < SMALL):
                    limit = max(self._batch - self._cipher_bytes, SMALL)
                    if records is not None:
                        self._seal(records, limit)
                    else:
                        self._encrypt(min(limit, FEED_SIZE))
            except ssl.SSLError as e:
                self._tls_failed(e)
                return
            if not cipher:
                break
            try:
                n = self._sock.sendmsg(cipher if len(cipher) <= 64 else list(cipher)[:64])
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                self.close(MissReason.PEER_GONE, f"write failed: {e}")
                return
            self.last_tx = self._loop.time()
            self._cipher_bytes -= n
            self._burst += n
            while n:
                head = cipher[0]
                if n >= head.nbytes:
                    n -= head.nbytes
                    cipher.popleft()
                    obj = head.obj
                    if (records is not None and type(obj) is bytearray and len(obj) == SEND_BUFFER
                            and len(spare) < SPARE_SEND_BUFFERS):
                        spare.append(obj)
                else:
                    cipher[0] = head[n:]
                    n = 0
            if cipher:   # the socket is full: the writer callback goes on, in larger batches
                self._batch = WRITE_BATCH
                break
            self._batch = WRITE_BATCH if self._burst >= BURST_HEAD else FEED_SIZE
        if self._queued_bytes() <= self.write_high:
            self._drained.set()
        if not self._plain and not self._cipher:
            self._empty.set()
        self._update_writer()

    def _on_writable(self) -> None:
        self._flush()

    def _update_writer(self) -> None:
        want = not self.closed and bool(self._plain or self._cipher)
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
        # A close_notify only where no record was cut short: after it the peer could not parse one.
        notify = not self._tls_broken and not self._cipher
        self._plain.clear()
        self._cipher.clear()
        self._plain_bytes = self._cipher_bytes = 0
        self._spare.clear()
        self._drained.set()
        self._empty.set()
        self._channel.close(notify=notify)
        self._on_closed(reason)
