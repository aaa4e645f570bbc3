"""The record-layer baseline of the transfer benchmark (`tls_records`): the stream_blocks protocol (a
24-byte request, then the blocks back to back) over a mutual TLS 1.3 connection whose records are
sealed and opened by kvfabric's own record layer (transports/tls/records.py), on blocking sockets,
with BLAKE3 of each block as it lands. Per byte it does the cryptography a kvfabric TLS-TCP pull
does, with no frames, sessions, link or event loop: a pull's CPU over this one is what those cost.

    server: block ──RecordLayer.seal_run──► send buffer (up to SEND_BATCH of records) ──sendall──►
    client: recv_into ──RecordLayer.open_into──► one reused block buffer ──► BLAKE3

The handshake is the product's (`open_tls` / `accept_tls`, certificates checked both ways); its
traffic secrets are taken from OpenSSL as TLS-TCP takes them (`TlsChannel.take_records`).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Mapping, Sequence

import blake3

from benchmarks.lib.stream_blocks import REQUEST
from transports.core.base import Peer
from transports.tls.channel import TlsChannel
from transports.tls.handshake import accept_tls, open_tls
from transports.tls.records import RecordLayer
from transports.trust.certs import NodeCredentials

HANDSHAKE_TIMEOUT_S = 10.0
READ_BUFFER = 2 << 20     # ciphertext read ahead of the records being opened
SEND_BATCH = 1 << 20      # plaintext sealed before one sendall, as TLS-TCP's send batch


class RecordStream:
    """One end of a connection after its handshake: the blocking socket and the record layer."""

    def __init__(self, channel: TlsChannel) -> None:
        taken = channel.take_records()
        if taken is None:
            raise RuntimeError("OpenSSL kept this connection's records (no key log here): no record-layer baseline")
        self.records, leftover = taken
        self.sock = channel.sock
        self.sock.setblocking(True)
        self._buf = memoryview(bytearray(READ_BUFFER))
        self._pos, self._end = 0, len(leftover)
        self._buf[:self._end] = leftover
        self._out = memoryview(bytearray(0))
        self._at = 0

    # -- sending
    def queue(self, data: memoryview) -> None:
        """Seal `data` as records (a payload's records from its first byte), sending a batch once
        SEND_BATCH of them are waiting."""
        need = RecordLayer.run_size(data.nbytes)
        if self._at and self._at + need > self._out.nbytes:
            self.flush()
        if need > self._out.nbytes:
            self._out = memoryview(bytearray(max(need, RecordLayer.run_size(SEND_BATCH))))
        self._at = self.records.seal_run(data, self._out, self._at)

    def flush(self) -> None:
        if self._at:
            self.sock.sendall(self._out[:self._at])
            self._at = 0

    def send_request(self, size: int, first: int, count: int) -> None:
        self.queue(memoryview(REQUEST.pack(size, first, count)))
        self.flush()

    # -- receiving
    def read_into(self, dst: memoryview) -> bool:
        """Fill `dst` with the next application data; False when the peer closed first."""
        records, buf = self.records, self._buf
        filled, size = 0, dst.nbytes
        while filled < size:
            pos, n = records.open_into(buf, self._pos, self._end, dst[filled:])
            if records.failure is not None:
                raise records.failure
            if records.peer_closed:
                return False
            if pos != self._pos:
                self._pos, filled = pos, filled + n
                continue
            stop = records.record_end(buf, pos, self._end)
            if 0 <= stop <= self._end:   # a whole record whose content-type byte would not fit in `dst`
                self._pos, plain = records.open_one(buf, pos, self._end)
                if plain.nbytes > size - filled:
                    raise ConnectionError("a record ran past the block it carried")
                dst[filled:filled + plain.nbytes] = plain
                filled += plain.nbytes
                continue
            if pos:   # at most a partial record: move it to the front, read after it
                buf[:self._end - pos] = buf[pos:self._end]
                self._pos, self._end = 0, self._end - pos
            got = self.sock.recv_into(buf[self._end:])
            if not got:
                return False
            self._end += got
        return True

    def close(self) -> None:
        self.sock.close()


def dial(port: int, credentials: NodeCredentials, server_node: str) -> RecordStream:
    channel = asyncio.run(open_tls(Peer(server_node, "127.0.0.1", port), credentials, HANDSHAKE_TIMEOUT_S))
    return RecordStream(channel)


def serve(listener: socket.socket, credentials: NodeCredentials, payloads: Mapping[int, Sequence[bytes]]) -> None:
    """Serve one connection at a time until `listener` is closed: each request gets its blocks, from
    its first on, cycling through `payloads[block size]`; a client that fails the handshake gets nothing."""
    request = memoryview(bytearray(REQUEST.size))
    while True:
        try:
            raw, _ = listener.accept()
        except OSError:   # the listener was closed: done
            return
        try:
            stream = RecordStream(asyncio.run(accept_tls(raw, credentials, HANDSHAKE_TIMEOUT_S)))
        except OSError:   # the handshake failed or timed out (SSLError, TimeoutError): accept_tls closed the socket
            continue
        try:
            while stream.read_into(request):
                size, first, count = REQUEST.unpack(request)
                blocks = payloads[size]
                for i in range(first, first + count):
                    stream.queue(memoryview(blocks[i % len(blocks)]))
                stream.flush()
        except OSError:   # the client went away (a RecordError is an ssl.SSLError, an OSError): the next one
            pass
        finally:
            stream.close()


def receive_blocks(stream: RecordStream, size: int, count: int, buf: memoryview, first: int = 0) -> int:
    """Ask for `count` blocks of `size` bytes from block `first` on, each received into `buf`
    (reused) and hashed with BLAKE3 as it lands; bytes moved."""
    stream.send_request(size, first, count)
    for _ in range(count):
        if not stream.read_into(buf):
            raise ConnectionError("record stream server closed the connection")
        blake3.blake3(buf).digest()
    return size * count
