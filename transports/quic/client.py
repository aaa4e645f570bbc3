"""QUIC client (aioquic or qh3, `backend`): pooled connections, one bidirectional stream per PULL, each stream a
`ClientSession(hello=False)` that checks every digest and turns what the server left unanswered into
misses.

    pull(): HELLO + PULL + FIN ──► server  (at most MAX_ADDRESSES_PER_STREAM addresses per stream;
                                           HELLO carries this client's payload limit)
            ◄── BLOCK | MISS … END + FIN   session.receive() → its Outcome: Hit / Miss per address, in order

Mutual TLS: aioquic checks the server's certificate against the cluster CA with the dialled node
as server name; session tickets are kept per peer node and offered on reconnect. A pull with no
progress for `frame_timeout_s` ends in TIMEOUT misses; a pooled connection found dead before it
answered anything is replaced once (PULL is idempotent).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import socket
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from functools import cache, partial
from typing import TYPE_CHECKING, Any, cast

from aioquic import tls
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import QuicErrorCode

from fabric import config as defaults
from fabric.config import TransportConfig
from fabric.keys import BlockAddress
from transports.core.base import Peer, PullResult
from transports.core.client_session import ClientSession, Outcome
from transports.core.codec import DEFAULT_MAX_PAYLOAD, Miss, MissReason, encode
from transports.core.metrics import TransportMetrics
from transports.core.pool import ConnectionPool, may_redial
from transports.core.timer import DeadlineTimer
from transports.quic.backend import QuicBackend, resolve
from transports.quic.base import (
    MAX_ADDRESSES_PER_STREAM,
    STREAM_CANCELLED,
    STREAM_PROTOCOL_ERROR,
    TRANSPORT,
    QuicTuning,
    base_configuration,
)
from transports.quic.tls import QuicTlsMaterial
from transports.quic.udp import udp_socket
from transports.trust.certs import CertificateError, NodeCredentials

if TYPE_CHECKING:   # typed against aioquic; at run time the base is the chosen backend's (see _connection_class)
    from aioquic.asyncio.protocol import QuicConnectionProtocol
else:
    QuicConnectionProtocol = object

logger = logging.getLogger("transports.quic")


@dataclass(slots=True)
class _PullStream:
    """One PULL stream: its session (which holds the results, `outcome`) and its caller's wake-up."""

    session: ClientSession
    request_id: int
    outcome: Outcome
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)


