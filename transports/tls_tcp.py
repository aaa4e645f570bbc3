"""TLS-TCP transport: the session protocol (`session.py`) over TLS 1.3 with mutual certificate checks.

    client                                         server
    ──────                                         ──────
    TCP connect + TLS 1.3 handshake (connect_timeout_s); both present node certificates of the
    cluster CA; the client checks that the server's SAN names the dialled node; the server
    refuses a node's connection beyond `max_connections_per_peer` (ERROR overloaded)
    ClientSession.hello/submit  ─── HELLO, PULL… ──►  ServerSession: HELLO rules, in-flight window
                                ◄── HELLO, BLOCK/MISS…END ──  one answer pump per connection

This module only moves bytes and runs timers: every protocol rule (HELLO, request ids, the
in-flight window, the total frame deadline, idle and send timeouts, what an oversize or unreadable
block becomes) is the sessions'. Frames move over `tls_link.TlsLink` (decryption into payload
buffers, payloads sent without copies); RDMA reuses both connection classes over its own link.

Server: one pump per connection answers its pulls round-robin, BATCH_BYTES at a time, fetching the
next batch only once under SERVER_WRITE_HIGH waits to be sent: a peer that does not read costs at most
SERVER_WRITE_HIGH + BATCH_BYTES per connection, a node at most `max_connections_per_peer` connections.
PULLs and payload bytes per second are budgeted per node (`budget`): a PULL over them is answered
ERROR overloaded and the connection is not read until the budget admits a PULL again.
Store reads: on the loop while fast, in a thread pool after slow ones (`serving.fetch`).
Client: one pooled connection per peer, PULL_WINDOW PULLs of a pull in flight; digests checked on the
loop; reading pauses while over RESULTS_HIGH bytes of results wait for their callers.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import ssl
from collections import deque
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Self

from fabric.config import TransportConfig
from fabric.keys import BlockAddress
from transports.base import BlockSource, Hit, Peer, PullResult
from transports.budget import PeerBudgets, PeerRates, peer_rates
from transports.buffers import tune_allocator, uninitialised_bytearray
from transports.certs import CertificateError, NodeCredentials
from transports.codec import (
    DEFAULT_MAX_PAYLOAD,
    Bye,
    Error,
    ErrorCode,
    Frame,
    FrameDecoder,
    Miss,
    MissReason,
    ProtocolError,
    Pull,
)
from transports.metrics import TransportMetrics
from transports.serving import (
    BATCH_BYTES,
    INLINE_FETCH_S,
    EgressPacer,
    ServingServer,
    Watchdog,
    fetch,
    payload_bytes,
    watchdog_interval,
)
from transports.session import MAX_ADDRESSES_PER_PULL, ClientSession, ServerSession
from transports.tls_link import (
    FrameLink,
    TlsLink,
    accept_tls,
    auth_failure_reason,
    open_tls,
    peer_node,
)

logger = logging.getLogger(__name__)

TRANSPORT = "tls-tcp"
ADDRESSES_PER_PULL = MAX_ADDRESSES_PER_PULL
PULL_WINDOW = 2   # the server answers a connection's PULLs round-robin: 2 in flight keep a pull in order
SERVER_WRITE_HIGH = 2 * 1024 * 1024   # the next batch is fetched only once less than this waits to be sent
RESULTS_HIGH = 64 * 1024 * 1024
REFUSE_LINGER_S = 1.0   # a refused peer gets this long to read ERROR overloaded and close

class _ServerConnection:
    """Server side of one connection: its ServerSession, and a pump that answers the session's pulls."""

    link: FrameLink

    def __init__(self, server: TlsTcpServer, node: str) -> None:
        self.server = server
        self.node = node
        self._loop = asyncio.get_running_loop()
        self.session = ServerSession(server.node, node, self._loop.time(), max_payload=server.max_payload,
                                     max_inflight=server.max_inflight, frame_timeout_s=server.frame_timeout_s,
                                     idle_timeout_s=server.idle_timeout_s)
        self.cursors: deque[tuple[Pull, int]] = deque()   # active pulls and how far they are answered
        self.pump: asyncio.Task[None] | None = None
        self.throttled = False   # over its budget: not read until the budget admits PULLs again

    def attach(self, link: FrameLink) -> None:
        self.link = link

    def on_frames(self, frames: list[Frame]) -> None:
        self._carry_out(self.session.receive_frames(frames, self._loop.time()))

    def _carry_out(self, out: list[Frame]) -> None:
        """Send what the session returned, start its pulls, and follow its reading / closing state."""
        session, link, server = self.session, self.link, self.server
        now = self._loop.time()
        pulls = session.take_pulls()
        refused = False
        while pulls:   # a refusal frees a slot: a queued PULL may start at once
            for pull in pulls:
                if server.admit_pull(self.node, now):
                    self.cursors.append((pull, 0))
                else:
                    if not refused:
                        out, refused = list(out), True
                    out += session.refuse(pull.request_id, now, f"{self.node} is over its PULL budget")
            pulls = session.take_pulls()
        if refused and not self.throttled:
            self.throttled = True
            self._loop.call_later(server.throttle_s(self.node, now), self._unthrottle)
        link.send_many(out)
        self.server.peak_inflight = max(self.server.peak_inflight, len(session.active))
        if self.cursors and self.pump is None and not session.closing:
            self.pump = self._loop.create_task(self._pump())
        if session.closing:
            self._close_session()
        elif session.reading and not self.throttled:
            link.resume_reading()
        else:
            link.pause_reading()

    def _unthrottle(self) -> None:
        self.throttled = False
        if not self.link.closed and self.session.reading:
            self.link.resume_reading()

    def _close_session(self) -> None:
        session, metrics, transport = self.session, self.server.metrics, self.server.transport
        if session.error is not None:
            if session.error.code is ErrorCode.UNAUTHORIZED:
                metrics.auth_failures.labels(transport, "hello_mismatch").inc()
            elif session.error.code is ErrorCode.PROTOCOL:
                metrics.protocol_errors.labels(transport).inc()
            logger.warning("closing %s connection of %s: %s", transport, self.node, session.error)
        self.link.close_after_flush(session.close_reason, str(session.error or "session ended"), timeout_s=0.2)

    async def _pump(self) -> None:
        server, session, link = self.server, self.session, self.link
        try:
            while self.cursors and not link.closed and not session.closing:
                await link.drain()
                if link.closed or not self.cursors:
                    break
                pull, start = self.cursors.popleft()
                rest = pull.addresses[start:]
                # RAM-resident blocks are read on the loop; after SLOW_STREAK slow reads in a row
                # (disk, not a one-off preemption) reading moves to the pool for SLOW_SOURCE_HOLD_S.
                batch = BATCH_BYTES if server.pacer is None else server.pacer.batch_bytes(BATCH_BYTES)
                if server.executor is None or self._loop.time() >= server.slow_until:
                    fetched, slow = fetch(server.source, rest, batch, INLINE_FETCH_S)
                    server.note_fetch(slow, self._loop.time())
                else:
                    fetched, _ = await self._loop.run_in_executor(server.executor, fetch, server.source, rest, batch)
                if link.closed or pull.request_id not in session.active:
                    break
                now = self._loop.time()
                out = session.answer(pull.request_id, rest[:len(fetched)], fetched)
                if start + len(fetched) < len(pull.addresses):
                    self.cursors.append((pull, start + len(fetched)))
                else:
                    out += session.finish(pull.request_id, now)
                server.count_served(session, now)
                self._carry_out(out)
                if server.pacer is not None:   # a capped egress: the next batch waits its turn
                    await asyncio.sleep(server.pacer.wait_s(payload_bytes(fetched), self._loop.time()))
        finally:
            self.pump = None

    def on_closed(self, reason: MissReason) -> None:
        if self.pump is not None:
            self.pump.cancel()
        self.cursors.clear()
        self.server._forget(self)

    def watchdog(self, now: float) -> None:
        link, session = self.link, self.session
        blocked = link.last_tx if link.write_pending else None
        deadline = session.next_deadline(blocked)
        if deadline is not None and now >= deadline and not link.closed:
            self._carry_out(session.handle_timer(now, blocked))


