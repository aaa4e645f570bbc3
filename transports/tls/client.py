"""TLS-TCP client: pulls over one pooled, mutually authenticated connection per peer.

The protocol rules are `ClientSession`'s (client_session.py); this module dials (TLS 1.3, the
server's SAN must name the dialled node), keeps PULL_WINDOW PULLs of a pull in flight (the server answers a
connection's PULLs round-robin, so two keep one pull's answers in order), checks digests on the
loop, receives runs of hits straight into the caller's slots (`into`), and pauses reading while
over RESULTS_HIGH bytes of results wait for their callers. A pull that races the server's idle
close is made again on a new connection. The server is server.py.
"""


from __future__ import annotations

import asyncio
import logging
import ssl
from collections import deque
from collections.abc import AsyncIterator, Sequence
from typing import Self

from fabric import config as defaults
from fabric.config import TransportConfig
from fabric.keys import BlockAddress
from transports.core.base import Hit, Peer, PullResult
from transports.core.buffers import tune_allocator, uninitialised_bytearray
from transports.core.client_session import ClientSession, Outcome
from transports.core.codec import (
    DEFAULT_MAX_PAYLOAD,
    Bye,
    Frame,
    FrameDecoder,
    Miss,
    MissReason,
    ProtocolError,
)
from transports.core.link import FrameLink
from transports.core.metrics import TransportMetrics
from transports.core.pool import STALE_RETRIES, ConnectionPool, may_redial
from transports.core.timer import DeadlineTimer
from transports.core.tracker import MAX_ADDRESSES_PER_PULL
from transports.tls.channel import TlsChannel
from transports.tls.handshake import auth_failure_reason, open_tls
from transports.tls.link import TRANSPORT, TlsLink
from transports.trust.certs import NodeCredentials

logger = logging.getLogger(__name__)

ADDRESSES_PER_PULL = MAX_ADDRESSES_PER_PULL
PULL_WINDOW = 2   # the server answers a connection's PULLs round-robin: 2 in flight keep a pull in order
RESULTS_HIGH = 64 * 1024 * 1024


class _Request:
    """One PULL's caller: its results (the session's `Outcome`) and how the caller is woken."""

    __slots__ = ("outcome", "request_id", "waiting", "wakeup")

    def __init__(self, request_id: int, outcome: Outcome) -> None:
        self.request_id = request_id
        self.outcome = outcome
        self.wakeup = asyncio.Event()
        self.waiting = False    # its caller waits for results


