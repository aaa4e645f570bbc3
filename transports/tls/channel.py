"""One TLS 1.3 connection driven through OpenSSL memory BIOs: `TlsChannel`.

    socket ──recv_into(big buffer)──► incoming MemoryBIO ──SSL_read──► plaintext (the caller's buffer)
    plaintext ──SSL_write──► outgoing MemoryBIO ──read()──► ciphertext ──sendmsg──► socket

OpenSSL never touches the socket: the owner moves ciphertext between the socket and the two BIOs,
so one `recv_into` can carry many TLS records and one `sendmsg` many more (an `SSLSocket` makes
OpenSSL read each 16 KiB record with two `read` calls and write it with one `write`). The price
is a copy of the ciphertext into and out of each BIO, paid in user space and cache-warm.

The handshake (`handshake()`), small control messages (`send_all`, `recv_some`, `recv`) and the
peer's certificate live here; bulk frames go through `transports.tls.link.TlsLink`, which reads
and writes the same socket and BIOs. Same `SSLContext` as any other TLS user of the node
credentials, so the same checks hold: client certificate required, the cluster CA only, the
revocation list, the dialled node's name in the server's SAN.

After the handshake, `take_records()` hands the connection's record layer to its one user (the
frame link): records are then sealed and opened in this process (records.py) with the traffic
secrets OpenSSL logged (keylog.py), and the memory BIOs carry nothing more. Where that cannot be
(no key log here, a suite records.py does not know, application data already through OpenSSL) it
returns None and OpenSSL keeps the records.

Invariants: every byte OpenSSL puts in `outgoing` is sent in order (protocol messages made by a
read, such as a key update reply or an alert, go out before later application data); `close()`
releases the socket once and may be called any number of times.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Callable
from typing import cast

from transports.tls import keylog
from transports.tls.records import APPLICATION_DATA, HEADER, SUITES, RecordLayer

__all__ = ["HANDSHAKE_READ", "OWN_RECORDS", "TlsChannel"]

HANDSHAKE_READ = 64 * 1024   # a socket read during the handshake or of a control message
OWN_RECORDS = True           # seal and open application records in this process when possible
_RANDOM_END = HEADER + 4 + 2 + 32   # a ClientHello record: header, message header, version, random


def _raw_calls(obj: ssl.SSLObject) -> tuple[Callable[[int, memoryview], int], Callable[[memoryview], int]]:
    """`read(len, buffer) -> count` and `write(data) -> count` of the OpenSSL connection under `obj`.

    `SSLObject.read` / `write` are thin Python wrappers around `obj._sslobj` (CPython's
    `_ssl._SSLSocket`, there since 3.7); a pull makes one read per 16 KiB TLS record, so the wrapper
    frame is paid 64 times per MiB. Falls back to the wrappers if a Python lacks `_sslobj`."""
    raw = getattr(obj, "_sslobj", None)
    if raw is None:
        return cast(Callable[[int, memoryview], int], obj.read), obj.write
    return raw.read, raw.write


class TlsChannel:
    """A connected non-blocking TCP socket and the `ssl.SSLObject` that speaks TLS over it."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, *, server_side: bool,
                 server_hostname: str | None = None) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.incoming = ssl.MemoryBIO()
        self.outgoing = ssl.MemoryBIO()
        self.obj = context.wrap_bio(self.incoming, self.outgoing, server_side=server_side,
                                    server_hostname=server_hostname)
        self.read, self.write = _raw_calls(self.obj)
        self.closed = False
        self._rbuf = bytearray(HANDSHAKE_READ)
        self.server_side = server_side
        self.records: RecordLayer | None = None   # set by take_records()
        self._context = context
        self._own = OWN_RECORDS and keylog.watch(context)
        self._hello = bytearray()   # the first bytes of the ClientHello: its random names the secrets
        self._in_handshake = False
        self._app_used = False      # application data went through OpenSSL: its records stay OpenSSL's
        self._secrets: tuple[bytes, bytes] | None = None
        self._tickets_sealed = 0    # records OpenSSL sealed under the traffic secret (a server's tickets)

    def fileno(self) -> int:
        return self.sock.fileno()

    def getpeercert(self, binary_form: bool = True) -> bytes | None:
        """The DER of the peer's verified certificate (None before the handshake or without one)."""
        der = self.obj.getpeercert(binary_form=True) if binary_form else None
        return der if isinstance(der, bytes) else None

    def version(self) -> str | None:
        return self.obj.version()

    # -- moving ciphertext (non-blocking)
    def take_outgoing(self) -> bytes:
        """Ciphertext OpenSSL produced and nobody sent yet (b"" when none)."""
        return self.outgoing.read() if self.outgoing.pending else b""

    def _feed_once(self) -> bool:
        """One socket read into the incoming BIO; False when the socket had nothing (would block).
        End of stream is written to the BIO as EOF, which OpenSSL reports on the next read."""
        try:
            n = self.sock.recv_into(self._rbuf)
        except (BlockingIOError, InterruptedError):
            return False
        if n:
            if self._in_handshake and self.server_side and len(self._hello) < _RANDOM_END:
                self._hello += self._rbuf[:_RANDOM_END - len(self._hello)]
            self.incoming.write(memoryview(self._rbuf)[:n])
        else:
            self.incoming.write_eof()
        return True

    async def _wait(self, writable: bool) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        fd = self.sock.fileno()

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        (loop.add_writer if writable else loop.add_reader)(fd, ready)
        try:
            await fut
        finally:
            (loop.remove_writer if writable else loop.remove_reader)(fd)

    async def flush(self, data: bytes | None = None) -> None:
        """Send everything OpenSSL has put in the outgoing BIO (`data`: that, taken already)."""
        if self.records is not None:
            raise RuntimeError("this connection's records are sealed by its record layer")
        if data is None:
            data = self.take_outgoing()
        if self._in_handshake and not self.server_side and len(self._hello) < _RANDOM_END:
            self._hello += data[:_RANDOM_END - len(self._hello)]
        view = memoryview(data)
        while view:
            try:
                view = view[self.sock.send(view):]
            except (BlockingIOError, InterruptedError):
                await self._wait(writable=True)

    async def _fill(self) -> None:
        """Wait for and feed at least one socket read (or the end of stream) into the incoming BIO."""
        while not self._feed_once():
            await self._wait(writable=False)

    # -- the handshake and control messages (async)
    async def handshake(self) -> None:
        """Run the TLS handshake to completion. Raises `ssl.SSLError` (a refused certificate, a
        protocol error, `ssl.SSLEOFError` when the peer hung up) or OSError; any alert OpenSSL
        made for the peer is sent first, so the peer learns why."""
        self._in_handshake = True
        try:
            while True:
                try:
                    self.obj.do_handshake()
                except ssl.SSLWantReadError:
                    await self.flush()
                    await self._fill()
                    continue
                except ssl.SSLError:
                    self._send_nowait()   # the alert that says why, if the socket takes it at once
                    raise
                break
            last = self.take_outgoing()   # the client's last flight, the server's session tickets
            if self.server_side:   # the last step wrote only records under the server's traffic secret
                self._tickets_sealed = _count_records(last)
            if self._own:
                self._secrets = self._traffic_secrets()
            await self.flush(last)
        finally:
            self._in_handshake = False
            self._hello.clear()

    def _traffic_secrets(self) -> tuple[bytes, bytes] | None:
        hello = self._hello
        if len(hello) < _RANDOM_END or hello[0] != 22 or hello[HEADER] != 1:   # handshake record, ClientHello
            return None
        return keylog.traffic_secrets(self._context, bytes(hello[_RANDOM_END - 32:_RANDOM_END]))

    def take_records(self) -> tuple[RecordLayer, bytes] | None:
        """Move this connection's records out of OpenSSL, once, right after the handshake: (the
        record layer, ciphertext already read from the socket that it must open first), or None
        when OpenSSL keeps them (see the module docstring). After it, `send_all`, `recv` and
        `flush` refuse; `close` sends its close_notify through the record layer."""
        secrets, self._secrets = self._secrets, None
        cipher = self.obj.cipher()
        if (secrets is None or self._app_used or self.records is not None or self.closed or cipher is None
                or cipher[0] not in SUITES or self.obj.version() != "TLSv1.3" or self.obj.pending()
                or self.outgoing.pending):
            return None
        client, server = secrets
        rx, tx = (client, server) if self.server_side else (server, client)
        self.records = RecordLayer(cipher[0], rx, tx, server_side=self.server_side, tx_seq=self._tickets_sealed)
        return self.records, self.incoming.read()

    async def send_all(self, data: bytes | memoryview) -> None:
        """Encrypt and send all of `data` (a small control message, not bulk frames)."""
        if self.records is not None:
            raise RuntimeError("this connection's records are sealed by its record layer")
        self._app_used = True
        view = memoryview(data)
        while view:
            view = view[self.write(view):]
        await self.flush()

    def recv(self, max_bytes: int = HANDSHAKE_READ) -> bytes:
        """Some decrypted bytes, without waiting: b"" at the end of the stream (a close_notify, or
        TCP closed without one); raises `ssl.SSLWantReadError` when none can be had yet, as a
        non-blocking `SSLSocket` does."""
        if self.records is not None:
            raise RuntimeError("this connection's records are opened by its record layer")
        self._app_used = True
        while True:
            try:
                data = self.obj.read(max_bytes)
            except ssl.SSLWantReadError:
                if not self._feed_once():
                    raise
                continue
            except ssl.SSLEOFError:
                return b""
            if self.outgoing.pending:   # e.g. a key update reply: small, sent if the socket takes it
                out = self.take_outgoing()
                try:
                    sent = self.sock.send(out)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                if sent < len(out):   # back in the BIO, ahead of anything later: the next flush sends it
                    self.outgoing.write(out[sent:] + self.take_outgoing())
            return data

    async def recv_some(self, max_bytes: int = HANDSHAKE_READ) -> bytes:
        """Some decrypted bytes; b"" when the peer closed the connection."""
        while True:
            try:
                return self.recv(max_bytes)
            except ssl.SSLWantReadError:
                await self._wait(writable=False)

    # -- closing
    def notify_close(self) -> None:
        """Queue a TLS close_notify in the outgoing BIO (best effort: nothing if TLS already failed)."""
        try:
            self.obj.unwrap()
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            pass   # the alert is written; the peer's answer is not awaited
        except (ssl.SSLError, ValueError):
            pass   # TLS failed or never started: there is nothing to notify

    def close(self, notify: bool = True) -> None:
        """Send a close_notify if the socket takes it at once (`notify`), then close the socket."""
        if self.closed:
            return
        self.closed = True
        if notify and self.records is not None:
            with contextlib.suppress(OSError):
                self.sock.send(self.records.close_notify())
        elif notify and self.obj.version() is not None:
            self.notify_close()
            self._send_nowait()
        self.records = None
        self._secrets = None
        self.sock.close()

    def _send_nowait(self) -> None:
        """Send what the outgoing BIO holds if the socket takes it now (an alert, a close_notify);
        a full or broken socket drops it: the peer then sees the TCP close alone."""
        out = self.take_outgoing()
        if out:
            with contextlib.suppress(OSError):
                self.sock.send(out)


def _count_records(data: bytes) -> int:
    """Encrypted records (outer type application_data) in `data`, a whole number of TLS records."""
    count = pos = 0
    while pos + HEADER <= len(data):
        count += data[pos] == APPLICATION_DATA
        pos += HEADER + int.from_bytes(data[pos + 3:pos + HEADER], "big")
    return count