class _ClientConnection(QuicConnectionProtocol):
    """One pooled connection to a peer; routes stream data to the pulls waiting on it."""

    def __init__(self, quic: QuicConnection, *, client: QuicTransportClient, peer: Peer) -> None:
        super().__init__(quic)
        self.client = client
        self.events = client.backend.events
        self.peer = peer
        self.pulls: dict[int, _PullStream] = {}
        self._deadlines = DeadlineTimer(self._expire)   # the pulls' sessions' deadlines
        self.slots = asyncio.Semaphore(client.max_inflight)
        self.closed = False
        self.endpoint: asyncio.DatagramTransport | None = None   # its UDP socket's transport, once made
        self.session_resumed = False
        self.last_received = self._loop.time()
        try:
            self.node = client.credentials.node   # what our streams' HELLOs name
        except CertificateError:
            self.node = ""   # a certificate that names no node: the server refuses it at the handshake

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        self.datagrams_received([cast(bytes, data)], addr)

    def datagrams_received(self, data: list[bytes], addr: Any) -> None:
        """A batch from a GRO / recvmmsg endpoint: handed to the library at once, events processed
        and answers sent once per batch rather than per datagram (unless tuned off)."""
        if not self.client.tuning.receive_batches and len(data) > 1:
            for datagram in data:
                self.datagrams_received([datagram], addr)
            return
        self.last_received = self._loop.time()
        self.client.backend.receive_many(self._quic, data, addr, self.last_received)
        self._process_events()
        if not self.closed and self._quic._close_event is not None:
            # Closing or draining: aioquic reports the termination only after 3 PTOs; fail the
            # pulls and stop handing out this connection now.
            self._on_terminated(self._quic._close_event)
            if self._connected_waiter is not None:
                waiter, self._connected_waiter = self._connected_waiter, None
                waiter.set_exception(ConnectionError(self._quic._close_event.reason_phrase))
        self._transmit_soon()  # once per batch of datagrams (see UdpEndpoint)

    def quic_event_received(self, event: events.QuicEvent) -> None:
        ev = self.events
        if isinstance(event, ev.StreamDataReceived):
            self._on_data(event.stream_id, event.data, event.end_stream)
        elif isinstance(event, ev.StreamReset):
            self._finish(event.stream_id, MissReason.PEER_ERROR)
        elif isinstance(event, ev.HandshakeCompleted):
            self.session_resumed = event.session_resumed
        elif isinstance(event, ev.ConnectionTerminated):
            self._on_terminated(event)

    def _on_terminated(self, event: events.ConnectionTerminated) -> None:
        if self.closed:
            return
        self.closed = True
        if self._connected:
            self.client.metrics.connections.labels(TRANSPORT, "client").dec()
        if QuicErrorCode.CRYPTO_ERROR <= event.error_code < QuicErrorCode.CRYPTO_ERROR + 256:
            ours = self._quic.tls.state.name != tls.State.CLIENT_POST_HANDSHAKE.name
            reason = "server_untrusted" if ours else "refused_by_server"
            self.client.metrics.auth_failures.labels(TRANSPORT, reason).inc()
            logger.warning("QUIC handshake with %s failed (%s): %s", self.peer.node, reason, event.reason_phrase)
        self._deadlines.cancel()
        for stream_id in list(self.pulls):
            self._finish(stream_id, MissReason.PEER_GONE)

    def _on_data(self, stream_id: int, data: bytes, end_stream: bool) -> None:
        pull = self.pulls.get(stream_id)
        if pull is None:
            return  # a pull we gave up on; its stream was stopped
        now = self._loop.time()
        pull.session.receive(data, now)
        if end_stream:
            pull.session.end_of_stream(now)
        error = pull.session.error
        if error is not None and not pull.outcome.done:
            pull.session.connection_lost(MissReason.PEER_ERROR)
        if error is not None:
            logger.warning("QUIC pull %d from %s: bad answer: %s", pull.request_id, self.peer.node, error)
            self.client.metrics.protocol_errors.labels(TRANSPORT).inc()
            self.client.backend.stop_reading(self._quic, stream_id, STREAM_PROTOCOL_ERROR)
        if pull.outcome.done:
            del self.pulls[stream_id]
        else:
            self._deadlines.at_most(pull.session.next_deadline())
        pull.wakeup.set()

    def _expire(self, now: float) -> float | None:
        """The pulls' timers (see DeadlineTimer): a pull without progress for frame_timeout_s
        ends in TIMEOUT misses; returns the soonest deadline left."""
        soonest: float | None = None
        for pull in list(self.pulls.values()):
            deadline = pull.session.next_deadline()
            if deadline is not None and now >= deadline:
                pull.session.handle_timer(now)   # closes the session: no deadline any more
                logger.warning("QUIC pull %d from %s: no progress for %.1fs", pull.request_id,
                               self.peer.node, self.client.frame_timeout_s)
                pull.wakeup.set()
                continue
            if deadline is not None and (soonest is None or deadline < soonest):
                soonest = deadline
        return soonest

    def _finish(self, stream_id: int, reason: MissReason) -> None:
        pull = self.pulls.pop(stream_id, None)
        if pull is not None:
            pull.session.connection_lost(reason)
            pull.wakeup.set()

    def open_pull(self, request_id: int, addresses: Sequence[BlockAddress],
                  namespace: bytes = b"") -> tuple[int, _PullStream]:
        stream_id = self._quic.get_next_available_stream_id()
        now = self._loop.time()
        # The stream opens with our HELLO for its payload limit; the server does not answer it
        # (the TLS handshake named both ends).
        session = ClientSession(self.node, self.peer.node, now,
                                max_payload=self.client.max_payload, frame_timeout_s=self.client.frame_timeout_s,
                                hello=False)
        session.next_id = request_id
        rid, frames = session.submit(addresses, now, namespace=namespace)
        frames = session.hello() + frames
        pull = _PullStream(session, rid, session.outcome(rid))
        self.pulls[stream_id] = pull
        self._deadlines.at_most(session.next_deadline())
        self._quic.send_stream_data(stream_id, b"".join(encode(f) for f in frames), end_stream=True)
        self.transmit()
        return stream_id, pull

    def abandon(self, stream_id: int) -> None:
        """Stop a pull early: ask the server to stop sending and forget the stream."""
        if self.pulls.pop(stream_id, None) is not None and not self.closed:
            self.client.backend.stop_reading(self._quic, stream_id, STREAM_CANCELLED)
            self.transmit()


def _all_gone(pull: _PullStream, num_addresses: int) -> bool:
    results = pull.outcome.results
    return len(results) == num_addresses and all(isinstance(r, Miss) and r.reason is MissReason.PEER_GONE
                                                 for r in results)


