"""QUIC server (aioquic or qh3, see `backend`): one `ServerSession` per PULL stream, answers pumped round-robin.

    client stream: HELLO + PULL + FIN ──► ServerSession(hello=False, one_pull=True): the client's
                   payload limit, rules, frame deadline
                   ◄── BLOCK | MISS … END + FIN      fetched blocks → session.answer() → frames

The protocol rules are the session's (a block over the client's limit or one the store cannot read
is a MISS with its reason, never a dropped stream). This module moves stream bytes, reads the
store (on the loop while reads are fast, in a thread pool after SLOW_STREAK slow ones, like
TLS-TCP) and bounds what unauthenticated peers can cost:

  * Retry (address validation) is on by default, and the connections mid-handshake are capped in
    total and per source address: the gate in `transports.quic.guard` (`BoundedQuicServer`);
  * a connection still mid-handshake after `handshake_timeout_s` is closed, and a client without
    a cluster certificate is refused: `GuardedConnection`, also in `transports.quic.guard`;

and what authenticated peers can cost (`budget`): at most `max_connections_per_peer` connections
per node (the next one is closed with an "overloaded:" reason), PULLs and payload bytes per second
per node; a PULL over them is answered ERROR overloaded on its stream, and the connection's
datagrams are dropped until its budget admits a PULL again (`ServingServer.throttle_s`).

Per connection the server buffers at most `send_high_water` + one batch of answers; receive
buffers are capped by the QUIC flow-control windows. Per datagram the work is O(frames in it).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any, cast

from aioquic.quic import events
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import QuicErrorCode

from fabric import config as defaults
from fabric.config import TransportConfig
from fabric.keys import BlockAddress
from transports.core.base import BlockSource
from transports.core.budget import PeerBudgets, PeerRates, peer_rates
from transports.core.codec import DEFAULT_MAX_PAYLOAD, End, Frame, MissReason
from transports.core.metrics import TransportMetrics
from transports.core.serving import BATCH_BYTES, ServingServer
from transports.core.session import Fetched, ServerSession
from transports.core.timer import DeadlineTimer
from transports.quic.backend import QuicBackend, resolve
from transports.quic.base import (
    ALPN,
    STREAM_PROTOCOL_ERROR,
    STREAM_TIMEOUT,
    TRANSPORT,
    QuicTuning,
    base_configuration,
    send_frame,
)
from transports.quic.guard import BoundedQuicServer, GuardedConnection
from transports.quic.tls import QuicTlsMaterial
from transports.quic.udp import udp_socket
from transports.trust.certs import NodeCredentials

if TYPE_CHECKING:   # typed against aioquic; at run time the bases are the chosen backend's (see _classes)
    from aioquic.asyncio.protocol import QuicConnectionProtocol
    from aioquic.asyncio.server import QuicServer
else:
    QuicConnectionProtocol = QuicServer = object

logger = logging.getLogger("transports.quic")


@dataclass(slots=True, eq=False)
class _Stream:
    """A client stream. Kept (without its session) after we closed it until the client's FIN or
    reset arrives, so late bytes are ignored rather than mistaken for a new stream."""

    stream_id: int
    session: ServerSession | None
    frames: deque[Frame] = field(default_factory=deque)   # answers made, not yet handed to aioquic
    fetching: bool = False
    peer_finished: bool = False


class _ServerConnection(GuardedConnection):
    """One client connection: sessions per stream, and the pump that sends their answers (its
    handshake checks are `GuardedConnection`'s)."""

    _server: QuicTransportServer

    def __init__(self, quic: QuicConnection, stream_handler: Any = None, *,  # aioquic passes a handler
                 server: QuicTransportServer, host: str) -> None:
        super().__init__(quic)
        self._server = server
        self._backend = server.backend
        self.events = server.backend.events
        self.host = host   # the source address that opened it
        self._backend.install_client_auth(quic, server.tls.current)
        self.node: str | None = None
        self.tenants: frozenset[str] = frozenset()
        self._streams: dict[int, _Stream] = {}
        self._ready: deque[_Stream] = deque()   # streams with answers left to make or send
        self._deadlines = DeadlineTimer(self._expire)   # the streams' sessions' deadlines
        self._terminated = False
        self._refused = False
        self._throttled_until = 0.0   # over its budget: its datagrams are dropped until then
        server._connections.add(self)
        self._half_open = True
        server._half_open_started(host)
        self._handshake_timer: asyncio.TimerHandle | None = self._loop.call_later(
            server.handshake_timeout_s, self._handshake_expired)

    # -- aioquic hooks -------------------------------------------------------------------------

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        self.datagrams_received([cast(bytes, data)], addr)

    def datagrams_received(self, data: list[bytes], addr: Any) -> None:
        """Datagrams of this connection, one or a batch (see `BoundedQuicServer.datagrams_received`):
        handed to the library at once once authenticated, events processed once per batch."""
        now = self._loop.time()
        if now < self._throttled_until:   # as a full link would: the peer's loss recovery slows it down
            self._server.num_throttled_datagrams += len(data)
            return
        if len(data) > 1 and (self.node is None or not self._server.tuning.receive_batches):
            for datagram in data:   # the handshake (and the untuned path) goes one datagram at a time
                self.datagrams_received([datagram], addr)
            return
        self._backend.receive_many(self._quic, data, addr, now)
        if self.node is None and not self._refused:
            self._check_refused()
        self._process_events()
        if not self._terminated and self._quic._close_event is not None:
            self._on_terminated(self._quic._close_event)  # closing/draining: done serving it
        self._transmit_soon()  # once per batch of datagrams (see UdpEndpoint)

    def transmit(self) -> None:
        self._pump()
        super().transmit()

    def quic_event_received(self, event: events.QuicEvent) -> None:
        ev = self.events
        if isinstance(event, ev.StreamDataReceived):
            self._on_data(event.stream_id, event.data, event.end_stream)
        elif isinstance(event, ev.HandshakeCompleted):
            self._on_handshake(event)
        elif isinstance(event, ev.StreamReset):
            self._close(event.stream_id, peer_finished=True)
        elif isinstance(event, ev.StopSendingReceived):
            self._close(event.stream_id)
        elif isinstance(event, ev.ConnectionTerminated):
            self._on_terminated(event)

    # -- events --------------------------------------------------------------------------------

    def _on_terminated(self, event: events.ConnectionTerminated) -> None:
        if self._terminated:
            return
        self._terminated = True
        if self.node is None:
            self._end_half_open()
            if not self._refused:
                self._check_refused()
            if not self._refused:
                logger.info("QUIC handshake failed: %s (code %#x)", event.reason_phrase, event.error_code)
        else:
            self._server.metrics.connections.labels(TRANSPORT, "server").dec()
            logger.debug("QUIC connection from %s closed: %s", self.node, event.reason_phrase or "idle")
        self._release()

    def _release(self) -> None:
        self._end_half_open()
        self._deadlines.cancel()
        self._streams.clear()
        self._ready.clear()
        self._server._connections.discard(self)

    def _on_data(self, stream_id: int, data: bytes, end_stream: bool) -> None:
        if self.node is None:
            self._quic.close(QuicErrorCode.CRYPTO_ERROR + 116, reason_phrase="client not authenticated")
            return
        stream = self._streams.get(stream_id)
        now = self._loop.time()
        if stream is None:
            if stream_id % 4 != 0:  # only client-initiated bidirectional streams carry PULLs
                self._server.metrics.protocol_errors.labels(TRANSPORT).inc()
                self._backend.stop_reading(self._quic, stream_id, STREAM_PROTOCOL_ERROR)
                return
            server = self._server
            session = ServerSession(server.node, self.node, now, max_payload=server.max_payload, max_inflight=1,
                                    frame_timeout_s=server.frame_timeout_s, hello=False, one_pull=True,
                                    require_namespace=server.require_pull_namespace,
                                    authorise=server.authoriser(self.tenants))
            stream = self._streams[stream_id] = _Stream(stream_id, session)
        if stream.session is None:  # closed by us: late bytes
            if end_stream:
                self._close(stream_id, peer_finished=True)
            return
        session = stream.session
        out = session.receive(data, now)
        if end_stream:
            stream.peer_finished = True
            out += session.end_of_stream(now)
        self._after(stream, out)

    def _after(self, stream: _Stream, out: list[Frame]) -> None:
        """Carry out what a stream's session returned: queue frames, start its pull, or close it."""
        session = stream.session
        assert session is not None, "a closed stream has no session to follow"
        stream.frames.extend(out)
        pulls = session.take_pulls()
        now = self._loop.time()
        for pull in pulls:
            assert self.node is not None, "only an authenticated connection carries PULLs"
            if not self._server.admit_pull(self.node, now):
                stream.frames.extend(session.refuse(pull.request_id, now, f"{self.node} is over its PULL budget"))
                self._throttled_until = now + self._server.throttle_s(self.node, now)
        if pulls or session.closing:
            self._ready.append(stream)   # answers to make, or its ERROR frame or end to send
        self._deadlines.at_most(session.next_deadline())
        if session.closing:
            error = session.error
            if error is not None:
                logger.warning("QUIC stream %d from node %s closed: %s", stream.stream_id, self.node, error)
                if error.code.value == "protocol":
                    self._server.metrics.protocol_errors.labels(TRANSPORT).inc()
                if not stream.peer_finished:
                    timed_out = session.close_reason is MissReason.TIMEOUT
                    self._backend.stop_reading(self._quic, stream.stream_id,
                                               STREAM_TIMEOUT if timed_out else STREAM_PROTOCOL_ERROR)

    def _close(self, stream_id: int, peer_finished: bool = False) -> None:
        """Stop answering a stream and free its session."""
        stream = self._streams.get(stream_id)
        if stream is None:
            return
        stream.session = None
        stream.frames.clear()
        if stream in self._ready:
            self._ready.remove(stream)
        stream.peer_finished = stream.peer_finished or peer_finished
        if stream.peer_finished:
            self._streams.pop(stream_id, None)

    def _can_send(self, stream_id: int) -> bool:
        return self._backend.can_send(self._quic, stream_id)

    # -- sending -------------------------------------------------------------------------------

    def _unacked(self) -> int:
        return self._backend.queued(self._quic)

    def _pump(self) -> None:
        """Move answers into aioquic, round-robin over streams, up to the high-water mark."""
        if not self._ready:
            return
        server = self._server
        budget = server.tuning.send_high_water - self._unacked()
        max_payload = server.max_payload
        while self._ready and budget > 0:
            stream = self._ready.popleft()
            session = stream.session
            if session is None or stream.fetching:
                continue
            if not self._can_send(stream.stream_id):
                self._close(stream.stream_id)
                continue
            if not stream.frames:
                if session.closing:   # closed with nothing to say (the peer's BYE or ERROR): end the stream
                    self._quic.send_stream_data(stream.stream_id, b"", end_stream=True)
                    self._close(stream.stream_id)
                    continue
                if not self._make_answers(stream, session):
                    continue
            while stream.frames and budget > 0:
                frame = stream.frames.popleft()
                last = isinstance(frame, End) or (session.closing and not stream.frames)
                budget -= send_frame(self._quic, stream.stream_id, frame, max_payload, end_stream=last)
                if last:
                    stream.session = None
                    self._close(stream.stream_id)
            if stream.session is not None:
                self._ready.append(stream)

    def _make_answers(self, stream: _Stream, session: ServerSession) -> bool:
        """Answer the stream's next batch (the session says which); False when there are no
        answers to send now (none left, or they are being fetched in the pool)."""
        batch = session.next_batch()
        if batch is None:
            return False
        rid, rest = batch
        server = self._server
        if not server.fetches_inline(self._loop.time()):
            stream.fetching = True   # the store is slow (disk): read it off the loop
            task = self._loop.create_task(self._fetch_in_thread(stream, session, rid, rest))
            server.fetches.add(task)
            task.add_done_callback(server.fetches.discard)
            return False
        self._answered(stream, session, rid, rest, server.fetch_inline(rest, BATCH_BYTES))
        return True

    async def _fetch_in_thread(self, stream: _Stream, session: ServerSession, rid: int,
                               rest: Sequence[BlockAddress]) -> None:
        fetched = await self._server.fetch_in_pool(rest, BATCH_BYTES)
        stream.fetching = False
        if stream.session is session and not self._terminated:
            self._answered(stream, session, rid, rest, fetched)
            self._ready.append(stream)
            self.transmit()

    def _answered(self, stream: _Stream, session: ServerSession, rid: int, rest: Sequence[BlockAddress],
                  fetched: list[Fetched]) -> None:
        now = self._loop.time()
        stream.frames.extend(session.answer(rid, rest[:len(fetched)], fetched, now))
        self._server.count_served(session, now)

    # -- timers --------------------------------------------------------------------------------

    def _expire(self, now: float) -> float | None:
        """The streams' timers (see DeadlineTimer): a PULL that does not arrive whole in time ends
        its stream; returns the soonest deadline left."""
        if self._terminated:
            return None
        failed = False
        soonest: float | None = None
        for stream in list(self._streams.values()):
            session = stream.session
            deadline = None if session is None else session.next_deadline()
            if session is not None and deadline is not None and now >= deadline:
                self._after(stream, session.handle_timer(now))
                failed = True
                deadline = session.next_deadline()
            if deadline is not None and (soonest is None or deadline < soonest):
                soonest = deadline
        if failed:
            self.transmit()
        return soonest


@cache
def _classes(backend: QuicBackend) -> tuple[type, type]:
    """The connection and server classes over `backend`'s asyncio protocol and server."""
    return (type(f"ServerConnection[{backend.name}]", (_ServerConnection, backend.protocol_base), {}),
            type(f"QuicServer[{backend.name}]", (BoundedQuicServer, backend.server_base), {}))


class QuicTransportServer(ServingServer):
    """Answers PULL streams from `source` on a UDP port, for clients with a cluster certificate."""

    transport = TRANSPORT  # the metrics label

    def __init__(self, credentials: NodeCredentials, source: BlockSource, *, host: str = "127.0.0.1",
                 port: int = 0, tuning: QuicTuning | None = None, max_payload: int = DEFAULT_MAX_PAYLOAD,
                 frame_timeout_s: float = defaults.FRAME_TIMEOUT_S, idle_timeout_s: float = defaults.IDLE_TIMEOUT_S,
                 metrics: TransportMetrics | None = None, ticket_lifetime_s: float = 3600.0,
                 retry: bool = True, max_half_open: int = defaults.QUIC_MAX_HALF_OPEN,
                 max_half_open_per_address: int = defaults.QUIC_MAX_HALF_OPEN_PER_ADDRESS,
                 handshake_timeout_s: float = defaults.CONNECT_TIMEOUT_S,
                 max_connections_per_peer: int = defaults.MAX_CONNECTIONS_PER_PEER,
                 peer_rates: PeerRates | None = None, io_threads: int = defaults.IO_THREADS,
                 backend: str = "auto") -> None:
        """`retry`: validate client addresses with a Retry before any handshake state is kept;
        `max_half_open`: connections allowed mid-handshake at once, `max_half_open_per_address` of
        them from one source address, each for at most `handshake_timeout_s`;
        `max_connections_per_peer` and `peer_rates`: what one peer node may cost (see `budget`);
        `io_threads`: for slow reads; `backend`: the QUIC library (see `backend`)."""
        self.backend = resolve(backend)
        self.credentials = credentials
        self.node = credentials.node
        self.source = source
        self.host, self.port = host, port
        self.tuning = tuning or QuicTuning()
        self.max_payload = max_payload
        self.frame_timeout_s = frame_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.metrics = metrics or TransportMetrics()
        self.retry = retry
        self.max_half_open = max_half_open
        self.max_half_open_per_address = max_half_open_per_address
        self.handshake_timeout_s = handshake_timeout_s
        self.max_connections_per_peer = max_connections_per_peer
        self.budgets = PeerBudgets(peer_rates)
        self.num_half_open = 0
        self._half_open: dict[str, int] = {}   # source address -> its connections mid-handshake
        self.num_dropped_initials = 0
        self.num_throttled_datagrams = 0   # dropped from peers over their budget
        self.tls = QuicTlsMaterial(credentials, base_configuration(False, self.tuning, idle_timeout_s, self.backend),
                                   ticket_lifetime_s)
        self.executor = ThreadPoolExecutor(io_threads, thread_name_prefix="kvfabric-quic-io") if io_threads else None
        self.fetches: set[asyncio.Task[None]] = set()
        self._server: QuicServer | None = None
        self._connections: set[_ServerConnection] = set()

    @classmethod
    def from_config(cls, config: TransportConfig, credentials: NodeCredentials, source: BlockSource,
                    metrics: TransportMetrics | None = None) -> QuicTransportServer:
        return cls(credentials, source, host=config.host, port=config.quic_port,
                   tuning=QuicTuning.from_config(config),
                   max_payload=config.max_payload_bytes, frame_timeout_s=config.frame_timeout_s,
                   idle_timeout_s=config.idle_timeout_s, handshake_timeout_s=config.connect_timeout_s,
                   max_half_open=config.quic_max_half_open,
                   max_half_open_per_address=config.quic_max_half_open_per_address,
                   max_connections_per_peer=config.max_connections_per_peer, peer_rates=peer_rates(config),
                   metrics=metrics, backend=config.quic_backend)

    def half_open_of(self, host: str) -> int:
        """Connections from source address `host` still mid-handshake."""
        return self._half_open.get(host, 0)

    def _half_open_started(self, host: str) -> None:
        self.num_half_open += 1
        self._half_open[host] = self._half_open.get(host, 0) + 1

    def _half_open_ended(self, host: str) -> None:
        self.num_half_open -= 1
        left = self._half_open[host] - 1
        if left:
            self._half_open[host] = left
        else:
            del self._half_open[host]

    def _connect(self, quic: QuicConnection, host: str) -> _ServerConnection:
        return cast(_ServerConnection, _classes(self.backend)[0](quic, None, server=self, host=host))

    @property
    def num_connections(self) -> int:
        return sum(1 for c in self._connections if c.node is not None)

    @property
    def peer_nodes(self) -> list[str]:
        """Authenticated node names of the open connections."""
        return sorted(c.node for c in self._connections if c.node is not None)

    async def start(self) -> tuple[str, int]:
        if self._server is not None:
            raise RuntimeError("QUIC server already started")
        # Each connection takes its TLS material from self.tls when its handshake starts.
        server = cast(BoundedQuicServer, _classes(self.backend)[1](
            owner=self, connect=self._connect, configuration=self.tls.current().configuration, retry=self.retry))
        sock = udp_socket(self.host, self.port, self.tuning.socket_buffer)
        self.host, self.port = sock.getsockname()[:2]
        await self.backend.endpoint(sock, server)
        self._server = server
        logger.info("QUIC server listening on %s:%d (%s, ALPN %s, retry %s)", self.host, self.port,
                    self.backend.name, ALPN, self.retry)
        return self.host, self.port

    async def close(self) -> None:
        """Close every connection and wait for block reads in flight (the source may close after)."""
        if self._server is None:
            return
        conns = list(self._connections)
        for conn in conns:
            if conn.node is not None and not conn._terminated:
                self.metrics.connections.labels(TRANSPORT, "server").dec()
            conn._terminated = True
            conn._release()
        self._server.close()  # sends CONNECTION_CLOSE to every client
        self._server = None
        for conn in conns:
            if conn._timer is not None:  # the socket is gone: no retransmission or drain timers
                conn._timer.cancel()
        await asyncio.gather(*self.fetches, return_exceptions=True)
        if self.executor is not None:
            executor, self.executor = self.executor, None
            await asyncio.to_thread(executor.shutdown, wait=True, cancel_futures=True)
