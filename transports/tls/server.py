"""TLS-TCP transport: the session protocol (`session.py`) over TLS 1.3 with mutual certificate checks.
This module is the server; client.py the client.

    client                                         server
    ──────                                         ──────
    TCP connect + TLS 1.3 handshake (connect_timeout_s); both present node certificates of the
    cluster CA; the client checks that the server's SAN names the dialled node; the server
    refuses a node's connection beyond `max_connections_per_peer` (ERROR overloaded)
    ClientSession.hello/submit  ─── HELLO, PULL… ──►  ServerSession: HELLO rules, in-flight window
                                ◄── HELLO, BLOCK/MISS…END ──  one answer pump per connection

This module only moves bytes and runs timers: every protocol rule (HELLO, request ids, the
in-flight window, the total frame deadline, idle and send timeouts, what an oversize or unreadable
block becomes) is the sessions'. Frames move over `link.TlsLink` (decryption into payload
buffers, payloads queued as views and copied once, record by record, on their way to AES-GCM); RDMA
reuses both connection classes over its own link.

Server: one pump per connection answers its pulls round-robin, BATCH_BYTES at a time, fetching the
next batch only once under SERVER_WRITE_HIGH waits to be sent: a peer that does not read costs at most
SERVER_WRITE_HIGH + BATCH_BYTES per connection, a node at most `max_connections_per_peer` connections.
The first batch of a PULL that finds nothing waiting to be sent is answered in the read callback that
received it, when store reads run on the loop and no egress cap is set: a get from RAM waits for no
loop turn, and the pump only starts for what is left. One batch per connection and loop turn is
answered so: a read that brings many PULLs leaves the rest to the pump, turn by turn.
PULLs and payload bytes per second are budgeted per node (`budget`): a PULL over them is answered
ERROR overloaded and the connection is not read until the budget admits a PULL again.
Store reads: on the loop while fast, in a thread pool after slow ones (`serving.fetch`).
Client (client.py): one pooled connection per peer, PULL_WINDOW PULLs of a pull in flight;
digests checked on the loop; reading pauses while over RESULTS_HIGH bytes of results wait for callers.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import ssl
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Self

from fabric import config as defaults
from fabric.config import TransportConfig
from fabric.keys import BlockAddress
from transports.core.base import BlockSource
from transports.core.budget import PeerBudgets, PeerRates, peer_rates
from transports.core.codec import (
    DEFAULT_MAX_PAYLOAD,
    Bye,
    Error,
    ErrorCode,
    Frame,
    FrameDecoder,
    MissReason,
    ProtocolError,
)
from transports.core.link import FrameLink
from transports.core.metrics import TransportMetrics
from transports.core.serving import (
    BATCH_BYTES,
    EgressPacer,
    ServingServer,
    payload_bytes,
)
from transports.core.session import Fetched, ServerSession
from transports.core.timer import DeadlineTimer
from transports.tls.channel import TlsChannel
from transports.tls.handshake import accept_tls, auth_failure_reason, peer_node, peer_tenants
from transports.tls.link import TRANSPORT, TlsLink
from transports.trust.certs import CertificateError, NodeCredentials

logger = logging.getLogger(__name__)

SERVER_WRITE_HIGH = 2 * 1024 * 1024   # the next batch is fetched only once less than this waits to be sent
SERVER_READ_SIZE = 64 * 1024   # a server's socket reads: it receives only PULLs, HELLO and BYE
REFUSE_LINGER_S = 1.0   # a refused peer gets this long to read ERROR overloaded and close

class ServerConnection:
    """Server side of one connection: its ServerSession, and a pump that answers the session's pulls."""

    link: FrameLink

    def __init__(self, server: TlsTcpServer, node: str, tenants: frozenset[str] = frozenset()) -> None:
        self.server = server
        self.node = node
        self._loop = asyncio.get_running_loop()
        self.session = ServerSession(server.node, node, self._loop.time(), max_payload=server.max_payload,
                                     max_inflight=server.max_inflight, frame_timeout_s=server.frame_timeout_s,
                                     idle_timeout_s=server.idle_timeout_s,
                                     require_namespace=server.require_pull_namespace,
                                     authorise=server.authoriser(tenants))
        self.pump: asyncio.Task[None] | None = None
        # A batch was answered from the read path in this loop turn (`_answer_turn`): the next
        # one waits for the pump, so a flood of PULLs in one read cannot hold the loop.
        self._answered_in_turn = False
        self.throttled = False   # over its budget: not read until the budget admits PULLs again
        self.timer = DeadlineTimer(self._expire)

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
                if not server.admit_pull(self.node, now):
                    if not refused:
                        out, refused = list(out), True
                    out += session.refuse(pull.request_id, now, f"{self.node} is over its PULL budget")
            pulls = session.take_pulls()
        if refused and not self.throttled:
            self.throttled = True
            self._loop.call_later(server.throttle_s(self.node, now), self._unthrottle)
        link.send_many(out)
        self.server.peak_inflight = max(self.server.peak_inflight, len(session.active))
        if session.closing:
            self._close_session()
        elif session.reading and not self.throttled:
            link.resume_reading()
        else:
            link.pause_reading()
        if self.pump is None and session.answering and not link.closed:
            if self._answers_now():
                self._answer_turn()   # its own _carry_out starts the pump if more is left
            else:
                self.pump = self._loop.create_task(self._pump())
        self.timer.at_most(session.next_deadline(self._blocked_since()))

    def _answers_now(self) -> bool:
        """May the next batch be answered right here, not by the pump a loop turn later? Once per
        loop turn (what follows, and what a batch leaves, is the pump's), and only with nothing
        waiting to be sent, no egress cap, and reads from the store that run on the loop."""
        server = self.server
        return (not self._answered_in_turn and not self.link.write_pending and server.pacer is None
                and server.fetches_inline(self._loop.time()))

    def _answer_turn(self) -> None:
        """Answer the session's next batch now, from a store read on the loop."""
        server, session = self.server, self.session
        turn = session.next_batch()
        if turn is None:
            return
        rid, rest = turn
        self._answered_in_turn = True   # before the answer: its own _carry_out must not answer again
        self._send_answer(rid, rest, server.fetch_inline(rest, BATCH_BYTES))
        self._loop.call_soon(self._turn_over)

    def _turn_over(self) -> None:
        self._answered_in_turn = False

    def _send_answer(self, rid: int, rest: Sequence[BlockAddress], fetched: list[Fetched],
                     pumping: bool = False) -> None:
        """Answer the start of `rest` (what is left of pull `rid`) with what the store gave. Its
        frames go to the link first (the peer's wait ends soonest); the bookkeeping follows, in
        this same callback. `pumping`: from the pump, which goes on answering. Where the answer
        left the session settled, only its frames go out here; what was served is counted (and
        charged to the peer's budget) and the send timer set by `_settle`, before the pump waits
        or ends: no read, admission or timer of any connection can run before that."""
        session, now = self.session, self._loop.time()
        self.link.send_many(session.answer(rid, rest[:len(fetched)], fetched, now))
        if pumping and session.settled:
            return
        self.server.count_served(session, now)
        self._carry_out([])

    def _settle(self) -> None:
        """What the pump answered since it last waited: counted and charged; the send timer set."""
        self.server.count_served(self.session, self._loop.time())
        if not self.link.closed:
            self.timer.at_most(self.session.next_deadline(self._blocked_since()))

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
            while not link.closed and session.answering:
                if link.backlogged:   # the pump waits: what it answered is settled first
                    self._settle()
                    await link.drain()
                    if link.closed:
                        break
                turn = session.next_batch()
                if turn is None:
                    break
                rid, rest = turn
                batch = BATCH_BYTES if server.pacer is None else server.pacer.batch_bytes(BATCH_BYTES)
                if server.fetches_inline(self._loop.time()):
                    fetched = server.fetch_inline(rest, batch)
                else:
                    self._settle()
                    fetched = await server.fetch_in_pool(rest, batch)
                if link.closed or rid not in session.active:
                    break
                self._send_answer(rid, rest, fetched, pumping=True)
                if server.pacer is not None:   # a capped egress: the next batch waits its turn
                    self._settle()
                    await asyncio.sleep(server.pacer.wait_s(payload_bytes(fetched), self._loop.time()))
        finally:
            self._settle()
            self.pump = None

    def on_closed(self, reason: MissReason) -> None:
        self.timer.cancel()
        if self.pump is not None:
            self.pump.cancel()
        self.server._forget(self)

    def _blocked_since(self) -> float | None:
        link = self.link
        return link.last_tx if link.write_pending else None

    def _expire(self, now: float) -> float | None:
        """The session's timers (see DeadlineTimer): what is due is carried out."""
        if self.link.closed:
            return None
        session, blocked = self.session, self._blocked_since()
        deadline = session.next_deadline(blocked)
        if deadline is not None and now >= deadline:
            self._carry_out(session.handle_timer(now, blocked))   # re-arms the timer itself
            return None
        return deadline