@dataclass(frozen=True, slots=True)
class ConnectionInfo:
    node: str
    num_connects: int       # connections made to this peer so far
    session_resumed: bool   # the current connection's handshake used a session ticket
    open: bool


class QuicTransportClient:
    """Pulls blocks from peers over pooled QUIC connections (one per peer, reconnected on loss)."""

    def __init__(self, credentials: NodeCredentials, *, tuning: QuicTuning | None = None,
                 max_payload: int = DEFAULT_MAX_PAYLOAD, connect_timeout_s: float = defaults.CONNECT_TIMEOUT_S,
                 idle_timeout_s: float = defaults.IDLE_TIMEOUT_S, frame_timeout_s: float = defaults.FRAME_TIMEOUT_S,
                 max_inflight: int = defaults.MAX_INFLIGHT,
                 metrics: TransportMetrics | None = None, backend: str = "auto") -> None:
        """`backend`: the QUIC library (see `backend`); pair it with the servers' for resumption."""
        self.backend = resolve(backend)
        self.credentials = credentials
        self.tuning = tuning or QuicTuning()
        self.max_payload = max_payload
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.frame_timeout_s = frame_timeout_s
        self.max_inflight = max_inflight
        self.metrics = metrics or TransportMetrics()
        self._pool: ConnectionPool[_ClientConnection] = ConnectionPool(self._drop)
        self._tickets: dict[str, tls.SessionTicket] = {}
        self._num_connects: dict[str, int] = {}
        self.tls = QuicTlsMaterial(credentials, base_configuration(True, self.tuning, idle_timeout_s, self.backend))
        self._tickets_generation = -1
        self._request_ids = itertools.count(1)

    @classmethod
    def from_config(cls, config: TransportConfig, credentials: NodeCredentials,
                    metrics: TransportMetrics | None = None) -> QuicTransportClient:
        return cls(credentials, tuning=QuicTuning.from_config(config),
                   max_payload=config.max_payload_bytes, connect_timeout_s=config.connect_timeout_s,
                   idle_timeout_s=config.idle_timeout_s, frame_timeout_s=config.frame_timeout_s,
                   max_inflight=config.max_inflight, metrics=metrics, backend=config.quic_backend)

    def connection_info(self, peer: Peer) -> ConnectionInfo | None:
        conn = self._pool.entry(peer.node)
        if conn is None:
            return None
        return ConnectionInfo(peer.node, self._num_connects.get(peer.node, 0), conn.session_resumed,
                              not conn.closed)

    async def pull(self, peer: Peer, addresses: Sequence[BlockAddress], *,
                   into: memoryview | None = None, namespace: bytes = b"") -> AsyncIterator[PullResult]:
        """One result per address; the results of each block's layers come in the order asked.
        `into` is accepted and unused: aioquic hands stream data over in its own buffers."""
        for start in range(0, len(addresses), MAX_ADDRESSES_PER_STREAM):
            async for result in self._pull_stream(peer, addresses[start:start + MAX_ADDRESSES_PER_STREAM],
                                                  namespace):
                self.metrics.record(TRANSPORT, result)
                yield result

    async def _pull_stream(self, peer: Peer, addresses: Sequence[BlockAddress], namespace: bytes = b"",
                           attempt: int = 0) -> AsyncIterator[PullResult]:
        request_id = next(self._request_ids)
        conn, reused = await self._connection(peer)
        if conn is None:
            for address in addresses:
                yield Miss(request_id, address, MissReason.PEER_GONE)
            return
        stale = False
        async with conn.slots:
            stream_id, pull = conn.open_pull(request_id, addresses, namespace) if not conn.closed else (-1, None)
            try:
                while pull is not None:
                    outcome = pull.outcome
                    if outcome.done and may_redial(reused, not _all_gone(pull, len(addresses)), attempt):
                        # A pooled connection that was already closing (peer restarted, idle
                        # timeout): nothing was answered, and PULL is idempotent, so dial again.
                        stale = True
                        break
                    while outcome.results:
                        yield outcome.take()
                    if outcome.done:
                        if pull.session.close_reason is MissReason.TIMEOUT and \
                                conn._loop.time() - conn.last_received >= self.frame_timeout_s:
                            # Nothing at all came back: the peer is gone (e.g. restarted without
                            # closing); drop the connection so the next pull dials again.
                            await self.disconnect(conn.peer)
                        return
                    pull.wakeup.clear()
                    await pull.wakeup.wait()
            finally:
                if pull is not None and not pull.outcome.done:
                    conn.abandon(stream_id)
        if pull is None or stale:
            async for result in self._pull_stream(peer, addresses, namespace, attempt=attempt + 1):
                yield result

    async def _connection(self, peer: Peer) -> tuple[_ClientConnection | None, bool]:
        """The pooled connection to `peer` (reused: True) or a new one; None if it cannot be made."""
        conn = self._pool.get(peer)
        if conn is not None:
            return conn, True
        return await self._pool.connection(peer, self._connect)

    def _client_configuration(self, peer: Peer) -> QuicConfiguration:
        material = self.tls.current()
        if self.tls.generation != self._tickets_generation:
            self._tickets.clear()  # a rotated certificate must be shown in a full handshake
            self._tickets_generation = self.tls.generation
        # server_name: the server certificate must name the node we dial (checked by aioquic).
        return dataclasses.replace(material.configuration, server_name=peer.node,
                                   session_ticket=self._tickets.get(peer.node))

    async def _connect(self, peer: Peer) -> _ClientConnection | None:
        self.tls.current()   # rereads the credentials, a republished crl.pem included
        if self.tls.credentials.crl_expired(time.time()):   # as TLS-TCP: fail closed (certs.py)
            self.metrics.auth_failures.labels(TRANSPORT, "server_crl_expired").inc()   # as TLS-TCP labels it
            logger.warning("not dialling QUIC peer %s: the revocation list crl.pem is past its nextUpdate; "
                           "publish a fresh one (kvfabric certs revoke --dir <ca>)", peer.node)
            return None
        loop = asyncio.get_running_loop()
        quic = cast(QuicConnection, self.backend.connection(
            configuration=self._client_configuration(peer),
            session_ticket_handler=partial(self._tickets.__setitem__, peer.node) if self.backend.resumption else None))
        try:
            infos = await loop.getaddrinfo(peer.host, peer.port, type=socket.SOCK_DGRAM)
            family, addr = infos[0][0], infos[0][4]
            sock = udp_socket("::" if family == socket.AF_INET6 else "0.0.0.0", 0, self.tuning.socket_buffer)
        except OSError as e:
            logger.warning("cannot reach QUIC peer %s at %s:%d: %s", peer.node, peer.host, peer.port, e)
            return None
        conn = cast(_ClientConnection, _connection_class(self.backend)(quic, client=self, peer=peer))
        transport = await self.backend.endpoint(sock, conn)
        self._num_connects[peer.node] = self._num_connects.get(peer.node, 0) + 1
        conn.endpoint = transport
        self._pool.add(conn)
        conn.connect(addr)
        try:
            await asyncio.wait_for(conn.wait_connected(), self.connect_timeout_s)
        except (ConnectionError, TimeoutError) as e:
            logger.warning("QUIC connection to %s failed: %s", peer.node, type(e).__name__)
            self._tickets.pop(peer.node, None)
            await self.disconnect(peer)
            return None
        self.metrics.connections.labels(TRANSPORT, "client").inc()   # disconnect() counts it down
        if self.backend.server_revoked(quic, self.tls.current().revoked):
            self.metrics.auth_failures.labels(TRANSPORT, "server_revoked").inc()
            logger.warning("QUIC peer %s presented a revoked certificate; refused", peer.node)
            self._tickets.pop(peer.node, None)
            await self.disconnect(peer)
            return None
        logger.debug("QUIC connected to %s (resumed: %s)", peer.node, conn.session_resumed)
        return conn

    async def disconnect(self, peer: Peer) -> None:
        """Close the pooled connection to `peer` (its open pulls end as PEER_GONE misses)."""
        conn = self._pool.entry(peer.node)
        if conn is not None:
            await self._drop(conn)

    async def _drop(self, conn: _ClientConnection) -> None:
        """Take `conn` out of the pool and close it and its socket (see `pool`)."""
        self._pool.discard(conn)
        if not conn.closed:
            conn.close()  # CONNECTION_CLOSE goes out before the socket is closed below
            conn._on_terminated(events.ConnectionTerminated(QuicErrorCode.NO_ERROR, None, "closed by us"))
        if conn.endpoint is not None:
            conn.endpoint.close()
        if conn._timer is not None:  # no drain or retransmission timers on a closed socket
            conn._timer.cancel()

    async def close(self) -> None:
        for conn in self._pool:
            await self._drop(conn)
        await asyncio.sleep(0)


@cache
def _connection_class(backend: QuicBackend) -> type:
    """The client connection class over `backend`'s asyncio protocol."""
    return type(f"ClientConnection[{backend.name}]", (_ClientConnection, backend.protocol_base), {})