class ClientConnection:
    """Client side of one connection: its ClientSession, and results handed to their callers."""

    link: FrameLink

    @property
    def closed(self) -> bool:
        return self.link.closed

    def __init__(self, client: TlsTcpClient, peer: Peer) -> None:
        self.client = client
        self.peer = peer
        self._loop = asyncio.get_running_loop()
        # Payload buffers are not zero-filled: decryption overwrites every byte (link.py).
        decoder = FrameDecoder(max_payload=client.max_payload, payload_allocator=uninitialised_bytearray)
        self.session = ClientSession(client.node, peer.node, self._loop.time(), max_payload=client.max_payload,
                                     frame_timeout_s=client.frame_timeout_s, idle_timeout_s=client.idle_timeout_s,
                                     decoder=decoder)
        self.requests: dict[int, _Request] = {}
        self.paused = False   # reading paused: over RESULTS_HIGH bytes of results wait for callers
        self.timer = DeadlineTimer(self._expire)

    def attach(self, link: FrameLink) -> None:
        self.link = link
        link.more_due = self._more_due

    def _more_due(self) -> bool:
        """Another answer is due after the one being received (the link may read ahead)."""
        return self.session.blocks_pending > 1

    def submit(self, addresses: Sequence[BlockAddress], into: memoryview | None = None,
               namespace: bytes = b"") -> _Request:
        if self.link.closed or self.session.closing:
            return _Request(0, Outcome(deque(Miss(0, a, MissReason.PEER_GONE) for a in addresses), done=True))
        rid, frames = self.session.submit(addresses, self._loop.time(), into, namespace)
        req = self.requests[rid] = _Request(rid, self.session.outcome(rid))
        for frame in frames:
            self.link.send(frame)
        self.timer.at_most(self.session.next_deadline())
        return req

    def abandon(self, req: _Request) -> None:
        """The caller stopped iterating: drop further results (the frames are still read)."""
        self.session.cancel(req.request_id)   # its results no longer count in `session.buffered`
        self.requests.pop(req.request_id, None)
        req.outcome.clear()
        self.consumed()

    def consumed(self, *, starving: bool = False) -> None:
        """Results were taken: resume reading once `session.buffered` is down to half of RESULTS_HIGH.
        `starving`: a caller waits with nothing to read: resume even over RESULTS_HIGH (else deadlock)."""
        if self.paused and (starving or self.session.buffered <= RESULTS_HIGH // 2) and not self.link.closed:
            self.paused = False
            self.session.resume(self._loop.time())
            self.link.resume_reading()
            self.timer.at_most(self.session.next_deadline())

    def on_frames(self, frames: list[Frame]) -> None:
        if frames:
            self._deliver(self.session.receive_frames(frames, self._loop.time()))
        else:   # part of a payload: progress for the stall timers, no result to hand over
            self.session.receive_bytes(self._loop.time())

    def _deliver(self, touched: list[int]) -> None:
        """Count what the session queued, wake the callers of the requests whose outcomes it changed,
        and pause reading while over RESULTS_HIGH bytes of results wait and no caller starves."""
        metrics, transport = self.client.metrics, self.client.transport
        tally = self.session.take_tally()
        for reason, count in tally.misses.items():
            metrics.child(metrics.pulls, transport, reason.value).inc(count)
        if tally.num_hits:
            metrics.child(metrics.pulls, transport, "hit").inc(tally.num_hits)
            metrics.child(metrics.pull_bytes, transport).inc(tally.num_bytes)
        for rid in touched:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.outcome.done:
                del self.requests[rid]
            req.wakeup.set()
        if touched and not self.paused and self.session.buffered > RESULTS_HIGH and not any(
                r.waiting and not r.outcome.results for r in self.requests.values()):
            self.paused = True
            self.session.pause(self._loop.time())
            self.link.pause_reading()
        self.timer.at_most(self.session.next_deadline())
        if self.session.closing:
            self.client._forget(self)
            if self.session.error is not None:
                self.client.metrics.protocol_errors.labels(transport).inc()
                logger.warning("closing %s connection to %s: %s", transport, self.peer.node, self.session.error)
            self.link.close(self.session.close_reason, str(self.session.error or "closed"))

    def on_closed(self, reason: MissReason) -> None:
        self.timer.cancel()
        self.client._forget(self)
        self._deliver(self.session.connection_lost(reason))

    def _expire(self, now: float) -> float | None:
        """The session's timers (see DeadlineTimer): a stalled server, an idle connection."""
        if self.link.closed:
            return None
        deadline = self.session.next_deadline()
        if deadline is None or now < deadline:
            return deadline
        frames, touched = self.session.handle_timer(now)
        if self.session.closing:
            self.client._forget(self)   # before BYE, so that no new pull picks this connection
        for frame in frames:
            self.link.send(frame)
        self._deliver(touched)
        if self.session.closing:
            self.link.close_after_flush(self.session.close_reason, "idle" if frames else "server stalled")
        return self.session.next_deadline()


class TlsTcpClient:
    """Pulls blocks from peers over TLS-TCP; one pooled connection per peer, many pulls in flight on it."""

    transport = TRANSPORT  # the metrics label

    def __init__(self, credentials: NodeCredentials, *, max_payload: int = DEFAULT_MAX_PAYLOAD,
                 connect_timeout_s: float = defaults.CONNECT_TIMEOUT_S,
                 frame_timeout_s: float = defaults.FRAME_TIMEOUT_S, idle_timeout_s: float = defaults.IDLE_TIMEOUT_S,
                 metrics: TransportMetrics | None = None, tune_malloc: bool = False) -> None:
        """`tune_malloc`: opt in to `buffers.tune_allocator()` (process-wide glibc thresholds: faster large pulls)."""
        if tune_malloc:
            tune_allocator()
        self.credentials = credentials
        self.node = credentials.node
        self.max_payload = max_payload
        self.connect_timeout_s = connect_timeout_s
        self.frame_timeout_s = frame_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.metrics = metrics or TransportMetrics()
        self._pool: ConnectionPool[ClientConnection] = ConnectionPool(self._drop)
        self.num_connects = 0

    @classmethod
    def from_config(cls, config: TransportConfig, credentials: NodeCredentials,
                    metrics: TransportMetrics | None = None) -> Self:
        return cls(credentials, max_payload=config.max_payload_bytes, connect_timeout_s=config.connect_timeout_s,
                   frame_timeout_s=config.frame_timeout_s, idle_timeout_s=config.idle_timeout_s, metrics=metrics)

    async def pull(self, peer: Peer, addresses: Sequence[BlockAddress], *,
                   into: memoryview | None = None, namespace: bytes = b"") -> AsyncIterator[PullResult]:
        """One result per address, in the order asked; failures are misses, never exceptions. A pooled
        connection gone before answering anything (closed as idle, peer restarted) is replaced once.

        `into` (optional): one equal-size slot per address, back to back: runs of slot-sized hits
        are received straight into their slots and each such Hit's payload is its slot (see
        `ClientSession.submit`). The caller must not read a slot before its Hit came."""
        if not addresses:
            return
        slots = None if into is None else into.cast("B")
        part = 0 if slots is None else slots.nbytes // len(addresses)
        if slots is not None and part * len(addresses) != slots.nbytes:
            raise ValueError(f"{slots.nbytes} bytes do not split into {len(addresses)} equal slots")
        for attempt in range(1 + STALE_RETRIES):
            conn, reason, reused = await self._connection(peer)
            if conn is None:
                for miss in (Miss(0, address, reason) for address in addresses):
                    self.metrics.record(self.transport, miss)
                    yield miss
                return
            starts = range(0, len(addresses), ADDRESSES_PER_PULL)
            chunks = [addresses[i:i + ADDRESSES_PER_PULL] for i in starts]
            regions = [None if slots is None else slots[i * part:(i + len(c)) * part]
                       for i, c in zip(starts, chunks, strict=True)]
            requests = [conn.submit(chunks[i], regions[i], namespace)
                        for i in range(min(PULL_WINDOW, len(chunks)))]
            retry = False
            try:
                for i in range(len(chunks)):
                    req = requests[i]
                    outcome = req.outcome
                    results = outcome.results
                    while True:
                        while results:
                            r = outcome.take()   # out of the window; `consumed` resumes below
                            if (not isinstance(r, Hit) and i == 0 and r.reason is MissReason.PEER_GONE
                                    and may_redial(reused, outcome.answered, attempt)):
                                retry = True  # the pooled connection was gone before answering anything
                                break
                            yield r
                        conn.consumed()
                        if retry or (outcome.done and not results):
                            break
                        req.wakeup.clear()
                        req.waiting = True
                        conn.consumed(starving=True)
                        await req.wakeup.wait()
                        req.waiting = False
                    if retry:
                        break
                    if i + PULL_WINDOW < len(chunks):
                        requests.append(conn.submit(chunks[i + PULL_WINDOW], regions[i + PULL_WINDOW], namespace))
            finally:
                for req in requests:
                    conn.abandon(req)
            if not retry:
                return
            logger.info("pooled connection to %s was gone; pulling again on a new one", peer.node)

    async def _connection(self, peer: Peer) -> tuple[ClientConnection | None, MissReason, bool]:
        """(the pooled or a new connection, None and the miss reason when none can be had, whether
        the connection was reused from the pool)."""
        conn = self._pool.get(peer)
        if conn is not None:
            return conn, MissReason.PEER_GONE, True
        failure = [MissReason.PEER_GONE]

        async def dial(peer: Peer) -> ClientConnection | None:
            made, failure[0] = await self._dial(peer)
            return made

        conn, reused = await self._pool.connection(peer, dial)
        return conn, failure[0], reused

    async def _dial(self, peer: Peer) -> tuple[ClientConnection | None, MissReason]:
        """A new connection to `peer`, pooled; or None and the miss reason when none can be made."""
        try:
            sock = await open_tls(peer, self.credentials, self.connect_timeout_s)
        except ssl.SSLError as e:
            reason = auth_failure_reason(e)
            self.metrics.auth_failures.labels(self.transport, f"server_{reason}").inc()
            logger.warning("refusing server %s at %s:%d (%s): %s", peer.node, peer.host, peer.port, reason, e)
            return None, MissReason.PEER_ERROR
        except (OSError, TimeoutError) as e:
            logger.info("cannot reach %s at %s:%d: %s", peer.node, peer.host, peer.port, e)
            return None, MissReason.TIMEOUT if isinstance(e, TimeoutError) else MissReason.PEER_GONE
        conn = ClientConnection(self, peer)
        try:
            conn.attach(await self.open_link(peer, sock, conn))
        except (OSError, TimeoutError, ProtocolError) as e:
            logger.warning("could not set up a %s link with %s: %s", self.transport, peer.node, e)
            sock.close()
            return None, MissReason.PEER_ERROR
        self._pool.add(conn)
        self.num_connects += 1
        self.metrics.connections.labels(self.transport, "client").inc()
        conn.link.start()
        for frame in conn.session.hello():
            conn.link.send(frame)
        conn.timer.at_most(conn.session.next_deadline())
        return conn, MissReason.PEER_GONE

    async def open_link(self, peer: Peer, sock: TlsChannel, conn: ClientConnection) -> FrameLink:
        """The frame link of an authenticated connection (RDMA overrides this)."""
        return TlsLink(sock, conn.session.decoder, conn.on_frames, conn.on_closed,
                       self.frame_timeout_s, self.metrics, self.transport, batch_frames=True)

    def _forget(self, conn: ClientConnection) -> None:
        if self._pool.discard(conn):
            self.metrics.connections.labels(self.transport, "client").dec()

    async def _drop(self, conn: ClientConnection) -> None:
        """A pooled connection that closed, or reaches its node at an old address (see `pool`)."""
        self._forget(conn)
        if not conn.link.closed:
            conn.link.close(MissReason.PEER_GONE, "the peer moved")

    async def close(self) -> None:
        for conn in self._pool:
            conn.link.send(Bye("client closing"))
            conn.link.close(MissReason.PEER_GONE, "client closing")
        await asyncio.sleep(0)