class TlsTcpServer(ServingServer):
    """Answers PULLs from `source` over mutually authenticated TLS 1.3 on (host, port)."""

    transport = TRANSPORT  # the metrics label

    def __init__(self, credentials: NodeCredentials, source: BlockSource, host: str = "127.0.0.1", port: int = 0,
                 *, max_payload: int = DEFAULT_MAX_PAYLOAD, max_inflight: int = defaults.MAX_INFLIGHT,
                 frame_timeout_s: float = defaults.FRAME_TIMEOUT_S, idle_timeout_s: float = defaults.IDLE_TIMEOUT_S,
                 handshake_timeout_s: float = defaults.CONNECT_TIMEOUT_S, io_threads: int = defaults.IO_THREADS,
                 max_connections_per_peer: int = defaults.MAX_CONNECTIONS_PER_PEER, peer_rates: PeerRates | None = None,
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
        self._connections: set[ServerConnection] = set()
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
            if not self.admit_handshake(str(addr[0]), loop.time()):   # the node's fair share (budget.py)
                raw.close()
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
            node, tenants = peer_node(sock), peer_tenants(sock)
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
        conn = ServerConnection(self, node, tenants)
        try:
            conn.attach(await self.open_link(sock, conn))
        except (OSError, TimeoutError, ProtocolError) as e:
            logger.warning("could not set up a %s link with %s (%s): %s", self.transport, node, where, e)
            sock.close()
            return
        self._connections.add(conn)
        metrics.connections.labels(self.transport, "server").inc()
        conn.link.start()
        conn.timer.at_most(conn.session.next_deadline())
        logger.debug("accepted %s from %s", node, where)

    async def _refuse(self, sock: TlsChannel, why: str) -> None:
        """Tell a peer ERROR overloaded, then close once it has closed (or after REFUSE_LINGER_S);
        what it sends meanwhile is read and dropped, so that closing sends no reset that could
        destroy the ERROR before the peer reads it."""
        closed = asyncio.Event()
        link = TlsLink(sock, FrameDecoder(max_payload=0), lambda frames: None, lambda reason: closed.set(),
                       self.frame_timeout_s, self.metrics, self.transport, read_size=SERVER_READ_SIZE)
        link.start()
        link.send(Error(0, ErrorCode.OVERLOADED, why))
        try:
            with contextlib.suppress(TimeoutError):   # a peer that does not close is closed after the linger
                async with asyncio.timeout(REFUSE_LINGER_S):
                    await closed.wait()
        finally:
            link.close(MissReason.PEER_GONE, why)

    async def open_link(self, sock: TlsChannel, conn: ServerConnection) -> FrameLink:
        """The frame link of an authenticated connection (RDMA overrides this)."""
        return TlsLink(sock, conn.session.decoder, conn.on_frames, conn.on_closed, self.frame_timeout_s,
                       self.metrics, self.transport, self.max_payload, write_high=SERVER_WRITE_HIGH,
                       read_size=SERVER_READ_SIZE)

    def _forget(self, conn: ServerConnection) -> None:
        if conn in self._connections:
            self._connections.discard(conn)
            self.metrics.connections.labels(self.transport, "server").dec()

    async def close(self) -> None:
        """Stop accepting, say BYE to every client, and wait for block reads in flight to finish
        (so the source may be closed after this returns)."""
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
