"""What every framed link shares, whatever carries its bytes (a TLS socket, an RDMA queue pair): the
`FrameLink` interface a transport's connection logic uses, and `LinkBase`, the protocol-error
boundary, close-after-flush and the send-queue events. `transports.tls.link.TlsLink` and
`transports.rdma.link` build on it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from transports.core.codec import Error, ErrorCode, Frame, MissReason, ProtocolError
from transports.core.metrics import TransportMetrics

__all__ = ["WRITE_HIGH", "FrameLink", "LinkBase"]

logger = logging.getLogger(__name__)

WRITE_HIGH = 8 * 1024 * 1024    # drain() waits while more than this is queued for sending


def _nothing_due() -> bool:
    return False


class FrameLink(Protocol):
    """What a transport's connection logic needs from a link: TLS in `transports.tls.link`, RDMA in
    `transports.rdma.link`."""

    closed: bool
    more_due: Callable[[], bool]
    last_rx: float
    last_tx: float
    frame_timeout_s: float

    def start(self) -> None: ...
    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...
    @property
    def mid_frame(self) -> bool: ...
    @property
    def write_pending(self) -> bool: ...
    @property
    def backlogged(self) -> bool: ...
    def send(self, frame: Frame) -> None: ...
    def send_many(self, frames: list[Frame]) -> None: ...
    async def drain(self) -> None: ...
    def protocol_error(self, err: ProtocolError) -> None: ...
    def close_after_flush(self, reason: MissReason, why: str, timeout_s: float = 1.0) -> None: ...
    def close(self, reason: MissReason, why: str) -> None: ...


class LinkBase:
    """What every frame link shares: the protocol-error boundary, close-after-flush, and the
    `_drained` / `_empty` events its send queue drives. Subclasses own the bytes (TLS socket,
    RDMA queue pair) and implement `send`, `pause_reading`, `close`, `_queued_bytes`."""

    transport: str
    closed: bool

    def _init_link(self, transport: str, metrics: TransportMetrics, write_high: int = WRITE_HIGH) -> None:
        self._loop = asyncio.get_running_loop()
        self.write_high = write_high
        self.transport = transport  # the metrics label
        self._metrics = metrics
        self._drained = asyncio.Event()   # set while the queue is at or below write_high
        self._drained.set()
        self._empty = asyncio.Event()     # set while nothing is queued
        self._empty.set()
        self._closers: set[asyncio.Task[None]] = set()
        self.closed = False
        self.last_rx = self.last_tx = self._loop.time()
        # Whether the owner expects more answers after the payload being received: a link may then
        # let the kernel gather a payload's bytes before it wakes the reader (a hint; links may ignore it).
        self.more_due: Callable[[], bool] = _nothing_due

    def send(self, frame: Frame) -> None:
        raise NotImplementedError

    def send_many(self, frames: list[Frame]) -> None:
        for frame in frames:
            self.send(frame)

    def pause_reading(self) -> None:
        raise NotImplementedError

    def close(self, reason: MissReason, why: str) -> None:
        raise NotImplementedError

    def _queued_bytes(self) -> int:
        raise NotImplementedError

    @property
    def write_pending(self) -> bool:
        return self._queued_bytes() > 0

    @property
    def backlogged(self) -> bool:
        """More than `write_high` waits to be sent: `drain` would wait."""
        return self._queued_bytes() > self.write_high and not self.closed

    async def drain(self) -> None:
        """Wait until the send queue is at most `write_high` (or the link closed)."""
        while self.backlogged:
            self._drained.clear()
            await self._drained.wait()

    def protocol_error(self, err: ProtocolError) -> None:
        """The boundary for a misbehaving peer: answer ERROR if we still can, then close."""
        if self.closed:
            return
        logger.warning("protocol error from %s peer, closing the connection: %s", self.transport, err)
        self._metrics.protocol_errors.labels(self.transport).inc()
        self.pause_reading()
        self.send(Error(0, ErrorCode.PROTOCOL, str(err)[:500]))
        self.close_after_flush(MissReason.PEER_ERROR, str(err))

    def close_after_flush(self, reason: MissReason, why: str, timeout_s: float = 1.0) -> None:
        """Stop reading now; close once the send queue is empty (or after `timeout_s`)."""
        self.pause_reading()
        if not self.write_pending:
            self.close(reason, why)
            return

        async def wait_then_close() -> None:
            try:
                async with asyncio.timeout(timeout_s):
                    await self._empty.wait()
            except TimeoutError:
                logger.debug("%s peer did not take the last frames within %.1f s", self.transport, timeout_s)
            finally:
                self.close(reason, why)

        task = self._loop.create_task(wait_then_close())
        self._closers.add(task)
        task.add_done_callback(self._closers.discard)
