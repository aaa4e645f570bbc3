"""TLS-TCP transport: the kvfabric codec over TLS 1.3 with mutual certificate checks.

    client                                         server
    ──────                                         ──────
    TCP connect + TLS 1.3 handshake (connect_timeout_s); both present node certificates of the
    cluster CA; the client checks that the server's SAN names the dialled node
    HELLO(node, max_payload)  ───────────────►     certificate SAN == HELLO.node, else ERROR
    PULL(rid=1) PULL(rid=2) … ───────────────►     ≤ max_inflight answered at once; more: stop reading
                              ◄───────────────     HELLO, then BLOCK/MISS…END per rid, interleaved

Frames move over `tls_link.TlsLink` (decryption straight into payload buffers, payloads sent
without copies). The client keeps one pooled connection per peer, reconnects when it is gone,
and matches frames to requests by request id; every payload's BLAKE3 digest is checked on the
event loop, once per read callback's batch of frames, in arrival order (so per request order
holds); a verifier thread that hashes while the loop decrypts is an option (`verify_in_thread`).
The server answers from `BlockSource.get_block` on the event loop while blocks come fast (RAM: a
thread hop would cost more than the fetch); after a fetch slower than INLINE_FETCH_S (disk;
SLOW_STREAK in a row) it fetches in a bounded thread pool, a batch of up to BATCH_BYTES per hop,
for a while. It never re-hashes: the source gives the digest. The event loop is thus blocked
by at most SLOW_STREAK slow reads per SLOW_SOURCE_HOLD_S.

Limits per connection:
  * server: the decoder accepts no payload (clients never send one) and headers ≤ 64 KiB;
    answers in hand ≤ max_inflight × (BATCH_BYTES + max_payload) plus a write queue drained to
    WRITE_HIGH before the next batch is fetched; PULLs beyond max_inflight wait unread in the
    socket (only those of the last read, ≤ 256 KiB of headers, are queued);
  * client: received payloads not yet taken by the caller (awaiting the verifier or the caller)
    ≤ RESULTS_HIGH + one read callback (READ_BUDGET); reading pauses above RESULTS_HIGH;
  * stalls: mid-frame, unanswered requests or an unwritable socket for `frame_timeout_s` close
    the connection and its requests end as `Miss(TIMEOUT)`; idle connections close after
    `idle_timeout_s` (the client's at half of it, so a new PULL rarely races the server's BYE;
    a pull whose pooled connection vanished before answering anything is retried once).
Every frame costs O(1) Python work besides its payload's one BLAKE3 hash on the client. The
client also raises glibc's malloc thresholds once per process (`tls_link.tune_allocator`): fresh
payload buffers otherwise page-fault in anew, a third of the client's CPU per byte; and payload
buffers are not zero-filled (`tls_link.uninitialised_bytearray`: decryption overwrites every byte).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import queue
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, Self

from fabric.config import TransportConfig
from fabric.keys import BlockAddress
from transports.base import BlockSource, Hit, Peer, PullResult
from transports.certs import CertificateError, NodeCredentials
from transports.codec import (
    DEFAULT_MAX_PAYLOAD,
    VERSION,
    Block,
    Bye,
    End,
    Error,
    ErrorCode,
    Frame,
    FrameDecoder,
    Hello,
    Miss,
    MissReason,
    ProtocolError,
    Pull,
)
from transports.metrics import TransportMetrics
from transports.session import PullTracker, answer_pull
from transports.tls_link import (
    FrameLink,
    TlsLink,
    accept_tls,
    auth_failure_reason,
    open_tls,
    peer_node,
    tune_allocator,
    uninitialised_bytearray,
)

logger = logging.getLogger(__name__)

TRANSPORT = "tls-tcp"
ADDRESSES_PER_PULL = 1024       # a PULL header of 1024 addresses is ~40 KiB, under the 64 KiB limit
BATCH_BYTES = 2 * 1024 * 1024   # the server fetches up to this many payload bytes per thread hop
INLINE_FETCH_S = 0.001          # a get_block slower than this on the loop counts as slow …
SLOW_STREAK = 3                 # … this many in a row send fetching to the thread pool …
SLOW_SOURCE_HOLD_S = 1.0        # … for this long
RESULTS_HIGH = 64 * 1024 * 1024


class _Watched(Protocol):
    def watchdog(self, now: float) -> None: ...


class _Watchdog:
    """Every `interval_s`, `conn.watchdog(now)` for each connection `connections()` lists (a copy:
    a watchdog may close its connection, which then leaves the collection)."""

    def __init__(self, interval_s: float, connections: Callable[[], list[_Watched]]) -> None:
        self._loop = asyncio.get_running_loop()
        self._interval_s = interval_s
        self._connections = connections
        self._handle = self._loop.call_later(interval_s, self._tick)

    def _tick(self) -> None:
        now = self._loop.time()
        for conn in self._connections():
            conn.watchdog(now)
        self._handle = self._loop.call_later(self._interval_s, self._tick)

    def cancel(self) -> None:
        self._handle.cancel()


def _watchdog_interval(frame_timeout_s: float, idle_timeout_s: float) -> float:
    return max(0.02, min(frame_timeout_s, idle_timeout_s) / 4)


# ---------------------------------------------------------------------------------------------
# Server


def _take_batch(answers: Iterator[Frame], budget: int,
                slow_s: float = float("inf")) -> tuple[list[Frame], bool, OSError | None]:
    """Advance the `answer_pull` generator until `budget` payload bytes or END. Stops early, and
    says so, after a fetch slower than `slow_s` (a block read from disk); a fetch that fails
    (OSError from the source) ends the batch with the frames taken before it."""
    out: list[Frame] = []
    while budget > 0:
        start = time.perf_counter()
        try:
            frame = next(answers)
        except OSError as e:
            return out, False, e
        out.append(frame)
        if isinstance(frame, End):
            break
        if time.perf_counter() - start > slow_s:
            return out, True, None
        if isinstance(frame, Block):
            budget -= memoryview(frame.payload).nbytes
    return out, False, None


class _ServerConnection:
    """Server side of one connection: HELLO check, then PULLs answered as concurrent tasks."""

    link: FrameLink

    def __init__(self, server: TlsTcpServer, node: str) -> None:
        self.server = server
        self.node = node
        self.client_max_payload = 0
        self.hello = False
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.queued: deque[Pull] = deque()
        self.idle_since = 0.0

    def attach(self, link: FrameLink) -> None:
        self.link = link
        self.idle_since = link.last_rx

    def on_frames(self, frames: list[Frame]) -> None:
        for frame in frames:
            if not self.hello:
                self._on_hello(frame)
            elif isinstance(frame, Pull):
                if frame.request_id in self.tasks or any(q.request_id == frame.request_id for q in self.queued):
                    raise ProtocolError(f"PULL reuses request id {frame.request_id} while it is in flight")
                if len(self.tasks) < self.server.max_inflight:
                    self._start(frame)
                else:  # back-pressure: stop reading until an answer finishes
                    self.queued.append(frame)
                    self.link.pause_reading()
            elif isinstance(frame, Bye | Error):
                logger.info("client %s ended the connection: %s", self.node, frame)
                for task in self.tasks.values():  # nobody is waiting for these answers any more
                    task.cancel()
                self.link.close_after_flush(MissReason.PEER_GONE, "client said goodbye")
                return
            else:
                raise ProtocolError(f"a client may not send {frame.TYPE.name} frames")

    def _on_hello(self, frame: Frame) -> None:
        if not isinstance(frame, Hello):
            raise ProtocolError(f"first frame must be HELLO, got {frame.TYPE.name}")
        if frame.version != VERSION:
            raise ProtocolError(f"client speaks codec version {frame.version}, this server {VERSION}")
        if frame.node != self.node:
            self.server.metrics.auth_failures.labels(self.server.transport, "hello_mismatch").inc()
            self.link.send(Error(0, ErrorCode.UNAUTHORIZED,
                                 f"HELLO names {frame.node!r} but the certificate names {self.node!r}"))
            self.link.close_after_flush(MissReason.PEER_ERROR, "HELLO does not match the certificate")
            return
        self.hello = True
        self.client_max_payload = min(frame.max_payload, self.server.max_payload)
        self.link.send(Hello(self.server.node, VERSION, self.server.max_payload))

    def _start(self, pull: Pull) -> None:
        task = asyncio.get_running_loop().create_task(self._answer(pull))
        self.tasks[pull.request_id] = task
        self.server.peak_inflight = max(self.server.peak_inflight, len(self.tasks))

    async def _answer(self, pull: Pull) -> None:
        server, link = self.server, self.link
        answers = answer_pull(server.source, pull)
        loop = asyncio.get_running_loop()
        try:
            done = False
            while not done and not link.closed:
                # RAM-resident blocks are fetched on the loop: a thread hop costs more than they do.
                # After SLOW_STREAK slow fetches in a row (disk, not a one-off preemption), fetching
                # moves to the pool for SLOW_SOURCE_HOLD_S.
                if server.executor is None or loop.time() >= server.slow_until:
                    batch, slow, failure = _take_batch(answers, BATCH_BYTES, INLINE_FETCH_S)
                    server.slow_streak = server.slow_streak + 1 if slow else 0
                    if server.slow_streak >= SLOW_STREAK and server.executor is not None:
                        server.slow_until = loop.time() + SLOW_SOURCE_HOLD_S
                        server.slow_streak = 0
                else:
                    batch, _, failure = await loop.run_in_executor(server.executor, _take_batch, answers,
                                                                   BATCH_BYTES)
                for frame in batch:
                    link.send(self._checked(frame))
                if failure is not None:  # the source could not read a block: the rest of the request fails
                    logger.error("block source failed answering request %d: %s", pull.request_id, failure)
                    link.send(Error(pull.request_id, ErrorCode.INTERNAL, f"block source failed: {failure}"))
                    break
                done = isinstance(batch[-1], End)
                await link.drain()
        except ProtocolError as e:
            link.protocol_error(e)
        except Exception:  # a bug behind the source: fail this request loudly, keep the connection
            logger.exception("answering request %d of %s failed", pull.request_id, self.node)
            link.send(Error(pull.request_id, ErrorCode.INTERNAL, "internal error"))
        finally:
            self.tasks.pop(pull.request_id, None)
            self.idle_since = loop.time()
            if self.queued and not link.closed:
                self._start(self.queued.popleft())
            if not self.queued:
                link.resume_reading()

    def _checked(self, frame: Frame) -> Frame:
        metrics, transport = self.server.metrics, self.server.transport
        if isinstance(frame, Block):
            size = memoryview(frame.payload).nbytes
            if size > self.client_max_payload:
                logger.warning("block %s of %d bytes exceeds the %d-byte limit; answered as a miss",
                               frame.address, size, self.client_max_payload)
                metrics.child(metrics.served, transport, "miss").inc()
                return Miss(frame.request_id, frame.address, MissReason.PEER_ERROR)
            metrics.child(metrics.served, transport, "hit").inc()
            metrics.child(metrics.served_bytes, transport).inc(size)
        elif isinstance(frame, Miss):
            metrics.child(metrics.served, transport, "miss").inc()
        return frame

    def on_closed(self, reason: MissReason) -> None:
        for task in self.tasks.values():
            task.cancel()
        self.queued.clear()
        self.server._forget(self)

    def watchdog(self, now: float) -> None:
        """Close a connection that stalls mid-frame, cannot send, or idles too long."""
        link = self.link
        stalled_rx = link.mid_frame and now - link.last_rx > link.frame_timeout_s
        stalled_tx = link.write_pending and now - link.last_tx > link.frame_timeout_s
        if stalled_rx or stalled_tx:
            logger.warning("client %s stalled for %.1f s (%s); closing", self.node, link.frame_timeout_s,
                           "mid-frame" if stalled_rx else "not reading")
            link.pause_reading()
            link.send(Error(0, ErrorCode.TIMEOUT, "stalled"))
            link.close_after_flush(MissReason.TIMEOUT, "stalled", timeout_s=0.2)
        elif not self.tasks and not link.mid_frame and now - max(link.last_rx, self.idle_since) > \
                self.server.idle_timeout_s:
            link.send(Bye("idle"))
            link.close_after_flush(MissReason.PEER_GONE, "idle")


class TlsTcpServer:
    """Answers PULLs from `source` over mutually authenticated TLS 1.3 on (host, port)."""

    transport = TRANSPORT  # the metrics label

    def __init__(self, credentials: NodeCredentials, source: BlockSource, host: str = "127.0.0.1", port: int = 0,
                 *, max_payload: int = DEFAULT_MAX_PAYLOAD, max_inflight: int = 32, frame_timeout_s: float = 10.0,
                 idle_timeout_s: float = 30.0, handshake_timeout_s: float = 5.0, io_threads: int = 4,
                 metrics: TransportMetrics | None = None) -> None:
        """`io_threads`: threads for slow (disk) fetches; 0 always fetches on the event loop."""
        self.credentials = credentials
        self.node = credentials.node
        self.source = source
        self.host, self.port = host, port
        self.max_payload = max_payload
        self.max_inflight = max_inflight
        self.frame_timeout_s = frame_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self.metrics = metrics or TransportMetrics()
        self.executor = ThreadPoolExecutor(io_threads, thread_name_prefix="kvfabric-tls-io") if io_threads else None
        self.peak_inflight = 0
        self.slow_until = 0.0   # loop time until which get_block runs in the thread pool
        self.slow_streak = 0
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._watchdog: _Watchdog | None = None
        self._connections: set[_ServerConnection] = set()
        self._handshakes: set[asyncio.Task[None]] = set()

    @classmethod
    def from_config(cls, config: TransportConfig, credentials: NodeCredentials, source: BlockSource,
                    metrics: TransportMetrics | None = None) -> Self:
        return cls(credentials, source, config.host, config.tcp_port, max_payload=config.max_payload_bytes,
                   max_inflight=config.max_inflight, frame_timeout_s=config.frame_timeout_s,
                   idle_timeout_s=config.idle_timeout_s, handshake_timeout_s=config.connect_timeout_s,
                   metrics=metrics)

    @property
    def num_connections(self) -> int:
        return len(self._connections)

    async def start(self) -> tuple[str, int]:
        infos = await asyncio.get_running_loop().getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        family, _, _, _, addr = infos[0]
        lsock = socket.socket(family, socket.SOCK_STREAM)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsock.bind(addr)
        lsock.listen(128)
        lsock.setblocking(False)
        self._listener = lsock
        self.host, self.port = lsock.getsockname()[:2]
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop(lsock))
        self._watchdog = _Watchdog(_watchdog_interval(self.frame_timeout_s, self.idle_timeout_s),
                                   lambda: list(self._connections))
        logger.info("TLS-TCP server %s listening on %s:%d", self.node, self.host, self.port)
        return self.host, self.port

    async def _accept_loop(self, lsock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                raw, addr = await loop.sock_accept(lsock)
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    logger.error("cannot accept connections: %s", e)
                    await asyncio.sleep(0.1)
                    continue
                raise
            task = loop.create_task(self._handshake(raw, f"{addr[0]}:{addr[1]}"))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

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

    async def _open_link(self, sock: ssl.SSLSocket, conn: _ServerConnection) -> FrameLink:
        """The frame link of an authenticated connection (RDMA overrides this)."""
        return TlsLink(sock, FrameDecoder(max_payload=0), conn.on_frames, conn.on_closed, self.frame_timeout_s,
                       self.metrics, self.transport, self.max_payload)

    def _forget(self, conn: _ServerConnection) -> None:
        if conn in self._connections:
            self._connections.discard(conn)
            self.metrics.connections.labels(self.transport, "server").dec()

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        tasks = [t for t in (self._accept_task, *self._handshakes) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for conn in list(self._connections):
            conn.link.send(Bye("server shutting down"))
            conn.link.close(MissReason.PEER_GONE, "server shutting down")
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------------------------------------
# Client


class _Verifier:
    """Runs jobs in submission order: inline on the event loop, or on one daemon thread when
    `threaded` (BLAKE3 releases the GIL, so a payload is hashed there while the loop decrypts the
    next one). Jobs hand their results back with `call_on_loop`."""

    def __init__(self, threaded: bool) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name="kvfabric-tls-verify", daemon=True)
            self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        if self._thread is None:
            job()
        else:
            self._jobs.put(job)

    def call_on_loop(self, loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: object) -> None:
        """Run `callback(*args)` on `loop` after the current callback (from the thread: through the
        loop's self-pipe, a system call; inline: a plain call_soon)."""
        if self._thread is None:
            loop.call_soon(callback, *args)
        else:
            loop.call_soon_threadsafe(callback, *args)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    async def close(self) -> None:
        """Finish the queued jobs, then stop the thread."""
        if self._thread is not None:
            self._jobs.put(None)
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
            self._thread = None


class _Request:
    """One PULL: its tracker (touched only by verifier jobs) and results awaiting the caller."""

    def __init__(self, request_id: int, addresses: Sequence[BlockAddress]) -> None:
        self.tracker = PullTracker(request_id, addresses)
        self.results: deque[PullResult] = deque()
        self.wakeup = asyncio.Event()
        self.finished = False   # loop-side mirror of tracker.done
        self.abandoned = False
        self.touched = False    # a frame of this request arrived


class _ClientConnection:
    """Client side of one connection. Frames are matched to requests on the loop, then checked as
    one verifier job per batch (BLAKE3 of each payload, in arrival order: on the loop, or on the
    client's verifier thread while the loop goes on decrypting); verified results reach their
    callers in a later loop callback."""

    link: FrameLink

    def __init__(self, client: TlsTcpClient, peer: Peer) -> None:
        self.client = client
        self.peer = peer
        self.hello = False
        self.requests: dict[int, _Request] = {}
        self.next_id = 1
        self.buffered = 0
        self._loop = asyncio.get_running_loop()
        self.idle_since = 0.0

    def attach(self, link: FrameLink) -> None:
        self.link = link
        self.idle_since = link.last_rx

    def submit(self, addresses: Sequence[BlockAddress]) -> _Request:
        request_id = self.next_id
        self.next_id += 1
        req = _Request(request_id, addresses)
        if self.link.closed:
            self._deliver([(req, req.tracker.fail(MissReason.PEER_GONE), True)], None, 0)
            return req
        if not self.requests:
            self.link.last_rx = self._loop.time()  # the answer timer starts now
        self.requests[request_id] = req
        self.link.send(Pull(request_id, tuple(addresses)))
        return req

    async def results(self, req: _Request) -> AsyncIterator[PullResult]:
        while True:
            while req.results:
                r = req.results.popleft()
                if isinstance(r, Hit):
                    self.consumed(memoryview(r.payload).nbytes)
                yield r
            if req.finished:
                return
            req.wakeup.clear()
            await req.wakeup.wait()

    def abandon(self, req: _Request) -> None:
        """The caller stopped iterating: drop further results (the frames are still read)."""
        req.abandoned = True
        for r in req.results:
            if isinstance(r, Hit):
                self.consumed(memoryview(r.payload).nbytes)
        req.results.clear()

    def consumed(self, nbytes: int) -> None:
        self.buffered -= nbytes
        if self.buffered <= RESULTS_HIGH // 2:
            self.link.resume_reading()

    def on_frames(self, frames: list[Frame]) -> None:
        batch: list[tuple[_Request, Frame]] = []
        for frame in frames:
            if isinstance(frame, Block):  # counted from arrival: awaiting the verifier, then the caller
                self.buffered += memoryview(frame.payload).nbytes
            if not self.hello:
                if not isinstance(frame, Hello):
                    raise ProtocolError(f"server's first frame must be HELLO, got {frame.TYPE.name}")
                if frame.node != self.peer.node:
                    raise ProtocolError(f"server HELLO names {frame.node!r}, expected {self.peer.node!r}")
                self.hello = True
                continue
            match frame:
                case Block() | Miss() | End() | Error() if frame.request_id in self.requests:
                    req = self.requests[frame.request_id]
                    req.touched = True
                    batch.append((req, frame))
                    if isinstance(frame, End | Error):  # the tracker finishes on it
                        del self.requests[frame.request_id]
                        self.idle_since = self.link.last_rx
                case Error(request_id=0):
                    logger.warning("server %s closed the connection: %s", self.peer.node, frame.message)
                    self._verify(batch)
                    self.link.close(MissReason.PEER_ERROR, frame.message)
                    return
                case Bye():
                    self._verify(batch)
                    self.link.close(MissReason.PEER_GONE, f"server said goodbye: {frame.reason}")
                    return
                case _:
                    self._verify(batch)
                    raise ProtocolError(f"unexpected {frame.TYPE.name} frame for request "
                                        f"{getattr(frame, 'request_id', '-')} from the server")
        self._verify(batch)
        if self.buffered > RESULTS_HIGH:
            self.link.pause_reading()

    def _verify(self, batch: list[tuple[_Request, Frame]]) -> None:
        if batch:
            self.client.verifier.submit(functools.partial(self._verify_batch, batch))

    def _verify_batch(self, batch: list[tuple[_Request, Frame]]) -> None:
        """Runs as a verifier job: the only place trackers of submitted requests are touched."""
        arrived = sum(memoryview(f.payload).nbytes for _, f in batch if isinstance(f, Block))
        out: list[tuple[_Request, list[PullResult], bool]] = []
        error: ProtocolError | None = None
        for req, frame in batch:
            if req.tracker.done:  # already failed by a closed connection
                continue
            try:
                out.append((req, req.tracker.on_frame(frame), req.tracker.done))
            except ProtocolError as e:
                error = e
                break
        self.client.verifier.call_on_loop(self._loop, self._deliver, out, error, arrived)

    def _deliver(self, out: list[tuple[_Request, list[PullResult], bool]], error: ProtocolError | None,
                 arrived: int) -> None:
        """Hand verified results to their callers; payload bytes that became no kept Hit (digest
        mismatches, abandoned requests) stop counting against RESULTS_HIGH."""
        kept = 0
        for req, results, done in out:
            if not req.abandoned:
                kept += sum(memoryview(r.payload).nbytes for r in results if isinstance(r, Hit))
                req.results.extend(results)
            req.finished = req.finished or done
            req.wakeup.set()
        self.consumed(arrived - kept)
        if error is not None:
            self.link.protocol_error(error)

    def on_closed(self, reason: MissReason) -> None:
        requests = list(self.requests.values())
        self.requests.clear()
        self.client._forget(self)

        def fail_all() -> None:  # a verifier job, after every frame already submitted
            out = [(req, req.tracker.fail(reason), True) for req in requests if not req.tracker.done]
            self.client.verifier.call_on_loop(self._loop, self._deliver, out, None, 0)

        if requests:
            self.client.verifier.submit(fail_all)

    def watchdog(self, now: float) -> None:
        link = self.link
        waiting = bool(self.requests) and self.buffered <= RESULTS_HIGH
        if (waiting or link.mid_frame) and now - link.last_rx > link.frame_timeout_s:
            logger.warning("server %s stalled for %.1f s; closing", self.peer.node, link.frame_timeout_s)
            link.close(MissReason.TIMEOUT, "server stalled")
        elif not self.requests and now - self.idle_since > self.client.idle_timeout_s / 2:
            # Close before the server's idle timer does, so a new PULL never races its BYE; leave
            # the pool first so that no new pull picks this connection while it says goodbye.
            self.client._forget(self)
            link.send(Bye("idle"))
            link.close_after_flush(MissReason.PEER_GONE, "idle")


class TlsTcpClient:
    """Pulls blocks from peers over TLS-TCP; one pooled connection per peer, many pulls in flight on it."""

    transport = TRANSPORT  # the metrics label

    def __init__(self, credentials: NodeCredentials, *, max_payload: int = DEFAULT_MAX_PAYLOAD,
                 connect_timeout_s: float = 5.0, frame_timeout_s: float = 10.0, idle_timeout_s: float = 30.0,
                 metrics: TransportMetrics | None = None, tune_malloc: bool = True,
                 verify_in_thread: bool = False) -> None:
        """`tune_malloc`: call `tls_link.tune_allocator()` (process-wide glibc thresholds) so that
        received payload buffers are recycled by malloc rather than page-faulted in anew.
        `verify_in_thread`: hash payloads on a thread of their own (overlapping decryption)
        instead of on the event loop. Off by default: in paired runs on 2 cores the thread's GIL
        hand-offs cost more than the overlap gains (inline moved 1.17x as much at 64 KiB blocks,
        1.03-1.05x at 256 KiB and 1 MiB); a host with idle cores may gain from it."""
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
        self._watchdog: _Watchdog | None = None
        self.num_connects = 0
        self.verifier = _Verifier(threaded=verify_in_thread)

    @classmethod
    def from_config(cls, config: TransportConfig, credentials: NodeCredentials,
                    metrics: TransportMetrics | None = None) -> Self:
        return cls(credentials, max_payload=config.max_payload_bytes, connect_timeout_s=config.connect_timeout_s,
                   frame_timeout_s=config.frame_timeout_s, idle_timeout_s=config.idle_timeout_s, metrics=metrics)

    async def pull(self, peer: Peer, addresses: Sequence[BlockAddress]) -> AsyncIterator[PullResult]:
        """One result per address, in the order asked; failures are misses, never exceptions.

        A pooled connection that turns out to be gone before answering anything (the peer closed
        it as idle, or restarted) is replaced once, transparently."""
        if not addresses:
            return
        for attempt in range(2):
            conn, reason, reused = await self._connection(peer)
            if conn is None:
                for address in addresses:
                    miss = Miss(0, address, reason)
                    self.metrics.record(self.transport, miss)
                    yield miss
                return
            requests = [conn.submit(addresses[i:i + ADDRESSES_PER_PULL])
                        for i in range(0, len(addresses), ADDRESSES_PER_PULL)]
            retry = False
            try:
                for i, req in enumerate(requests):
                    async for result in conn.results(req):
                        if (i == 0 and attempt == 0 and reused and not req.touched and isinstance(result, Miss)
                                and result.reason is MissReason.PEER_GONE):
                            retry = True  # the pooled connection was gone before answering anything
                            break
                        self.metrics.record(self.transport, result)
                        yield result
                    if retry:
                        break
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
        async with lock:
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
            conn.link.send(Hello(self.node, VERSION, self.max_payload))
            if self._watchdog is None:
                self._watchdog = _Watchdog(_watchdog_interval(self.frame_timeout_s, self.idle_timeout_s),
                                           lambda: list(self._pool.values()))
            return conn, MissReason.PEER_GONE, False

    async def _open_link(self, peer: Peer, sock: ssl.SSLSocket, conn: _ClientConnection) -> FrameLink:
        """The frame link of an authenticated connection (RDMA overrides this)."""
        decoder = FrameDecoder(max_payload=self.max_payload, payload_allocator=uninitialised_bytearray)
        return TlsLink(sock, decoder, conn.on_frames, conn.on_closed,
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
        # Let queued verifications and failures reach their callers before the thread goes.
        await self.verifier.close()
        await asyncio.sleep(0)
