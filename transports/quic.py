"""QUIC transport (aioquic 1.7.2): thin asyncio adapters over the sans-I/O codec and session.

    client (QuicTransportClient)                    server (QuicTransportServer)
    pool: node -> one connection                    per connection: stream id -> _ServerStream
    pull(): one bidirectional stream per PULL
        PULL + FIN ───────────────────────────────► FrameDecoder(max_payload=0) → answer_pull()
        ◄─────────────── BLOCK | MISS ... END + FIN  frames pumped round-robin over streams
    PullTracker verifies each digest                 while unacked bytes < send_high_water

ALPN `kvfabric/1`; mutual TLS against the cluster CA (the server side is enforced by
`transports.quic_tls`, the client side by aioquic's own verification with the dialled node name
as server name). Session tickets are kept per peer node and offered on reconnect.

Invariants and bounds:
  * every address asked for yields exactly one result (Hit or Miss), never unverified bytes;
    a stream or connection failure turns what is pending into misses;
  * per connection the server buffers at most `send_high_water` + one frame of answers, plus
    128 open streams (aioquic's limit) × one FrameDecoder (64 KiB header limit, 256 KiB staging
    buffer; client payloads are refused on the preamble); receive buffers are capped by the
    QUIC flow-control windows;
  * a stream that stalls mid-frame for `frame_timeout_s` gets an ERROR(timeout) and is closed;
    a pull with no progress for `frame_timeout_s` ends with TIMEOUT misses.
Per received datagram the work is O(frames in it); the send pump is O(open streams) per round.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import socket
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

from aioquic import tls
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import QuicErrorCode

from fabric.config import TransportConfig
from fabric.keys import BlockAddress
from transports.base import BlockSource, Peer, PullResult
from transports.certs import NodeCredentials
from transports.codec import (
    DEFAULT_MAX_PAYLOAD,
    Block,
    End,
    Error,
    ErrorCode,
    Frame,
    FrameDecoder,
    Miss,
    MissReason,
    ProtocolError,
    Pull,
    encode,
    encode_parts,
)
from transports.metrics import TransportMetrics
from transports.quic_tls import QuicTlsMaterial, auth_failure, install_client_auth, peer_node
from transports.session import PullTracker, answer_pull
from transports.udp import UdpEndpoint, udp_socket

logger = logging.getLogger(__name__)

ALPN = "kvfabric/1"
TRANSPORT = "quic"
# aioquic widens a stream's receive window as data arrives, not as the caller consumes it, so a
# stream's answers can pile up in the client. Asking at most 64 addresses per stream bounds that
# to 64 payloads per pull in flight (and keeps the PULL header far under the 64 KiB limit); the
# extra stream per 64 blocks costs one round trip.
MAX_ADDRESSES_PER_STREAM = 64
STREAM_PROTOCOL_ERROR = 0x1        # application error codes for STOP_SENDING / RESET_STREAM
STREAM_TIMEOUT = 0x2
STREAM_CANCELLED = 0x3


@dataclass(frozen=True, slots=True)
class QuicTuning:
    """Knobs that decide QUIC throughput. Defaults suit loopback and datacenter jumbo frames."""

    max_datagram_size: int = 8952           # 9000-byte MTU minus IP/UDP headers; 1452 for Ethernet
    # Windows and the send high-water mark keep the bytes in flight below what the receiver's
    # socket buffer absorbs while its (single-threaded, pure-Python) QUIC stack catches up:
    # loss there halves the congestion window. They are far above loopback/datacenter BDPs.
    max_data: int = 8 * 1024 * 1024         # connection flow-control window
    max_stream_data: int = 4 * 1024 * 1024  # per-stream flow-control window
    send_high_water: int = 2 * 1024 * 1024  # server: unacknowledged answer bytes per connection
    socket_buffer: int = 8 * 1024 * 1024    # SO_SNDBUF / SO_RCVBUF, capped by net.core.[rw]mem_max

    @classmethod
    def from_config(cls, config: TransportConfig) -> QuicTuning:
        return cls(max_datagram_size=config.max_datagram_size, max_data=config.quic_max_data,
                   max_stream_data=config.quic_max_stream_data)

    @classmethod
    def aioquic_defaults(cls) -> QuicTuning:
        """Stock aioquic settings (1200-byte datagrams, 1 MiB windows): the benchmark baseline."""
        d = QuicConfiguration()
        return cls(d.max_datagram_size, d.max_data, d.max_stream_data, 1024 * 1024, 0)


def _base_configuration(is_client: bool, tuning: QuicTuning, idle_timeout_s: float) -> QuicConfiguration:
    return QuicConfiguration(is_client=is_client, alpn_protocols=[ALPN], idle_timeout=idle_timeout_s,
                             max_datagram_size=tuning.max_datagram_size, max_data=tuning.max_data,
                             max_stream_data=tuning.max_stream_data)


def _send(quic: QuicConnection, stream_id: int, frame: Frame, max_payload: int,
          end_stream: bool = False) -> int:
    """Queue one whole frame on a stream (header and payload without joining them); bytes queued."""
    head, payload = encode_parts(frame, max_payload=max_payload)
    quic.send_stream_data(stream_id, head, end_stream=end_stream and not payload)
    size = memoryview(payload).nbytes
    if size:  # aioquic copies into its send buffer: hand it the payload's own memory
        quic.send_stream_data(stream_id, cast(bytes, memoryview(payload).cast("B")), end_stream=end_stream)
    return len(head) + size


def _stop_reading(quic: QuicConnection, stream_id: int, code: int) -> None:
    """STOP_SENDING to the peer, unless aioquic already discarded the stream."""
    if stream_id in quic._streams and quic._stream_can_receive(stream_id):
        quic.stop_stream(stream_id, code)


# =============================================================================================
# Server


@dataclass(slots=True)
class _ServerStream:
    """A client stream. Kept (without its decoder) after we closed it until the client's FIN or
    reset arrives, so late bytes are ignored rather than mistaken for a new stream."""

    stream_id: int
    decoder: FrameDecoder | None
    last_progress: float
    request_id: int = 0
    answer: Iterator[Frame] | None = None
    answered: bool = False       # END or ERROR written (with FIN), or the stream was abandoned
    peer_finished: bool = False  # the client's FIN or reset arrived


class _ServerConnection(QuicConnectionProtocol):
    """One client connection: decodes PULL streams and pumps their answers."""

    def __init__(self, quic: QuicConnection, stream_handler: Any = None, *,  # aioquic passes a handler
                 server: QuicTransportServer) -> None:
        super().__init__(quic)
        self._server = server
        install_client_auth(quic, server.tls.current)
        self.node: str | None = None
        self._streams: dict[int, _ServerStream] = {}
        self._ready: deque[_ServerStream] = deque()   # streams with answer frames left to send
        self._sending: set[int] = set()               # streams whose sent bytes are not all acked
        self._sweep_timer: asyncio.TimerHandle | None = None
        self._terminated = False
        self._refused = False
        server._connections.add(self)

    # -- aioquic hooks -------------------------------------------------------------------------

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        self._quic.receive_datagram(cast(bytes, data), addr, now=self._loop.time())
        if self.node is None and not self._refused:
            self._check_refused()
        self._process_events()
        if not self._terminated and self._quic._close_event is not None:
            self._on_terminated(self._quic._close_event)  # closing/draining: done serving it
        self._transmit_soon()  # once per batch of datagrams (see UdpEndpoint)

    def transmit(self) -> None:
        self._pump()
        super().transmit()

    def _check_refused(self) -> None:
        """Count and log a refused client as soon as the TLS hook refuses it (not after draining)."""
        reason = auth_failure(self._quic)
        if reason is None:
            return
        self._refused = True
        close = self._quic._close_event
        addr = self._quic._network_paths[0].addr if self._quic._network_paths else "?"
        self._server.metrics.auth_failures.labels(TRANSPORT, reason.value).inc()
        logger.warning("refused QUIC client %s: %s (%s)", addr, reason.value,
                       close.reason_phrase if close else "")

    def quic_event_received(self, event: events.QuicEvent) -> None:
        if isinstance(event, events.StreamDataReceived):
            self._on_data(event.stream_id, event.data, event.end_stream)
        elif isinstance(event, events.HandshakeCompleted):
            self._on_handshake(event)
        elif isinstance(event, events.StreamReset):
            self._close(event.stream_id, peer_finished=True)
        elif isinstance(event, events.StopSendingReceived):
            self._close(event.stream_id)
        elif isinstance(event, events.ConnectionTerminated):
            self._on_terminated(event)

    # -- events --------------------------------------------------------------------------------

    def _on_handshake(self, event: events.HandshakeCompleted) -> None:
        self.node = peer_node(self._quic)
        if self.node is None:  # cannot happen with the hook installed; never serve an unknown peer
            self._quic.close(QuicErrorCode.CRYPTO_ERROR + 116, reason_phrase="client not authenticated")
            return
        self._server.metrics.connections.labels(TRANSPORT, "server").inc()
        logger.info("QUIC connection from node %s (session resumed: %s)", self.node, event.session_resumed)
        self._arm_sweep()

    def _on_terminated(self, event: events.ConnectionTerminated) -> None:
        if self._terminated:
            return
        self._terminated = True
        if self.node is None and not self._refused:
            self._check_refused()
        if self.node is None and not self._refused:
            logger.info("QUIC handshake failed: %s (code %#x)", event.reason_phrase, event.error_code)
        elif self.node is not None:
            self._server.metrics.connections.labels(TRANSPORT, "server").dec()
            logger.debug("QUIC connection from %s closed: %s", self.node, event.reason_phrase or "idle")
        self._release()

    def _release(self) -> None:
        if self._sweep_timer is not None:
            self._sweep_timer.cancel()
            self._sweep_timer = None
        self._streams.clear()
        self._ready.clear()
        self._sending.clear()
        self._server._connections.discard(self)

    def _on_data(self, stream_id: int, data: bytes, end_stream: bool) -> None:
        if self.node is None:
            self._quic.close(QuicErrorCode.CRYPTO_ERROR + 116, reason_phrase="client not authenticated")
            return
        stream = self._streams.get(stream_id)
        if stream is None:
            if stream_id % 4 != 0:  # only client-initiated bidirectional streams carry PULLs
                self._server.metrics.protocol_errors.labels(TRANSPORT).inc()
                _stop_reading(self._quic, stream_id, STREAM_PROTOCOL_ERROR)
                return
            stream = _ServerStream(stream_id, FrameDecoder(max_payload=0), self._loop.time())
            self._streams[stream_id] = stream
        if stream.decoder is None:  # closed by us: late bytes
            if end_stream:
                self._close(stream_id, peer_finished=True)
            return
        stream.last_progress = self._loop.time()
        try:
            for frame in stream.decoder.feed(data):
                self._on_frame(stream, frame)
            if end_stream:
                stream.peer_finished = True
                stream.decoder.close()
                if stream.answer is None and not stream.answered:
                    raise ProtocolError("stream ended without a PULL")
        except ProtocolError as e:
            self._fail_stream(stream, ErrorCode.PROTOCOL, str(e))
            return
        self._forget_if_done(stream)

    def _on_frame(self, stream: _ServerStream, frame: Frame) -> None:
        if not isinstance(frame, Pull):
            raise ProtocolError(f"a client stream carries one PULL, got {frame.TYPE.name}")
        if stream.answer is not None or stream.answered:
            raise ProtocolError("a stream carries exactly one PULL")
        stream.request_id = frame.request_id
        stream.answer = answer_pull(self._server.source, frame)
        self._ready.append(stream)

    def _fail_stream(self, stream: _ServerStream, code: ErrorCode, message: str) -> None:
        """ERROR frame + FIN on the stream, stop reading it, free its state. Other streams carry on."""
        logger.warning("QUIC stream %d from node %s closed: %s", stream.stream_id, self.node, message)
        if code is ErrorCode.PROTOCOL:
            self._server.metrics.protocol_errors.labels(TRANSPORT).inc()
        if not stream.answered and self._can_send(stream.stream_id):
            _send(self._quic, stream.stream_id, Error(stream.request_id, code, message[:200]), 0,
                  end_stream=True)
            self._sending.add(stream.stream_id)
        if not stream.peer_finished:
            _stop_reading(self._quic, stream.stream_id,
                          STREAM_TIMEOUT if code is ErrorCode.TIMEOUT else STREAM_PROTOCOL_ERROR)
        self._close(stream.stream_id)

    def _close(self, stream_id: int, peer_finished: bool = False) -> None:
        """Stop answering a stream and free its decoder."""
        stream = self._streams.get(stream_id)
        if stream is None:
            return
        stream.answer, stream.answered, stream.decoder = None, True, None
        stream.peer_finished = stream.peer_finished or peer_finished
        self._forget_if_done(stream)

    def _forget_if_done(self, stream: _ServerStream) -> None:
        if stream.answered and stream.peer_finished:
            self._streams.pop(stream.stream_id, None)

    def _can_send(self, stream_id: int) -> bool:
        qs = self._quic._streams.get(stream_id)
        return qs is None or (qs.sender._buffer_fin is None and qs.sender._reset_error_code is None)

    # -- sending -------------------------------------------------------------------------------

    def _unacked(self) -> int:
        total = 0
        for stream_id in list(self._sending):
            qs = self._quic._streams.get(stream_id)
            if qs is None or qs.sender.is_finished:
                self._sending.discard(stream_id)
            else:
                total += len(qs.sender._buffer)
        return total

    def _pump(self) -> None:
        """Move answer frames into aioquic, round-robin over streams, up to the high-water mark."""
        if not self._ready:
            return
        budget = self._server.tuning.send_high_water - self._unacked()
        max_payload = self._server.max_payload
        while self._ready and budget > 0:
            stream = self._ready.popleft()
            if stream.answer is None:
                continue
            try:
                frame = next(stream.answer)
            except ProtocolError as e:  # e.g. a PULL of too many addresses
                self._fail_stream(stream, ErrorCode.PROTOCOL, str(e))
                continue
            except OSError as e:  # the source could not read a block: this pull fails, we carry on
                self._fail_stream(stream, ErrorCode.INTERNAL, f"cannot read a block: {e}")
                continue
            if not self._can_send(stream.stream_id):
                self._close(stream.stream_id)
                continue
            last = isinstance(frame, End)
            budget -= _send(self._quic, stream.stream_id, frame, max_payload, end_stream=last)
            self._sending.add(stream.stream_id)
            self._count(frame)
            if last:
                stream.answer, stream.answered, stream.decoder = None, True, None
                self._forget_if_done(stream)
            else:
                self._ready.append(stream)

    def _count(self, frame: Frame) -> None:
        metrics = self._server.metrics
        if isinstance(frame, Block):
            metrics.child(metrics.served, TRANSPORT, "hit").inc()
            metrics.child(metrics.served_bytes, TRANSPORT).inc(memoryview(frame.payload).nbytes)
        elif isinstance(frame, Miss):
            metrics.child(metrics.served, TRANSPORT, frame.reason.value).inc()

    # -- stalled streams -----------------------------------------------------------------------

    def _arm_sweep(self) -> None:
        interval = max(0.05, self._server.frame_timeout_s / 4)
        self._sweep_timer = self._loop.call_later(interval, self._sweep)

    def _sweep(self) -> None:
        now = self._loop.time()
        failed = False
        for stream in list(self._streams.values()):
            if (stream.decoder is not None and stream.decoder.mid_frame
                    and now - stream.last_progress > self._server.frame_timeout_s):
                self._fail_stream(stream, ErrorCode.TIMEOUT,
                                  f"stalled mid-frame for {now - stream.last_progress:.1f}s")
                failed = True
        if failed:
            self.transmit()
        if not self._terminated:
            self._arm_sweep()


class QuicTransportServer:
    """Answers PULL streams from `source` on a UDP port, for clients with a cluster certificate."""

    def __init__(self, credentials: NodeCredentials, source: BlockSource, *, host: str = "127.0.0.1",
                 port: int = 0, tuning: QuicTuning | None = None, max_payload: int = DEFAULT_MAX_PAYLOAD,
                 frame_timeout_s: float = 10.0, idle_timeout_s: float = 30.0,
                 metrics: TransportMetrics | None = None, ticket_lifetime_s: float = 3600.0) -> None:
        self.credentials = credentials
        self.source = source
        self.host, self.port = host, port
        self.tuning = tuning or QuicTuning()
        self.max_payload = max_payload
        self.frame_timeout_s = frame_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.metrics = metrics or TransportMetrics()
        self.tls = QuicTlsMaterial(credentials, _base_configuration(False, self.tuning, idle_timeout_s),
                                   ticket_lifetime_s)
        self._server: QuicServer | None = None
        self._connections: set[_ServerConnection] = set()

    @classmethod
    def from_config(cls, config: TransportConfig, credentials: NodeCredentials, source: BlockSource,
                    metrics: TransportMetrics | None = None) -> QuicTransportServer:
        return cls(credentials, source, host=config.host, port=config.quic_port,
                   tuning=QuicTuning.from_config(config),
                   max_payload=config.max_payload_bytes, frame_timeout_s=config.frame_timeout_s,
                   idle_timeout_s=config.idle_timeout_s, metrics=metrics)

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
        server = QuicServer(configuration=self.tls.current().configuration,
                            create_protocol=partial(_ServerConnection, server=self))
        sock = udp_socket(self.host, self.port, self.tuning.socket_buffer)
        UdpEndpoint(sock, server)
        self._server = server
        self.host, self.port = sock.getsockname()[:2]
        logger.info("QUIC server listening on %s:%d (ALPN %s)", self.host, self.port, ALPN)
        return self.host, self.port

    async def close(self) -> None:
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
        await asyncio.sleep(0)


# =============================================================================================
# Client


@dataclass(slots=True)
class _PullStream:
    tracker: PullTracker
    decoder: FrameDecoder
    last_progress: float
    results: deque[PullResult] = field(default_factory=deque)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)


class _ClientConnection(QuicConnectionProtocol):
    """One pooled connection to a peer; routes stream data to the pulls waiting on it."""

    def __init__(self, quic: QuicConnection, *, client: QuicTransportClient, peer: Peer) -> None:
        super().__init__(quic)
        self.client = client
        self.peer = peer
        self.pulls: dict[int, _PullStream] = {}
        self.slots = asyncio.Semaphore(client.max_inflight)
        self.closed = False
        self.session_resumed = False
        self.last_received = self._loop.time()

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        self.last_received = self._loop.time()
        self._quic.receive_datagram(cast(bytes, data), addr, now=self.last_received)
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
        if isinstance(event, events.StreamDataReceived):
            self._on_data(event.stream_id, event.data, event.end_stream)
        elif isinstance(event, events.StreamReset):
            self._finish(event.stream_id, MissReason.PEER_ERROR)
        elif isinstance(event, events.HandshakeCompleted):
            self.session_resumed = event.session_resumed
        elif isinstance(event, events.ConnectionTerminated):
            self._on_terminated(event)

    def _on_terminated(self, event: events.ConnectionTerminated) -> None:
        if self.closed:
            return
        self.closed = True
        if self._connected:
            self.client.metrics.connections.labels(TRANSPORT, "client").dec()
        if QuicErrorCode.CRYPTO_ERROR <= event.error_code < QuicErrorCode.CRYPTO_ERROR + 256:
            ours = self._quic.tls.state != tls.State.CLIENT_POST_HANDSHAKE
            reason = "server_untrusted" if ours else "refused_by_server"
            self.client.metrics.auth_failures.labels(TRANSPORT, reason).inc()
            logger.warning("QUIC handshake with %s failed (%s): %s", self.peer.node, reason, event.reason_phrase)
        for stream_id in list(self.pulls):
            self._finish(stream_id, MissReason.PEER_GONE)

    def _on_data(self, stream_id: int, data: bytes, end_stream: bool) -> None:
        pull = self.pulls.get(stream_id)
        if pull is None:
            return  # a pull we gave up on; its stream was stopped
        pull.last_progress = self._loop.time()
        try:
            for frame in pull.decoder.feed(data):
                pull.results.extend(pull.tracker.on_frame(frame))
            if end_stream:
                pull.decoder.close()
                pull.results.extend(pull.tracker.fail(MissReason.PEER_ERROR))  # answered → no-op
        except ProtocolError as e:
            logger.warning("QUIC pull %d from %s: bad answer: %s", pull.tracker.request_id, self.peer.node, e)
            self.client.metrics.protocol_errors.labels(TRANSPORT).inc()
            _stop_reading(self._quic, stream_id, STREAM_PROTOCOL_ERROR)
            pull.results.extend(pull.tracker.fail(MissReason.PEER_ERROR))
        if pull.tracker.done:
            del self.pulls[stream_id]
        pull.wakeup.set()

    def _finish(self, stream_id: int, reason: MissReason) -> None:
        pull = self.pulls.pop(stream_id, None)
        if pull is not None:
            pull.results.extend(pull.tracker.fail(reason))
            pull.wakeup.set()

    def open_pull(self, request_id: int, addresses: Sequence[BlockAddress]) -> tuple[int, _PullStream]:
        stream_id = self._quic.get_next_available_stream_id()
        pull = _PullStream(PullTracker(request_id, addresses),
                           FrameDecoder(max_payload=self.client.max_payload), self._loop.time())
        self.pulls[stream_id] = pull
        self._quic.send_stream_data(stream_id, encode(Pull(request_id, tuple(addresses))), end_stream=True)
        self.transmit()
        return stream_id, pull

    def abandon(self, stream_id: int) -> None:
        """Stop a pull early: ask the server to stop sending and forget the stream."""
        if self.pulls.pop(stream_id, None) is not None and not self.closed:
            _stop_reading(self._quic, stream_id, STREAM_CANCELLED)
            self.transmit()


def _all_gone(pull: _PullStream, num_addresses: int) -> bool:
    return len(pull.results) == num_addresses and all(
        isinstance(r, Miss) and r.reason is MissReason.PEER_GONE for r in pull.results)


@dataclass(frozen=True, slots=True)
class ConnectionInfo:
    node: str
    num_connects: int       # connections made to this peer so far
    session_resumed: bool   # the current connection's handshake used a session ticket
    open: bool


class QuicTransportClient:
    """Pulls blocks from peers over pooled QUIC connections (one per peer, reconnected on loss)."""

    def __init__(self, credentials: NodeCredentials, *, tuning: QuicTuning | None = None,
                 max_payload: int = DEFAULT_MAX_PAYLOAD, connect_timeout_s: float = 5.0,
                 idle_timeout_s: float = 30.0, frame_timeout_s: float = 10.0, max_inflight: int = 32,
                 metrics: TransportMetrics | None = None) -> None:
        self.credentials = credentials
        self.tuning = tuning or QuicTuning()
        self.max_payload = max_payload
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.frame_timeout_s = frame_timeout_s
        self.max_inflight = max_inflight
        self.metrics = metrics or TransportMetrics()
        self._pool: dict[str, tuple[_ClientConnection, UdpEndpoint]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._tickets: dict[str, tls.SessionTicket] = {}
        self._num_connects: dict[str, int] = {}
        self.tls = QuicTlsMaterial(credentials, _base_configuration(True, self.tuning, idle_timeout_s))
        self._tickets_generation = -1
        self._request_ids = itertools.count(1)

    @classmethod
    def from_config(cls, config: TransportConfig, credentials: NodeCredentials,
                    metrics: TransportMetrics | None = None) -> QuicTransportClient:
        return cls(credentials, tuning=QuicTuning.from_config(config),
                   max_payload=config.max_payload_bytes, connect_timeout_s=config.connect_timeout_s,
                   idle_timeout_s=config.idle_timeout_s, frame_timeout_s=config.frame_timeout_s,
                   max_inflight=config.max_inflight, metrics=metrics)

    def connection_info(self, peer: Peer) -> ConnectionInfo | None:
        entry = self._pool.get(peer.node)
        if entry is None:
            return None
        conn = entry[0]
        return ConnectionInfo(peer.node, self._num_connects.get(peer.node, 0), conn.session_resumed,
                              not conn.closed)

    async def pull(self, peer: Peer, addresses: Sequence[BlockAddress]) -> AsyncIterator[PullResult]:
        """One result per address; the results of each block's layers come in the order asked."""
        for start in range(0, len(addresses), MAX_ADDRESSES_PER_STREAM):
            async for result in self._pull_stream(peer, addresses[start:start + MAX_ADDRESSES_PER_STREAM]):
                self.metrics.record(TRANSPORT, result)
                yield result

    async def _pull_stream(self, peer: Peer, addresses: Sequence[BlockAddress],
                           may_retry: bool = True) -> AsyncIterator[PullResult]:
        request_id = next(self._request_ids)
        conn, reused = await self._connection(peer)
        if conn is None:
            for address in addresses:
                yield Miss(request_id, address, MissReason.PEER_GONE)
            return
        stale = False
        async with conn.slots:
            stream_id, pull = conn.open_pull(request_id, addresses) if not conn.closed else (-1, None)
            try:
                while pull is not None:
                    if reused and may_retry and pull.tracker.done and _all_gone(pull, len(addresses)):
                        # A pooled connection that was already closing (peer restarted, idle
                        # timeout): nothing was answered, and PULL is idempotent, so dial again.
                        stale = True
                        break
                    while pull.results:
                        yield pull.results.popleft()
                    if pull.tracker.done:
                        return
                    pull.wakeup.clear()
                    await self._wait(conn, pull)
            finally:
                if pull is not None and not pull.tracker.done:
                    conn.abandon(stream_id)
        if pull is None or stale:
            async for result in self._pull_stream(peer, addresses, may_retry=False):
                yield result

    async def _wait(self, conn: _ClientConnection, pull: _PullStream) -> None:
        """Wait for more results; a pull without progress for frame_timeout_s ends in TIMEOUT misses."""
        while True:
            idle = conn._loop.time() - pull.last_progress
            try:
                await asyncio.wait_for(pull.wakeup.wait(), max(0.0, self.frame_timeout_s - idle))
                return
            except TimeoutError:
                if conn._loop.time() - pull.last_progress < self.frame_timeout_s:
                    continue
            break
        logger.warning("QUIC pull %d from %s: no progress for %.1fs", pull.tracker.request_id,
                       conn.peer.node, self.frame_timeout_s)
        pull.results.extend(pull.tracker.fail(MissReason.TIMEOUT))
        if conn._loop.time() - conn.last_received >= self.frame_timeout_s:
            # Nothing at all came back: the peer is gone (e.g. restarted without closing);
            # drop the connection so the next pull dials again.
            await self.disconnect(conn.peer)

    async def _connection(self, peer: Peer) -> tuple[_ClientConnection | None, bool]:
        """The pooled connection to `peer` (reused: True) or a new one; None if it cannot be made."""
        entry = self._pool.get(peer.node)
        if entry is not None and not entry[0].closed and entry[0].peer == peer:
            return entry[0], True
        async with self._locks.setdefault(peer.node, asyncio.Lock()):
            entry = self._pool.get(peer.node)
            if entry is not None and not entry[0].closed and entry[0].peer == peer:
                return entry[0], True
            if entry is not None:
                await self.disconnect(peer)
            return await self._connect(peer), False

    def _client_configuration(self, peer: Peer) -> QuicConfiguration:
        material = self.tls.current()
        if self.tls.generation != self._tickets_generation:
            self._tickets.clear()  # a rotated certificate must be shown in a full handshake
            self._tickets_generation = self.tls.generation
        # server_name: the server certificate must name the node we dial (checked by aioquic).
        return dataclasses.replace(material.configuration, server_name=peer.node,
                                   session_ticket=self._tickets.get(peer.node))

    async def _connect(self, peer: Peer) -> _ClientConnection | None:
        loop = asyncio.get_running_loop()
        quic = QuicConnection(configuration=self._client_configuration(peer),
                              session_ticket_handler=partial(self._tickets.__setitem__, peer.node))
        try:
            infos = await loop.getaddrinfo(peer.host, peer.port, type=socket.SOCK_DGRAM)
            family, addr = infos[0][0], infos[0][4]
            sock = udp_socket("::" if family == socket.AF_INET6 else "0.0.0.0", 0, self.tuning.socket_buffer)
        except OSError as e:
            logger.warning("cannot reach QUIC peer %s at %s:%d: %s", peer.node, peer.host, peer.port, e)
            return None
        conn = _ClientConnection(quic, client=self, peer=peer)
        transport = UdpEndpoint(sock, conn)
        self._num_connects[peer.node] = self._num_connects.get(peer.node, 0) + 1
        self._pool[peer.node] = (conn, transport)
        conn.connect(addr)
        try:
            await asyncio.wait_for(conn.wait_connected(), self.connect_timeout_s)
        except (ConnectionError, TimeoutError) as e:
            logger.warning("QUIC connection to %s failed: %s", peer.node, type(e).__name__)
            self._tickets.pop(peer.node, None)
            await self.disconnect(peer)
            return None
        self.metrics.connections.labels(TRANSPORT, "client").inc()
        logger.debug("QUIC connected to %s (resumed: %s)", peer.node, conn.session_resumed)
        return conn

    async def disconnect(self, peer: Peer) -> None:
        """Close the pooled connection to `peer` (its open pulls end as PEER_GONE misses)."""
        entry = self._pool.pop(peer.node, None)
        if entry is None:
            return
        conn, transport = entry
        if not conn.closed:
            conn.close()  # CONNECTION_CLOSE goes out before the socket is closed below
            conn._on_terminated(events.ConnectionTerminated(QuicErrorCode.NO_ERROR, None, "closed by us"))
        transport.close()
        if conn._timer is not None:  # no drain or retransmission timers on a closed socket
            conn._timer.cancel()

    async def close(self) -> None:
        for node in list(self._pool):
            entry = self._pool[node]
            await self.disconnect(entry[0].peer)
        await asyncio.sleep(0)