class TlsTcpServer(ServingServer):
    """Answers PULLs from `source` over mutually authenticated TLS 1.3 on (host, port)."""

    transport = TRANSPORT  # the metrics label

    def __init__(self, credentials: NodeCredentials, source: BlockSource, host: str = "127.0.0.1", port: int = 0,
                 *, max_payload: int = DEFAULT_MAX_PAYLOAD, max_inflight: int = 32, frame_timeout_s: float = 10.0,
                 idle_timeout_s: float = 30.0, handshake_timeout_s: float = 5.0, io_threads: int = 4,
                 max_connections_per_peer: int = 8, peer_rates: PeerRates | None = None,
                 metrics: TransportMetrics | None = None, send_rate: float = 0.0) -> None:
        """`io_threads`: threads for slow (disk) fetches; 0 always fetches on the event loop;
        `max_connections_per_peer` and `peer_rates`: what one peer node may cost (see `budget`);
        `send_rate`: bytes/s this server sends at most, over all connections (0: no cap)."""
        self.credentials = credentials
        self.node = credentials.node
        self.source = source
        self.host, self.port = host, port
        self.max_payload = max_payload
        self.max_inflight = max_inflight
        self.frame_timeout_s = frame_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self.max_connections_per_peer = max_connections_per_peer
        self.budgets = PeerBudgets(peer_rates)
        self.pacer = EgressPacer(send_rate) if send_rate > 0 else None
        self.metrics = metrics or TransportMetrics()
        self.executor = ThreadPoolExecutor(io_threads, thread_name_prefix="kvfabric-tls-io") if io_threads else None
        self.peak_inflight = 0
        self.num_accept_errors = 0
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._watchdog: Watchdog | None = None
        self._connections: set[_ServerConnection] = set()
        self._handshakes: set[asyncio.Task[None]] = set()

    @classmethod
    def from_config(cls, config: TransportConfig, credentials: NodeCredentials, source: BlockSource,
                    metrics: TransportMetrics | None = None) -> Self:
        return cls(credentials, source, config.host, config.tcp_port, max_payload=config.max_payload_bytes,
                   max_inflight=config.max_inflight, frame_timeout_s=config.frame_timeout_s,
                   idle_timeout_s=config.idle_timeout_s, handshake_timeout_s=config.connect_timeout_s,
                   max_connections_per_peer=config.max_connections_per_peer, peer_rates=peer_rates(config),
                   metrics=metrics, send_rate=config.send_rate_mb_s * 1e6)

    @property
    def num_connections(self) -> int:
        return len(self._connections)

    async def start(self) -> tuple[str, int]:
        infos = await asyncio.get_running_loop().getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        family, _, _, _, addr = infos[0]
        lsock = socket.socket(family, socket.SOCK_STREAM)
        try:
            lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            lsock.bind(addr)
            lsock.listen(128)
            lsock.setblocking(False)
        except OSError:
            lsock.close()
            raise
        self._listener = lsock
        self.host, self.port = lsock.getsockname()[:2]
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop(lsock))
        self._watchdog = Watchdog(watchdog_interval(self.frame_timeout_s, self.idle_timeout_s),
                                   lambda: list(self._connections))
        logger.info("TLS-TCP server %s listening on %s:%d", self.node, self.host, self.port)
        return self.host, self.port

    async def _accept_loop(self, lsock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while self._listener is lsock:
            try:
                raw, addr = await self._accept(lsock)
            except OSError as e:  # EMFILE, ECONNABORTED, …: this connection is lost, the server is not
                self.num_accept_errors += 1
                logger.error("accepting a connection failed (%s); accepting goes on", e)
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    await asyncio.sleep(0.1)
                continue
            except Exception:  # MemoryError, a bug: never let the listener die silently
                self.num_accept_errors += 1
                logger.exception("accepting a connection failed unexpectedly; accepting goes on")
                await asyncio.sleep(0.1)   # whatever it was, do not spin on it
                continue
            task = loop.create_task(self._handshake(raw, f"{addr[0]}:{addr[1]}"))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    async def _accept(self, lsock: socket.socket) -> tuple[socket.socket, tuple[str, int]]:
        raw, addr = await asyncio.get_running_loop().sock_accept(lsock)
        return raw, addr

    async def _handshake(self, raw: socket.socket, where: str) -> None:
        metrics = self.metrics
        try:
            sock = await accept_tls(raw, self.credentials, self.handshake_timeout_s)
        except ssl.SSLError as e:
            reason = auth_failure_reason(e)
            metrics.auth_failures.labels(self.transport, reason).inc()
            logger.warning("refused TLS client %s (%s): %s", where, reason, e)
            return
        except (OSError, TimeoutError) as e:
            metrics.auth_failures.labels(self.transport, "handshake").inc()
            logger.info("TLS handshake with %s failed: %s", where, e)
            raw.close()
            return
        try:
            node = peer_node(sock)
        except CertificateError as e:  # a chain from the cluster CA, but no node certificate
            metrics.auth_failures.labels(self.transport, "bad_certificate").inc()
            logger.warning("refused TLS client %s: %s", where, e)
            sock.close()
            return
        if sum(1 for c in self._connections if c.node == node) >= self.max_connections_per_peer:
            metrics.auth_failures.labels(self.transport, "too_many_connections").inc()
            self.count_overloaded(node, "connections")
            logger.warning("refused %s from %s: already %d connections", node, where, self.max_connections_per_peer)
            await self._refuse(sock, f"{node} already has {self.max_connections_per_peer} connections")
            return
        conn = _ServerConnection(self, node)
        try:
            conn.attach(await self._open_link(sock, conn))
        except (OSError, TimeoutError, ProtocolError) as e:
            logger.warning("could not set up a %s link with %s (%s): %s", self.transport, node, where, e)
            sock.close()
            return
        self._connections.add(conn)
        metrics.connections.labels(self.transport, "server").inc()
        conn.link.start()
        logger.debug("accepted %s from %s", node, where)

    async def _refuse(self, sock: ssl.SSLSocket, why: str) -> None:
        """Tell a peer ERROR overloaded, then close once it has closed (or after REFUSE_LINGER_S);
        what it sends meanwhile is read and dropped, so that closing sends no reset that could
        destroy the ERROR before the peer reads it."""
        closed = asyncio.Event()
        link = TlsLink(sock, FrameDecoder(max_payload=0), lambda frames: None, lambda reason: closed.set(),
                       self.frame_timeout_s, self.metrics, self.transport)
        link.start()
        link.send(Error(0, ErrorCode.OVERLOADED, why))
        try:
            with contextlib.suppress(TimeoutError):   # a peer that does not close is closed after the linger
                async with asyncio.timeout(REFUSE_LINGER_S):
                    await closed.wait()
        finally:
            link.close(MissReason.PEER_GONE, why)

    async def _open_link(self, sock: ssl.SSLSocket, conn: _ServerConnection) -> FrameLink:
        """The frame link of an authenticated connection (RDMA overrides this)."""
        return TlsLink(sock, conn.session.decoder, conn.on_frames, conn.on_closed, self.frame_timeout_s,
                       self.metrics, self.transport, self.max_payload, write_high=SERVER_WRITE_HIGH)

    def _forget(self, conn: _ServerConnection) -> None:
        if conn in self._connections:
            self._connections.discard(conn)
            self.metrics.connections.labels(self.transport, "server").dec()

    async def close(self) -> None:
        """Stop accepting, say BYE to every client, and wait for block reads in flight to finish
        (so the source may be closed after this returns)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        listener, self._listener = self._listener, None
        tasks = [t for t in (self._accept_task, *self._handshakes) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if listener is not None:
            listener.close()
        pumps = [c.pump for c in self._connections if c.pump is not None]
        for conn in list(self._connections):
            conn.link.send(Bye("server shutting down"))
            conn.link.close(MissReason.PEER_GONE, "server shutting down")
        await asyncio.gather(*pumps, return_exceptions=True)
        if self.executor is not None:
            executor, self.executor = self.executor, None
            await asyncio.to_thread(executor.shutdown, wait=True, cancel_futures=True)


class _Request:
    """One PULL's results awaiting its caller."""

    __slots__ = ("abandoned", "finished", "request_id", "results", "touched", "waiting", "wakeup")

    def __init__(self, request_id: int) -> None:
        self.request_id = request_id
        self.results: deque[PullResult] = deque()
        self.wakeup = asyncio.Event()
        self.finished = False
        self.abandoned = False
        self.touched = False    # a frame of this request arrived
        self.waiting = False    # its caller waits for results


class _ClientConnection:
    """Client side of one connection: its ClientSession, and results handed to their callers."""

    link: FrameLink

    def __init__(self, client: TlsTcpClient, peer: Peer) -> None:
        self.client = client
        self.peer = peer
        self._loop = asyncio.get_running_loop()
        # Payload buffers are not zero-filled: decryption overwrites every byte (tls_link).
        decoder = FrameDecoder(max_payload=client.max_payload, payload_allocator=uninitialised_bytearray)
        self.session = ClientSession(client.node, peer.node, self._loop.time(), max_payload=client.max_payload,
                                     frame_timeout_s=client.frame_timeout_s, idle_timeout_s=client.idle_timeout_s,
                                     decoder=decoder)
        self.requests: dict[int, _Request] = {}
        self.buffered = 0
        self.paused = False   # reading paused: over RESULTS_HIGH bytes of results wait for callers

    def attach(self, link: FrameLink) -> None:
        self.link = link

    def submit(self, addresses: Sequence[BlockAddress], into: memoryview | None = None) -> _Request:
        if self.link.closed or self.session.closing:
            req = _Request(0)
            req.results.extend(Miss(0, a, MissReason.PEER_GONE) for a in addresses)
            req.finished = True
            return req
        rid, frames = self.session.submit(addresses, self._loop.time(), into)
        req = self.requests[rid] = _Request(rid)
        for frame in frames:
            self.link.send(frame)
        return req

    def abandon(self, req: _Request) -> None:
        """The caller stopped iterating: drop further results (the frames are still read)."""
        req.abandoned = True
        self.session.cancel(req.request_id)
        self.requests.pop(req.request_id, None)
        self.consumed(sum(len(r.payload) for r in req.results if isinstance(r, Hit)))
        req.results.clear()

    def consumed(self, nbytes: int, *, starving: bool = False) -> None:
        """`starving`: a caller waits with nothing to read: resume even over RESULTS_HIGH (else deadlock)."""
        self.buffered -= nbytes
        if self.paused and (starving or self.buffered <= RESULTS_HIGH // 2) and not self.link.closed:
            self.paused = False
            self.session.resume(self._loop.time())
            self.link.resume_reading()

    def on_frames(self, frames: list[Frame]) -> None:
        self._deliver(self.session.receive_frames(frames, self._loop.time()))

    def _deliver(self, out: list[tuple[int, list[PullResult], bool]], arrived: bool = True) -> None:
        """Hand results to their requests; `arrived`: they come from frames, not a lost connection."""
        hits = num_bytes = 0
        metrics, transport = self.client.metrics, self.client.transport
        for rid, results, done in out:
            req = self.requests.get(rid)
            for r in results:
                if isinstance(r, Hit):
                    hits += 1
                    num_bytes += len(r.payload)
                else:
                    metrics.child(metrics.pulls, transport, r.reason.value).inc()
            if req is None:
                continue
            # Answered: a frame of its own arrived (a BYE read after the PULL went out is not one).
            if not req.touched and arrived:
                req.touched = any(isinstance(r, Hit) or r.reason is not MissReason.PEER_GONE for r in results)
            req.results.extend(results)
            if done:
                req.finished = True
                del self.requests[rid]
            req.wakeup.set()
        if hits:
            metrics.child(metrics.pulls, transport, "hit").inc(hits)
            metrics.child(metrics.pull_bytes, transport).inc(num_bytes)
            self.buffered += num_bytes
            if self.buffered > RESULTS_HIGH and not any(r.waiting and not r.results for r in self.requests.values()):
                self.paused = True
                self.session.pause(self._loop.time())
                self.link.pause_reading()
        if self.session.closing:
            self.client._forget(self)
            if self.session.error is not None:
                self.client.metrics.protocol_errors.labels(transport).inc()
                logger.warning("closing %s connection to %s: %s", transport, self.peer.node, self.session.error)
            self.link.close(self.session.close_reason, str(self.session.error or "closed"))

    def on_closed(self, reason: MissReason) -> None:
        self.client._forget(self)
        self._deliver(self.session.connection_lost(reason), arrived=False)

    def watchdog(self, now: float) -> None:
        deadline = self.session.next_deadline()
        if deadline is None or now < deadline or self.link.closed:
            return
        frames, results = self.session.handle_timer(now)
        if self.session.closing:
            self.client._forget(self)   # before BYE, so that no new pull picks this connection
        for frame in frames:
            self.link.send(frame)
        self._deliver(results)
        if self.session.closing:
            self.link.close_after_flush(self.session.close_reason, "idle" if frames else "server stalled")


class TlsTcpClient:
    """Pulls blocks from peers over TLS-TCP; one pooled connection per peer, many pulls in flight on it."""

    transport = TRANSPORT  # the metrics label

    def __init__(self, credentials: NodeCredentials, *, max_payload: int = DEFAULT_MAX_PAYLOAD,
                 connect_timeout_s: float = 5.0, frame_timeout_s: float = 10.0, idle_timeout_s: float = 30.0,
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
        self._pool: dict[Peer, _ClientConnection] = {}
        self._dialing: dict[Peer, asyncio.Lock] = {}
        self._watchdog: Watchdog | None = None
        self.num_connects = 0

    @classmethod
    def from_config(cls, config: TransportConfig, credentials: NodeCredentials,
                    metrics: TransportMetrics | None = None) -> Self:
        return cls(credentials, max_payload=config.max_payload_bytes, connect_timeout_s=config.connect_timeout_s,
                   frame_timeout_s=config.frame_timeout_s, idle_timeout_s=config.idle_timeout_s, metrics=metrics)

    async def pull(self, peer: Peer, addresses: Sequence[BlockAddress], *,
                   into: memoryview | None = None) -> AsyncIterator[PullResult]:
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
        for attempt in range(2):
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
            requests = [conn.submit(chunks[i], regions[i]) for i in range(min(PULL_WINDOW, len(chunks)))]
            retry = False
            try:
                for i in range(len(chunks)):
                    req = requests[i]
                    results = req.results
                    while True:
                        while results:
                            r = results.popleft()
                            if isinstance(r, Hit):
                                conn.buffered -= len(r.payload)   # out of the window; `consumed` resumes below
                            elif (i == 0 and attempt == 0 and reused and not req.touched
                                  and r.reason is MissReason.PEER_GONE):
                                retry = True  # the pooled connection was gone before answering anything
                                break
                            yield r
                        conn.consumed(0)
                        if retry or (req.finished and not results):
                            break
                        req.wakeup.clear()
                        req.waiting = True
                        conn.consumed(0, starving=True)
                        await req.wakeup.wait()
                        req.waiting = False
                    if retry:
                        break
                    if i + PULL_WINDOW < len(chunks):
                        requests.append(conn.submit(chunks[i + PULL_WINDOW], regions[i + PULL_WINDOW]))
            finally:
                for req in requests:
                    conn.abandon(req)
            if not retry:
                return
            logger.info("pooled connection to %s was gone; pulling again on a new one", peer.node)

    async def _connection(self, peer: Peer) -> tuple[_ClientConnection | None, MissReason, bool]:
        """(the pooled or a new connection, None and the miss reason when none can be had, whether
        the connection was reused from the pool)."""
        conn = self._pool.get(peer)
        if conn is not None and not conn.link.closed:
            return conn, MissReason.PEER_GONE, True
        lock = self._dialing.setdefault(peer, asyncio.Lock())
        try:
            async with lock:
                return await self._dial(peer)
        finally:
            if not lock.locked() and self._dialing.get(peer) is lock:
                del self._dialing[peer]   # no dial of this peer waits: forget its lock

    async def _dial(self, peer: Peer) -> tuple[_ClientConnection | None, MissReason, bool]:
        conn = self._pool.get(peer)
        if conn is not None and not conn.link.closed:
            return conn, MissReason.PEER_GONE, True
        try:
            sock = await open_tls(peer, self.credentials, self.connect_timeout_s)
        except ssl.SSLError as e:
            reason = auth_failure_reason(e)
            self.metrics.auth_failures.labels(self.transport, f"server_{reason}").inc()
            logger.warning("refusing server %s at %s:%d (%s): %s", peer.node, peer.host, peer.port, reason, e)
            return None, MissReason.PEER_ERROR, False
        except (OSError, TimeoutError) as e:
            logger.info("cannot reach %s at %s:%d: %s", peer.node, peer.host, peer.port, e)
            return None, MissReason.TIMEOUT if isinstance(e, TimeoutError) else MissReason.PEER_GONE, False
        conn = _ClientConnection(self, peer)
        try:
            conn.attach(await self._open_link(peer, sock, conn))
        except (OSError, TimeoutError, ProtocolError) as e:
            logger.warning("could not set up a %s link with %s: %s", self.transport, peer.node, e)
            sock.close()
            return None, MissReason.PEER_ERROR, False
        self._pool[peer] = conn
        self.num_connects += 1
        self.metrics.connections.labels(self.transport, "client").inc()
        conn.link.start()
        for frame in conn.session.hello():
            conn.link.send(frame)
        if self._watchdog is None:
            self._watchdog = Watchdog(watchdog_interval(self.frame_timeout_s, self.idle_timeout_s),
                                       lambda: list(self._pool.values()))
        return conn, MissReason.PEER_GONE, False

    async def _open_link(self, peer: Peer, sock: ssl.SSLSocket, conn: _ClientConnection) -> FrameLink:
        """The frame link of an authenticated connection (RDMA overrides this)."""
        return TlsLink(sock, conn.session.decoder, conn.on_frames, conn.on_closed,
                       self.frame_timeout_s, self.metrics, self.transport, batch_frames=True)

    def _forget(self, conn: _ClientConnection) -> None:
        if self._pool.get(conn.peer) is conn:
            del self._pool[conn.peer]
            self.metrics.connections.labels(self.transport, "client").dec()

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        for conn in list(self._pool.values()):
            conn.link.send(Bye("client closing"))
            conn.link.close(MissReason.PEER_GONE, "client closing")
        await asyncio.sleep(0)

