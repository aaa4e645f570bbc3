"""One RC queue pair carrying kvfabric frames (pyverbs, imported lazily: this module loads
without it).

Data path. The codec's byte stream is cut into SEND messages of at most the peer's receive slot
size; RC delivers them in order, so the receiver feeds each completed slot to `FrameDecoder.feed`
(the same frame state machine as TLS-TCP and QUIC) and re-posts it. A receiver that pauses
simply stops re-posting, and the sender's HCA waits (rnr_retry = 7, i.e. forever): RC's own
flow control. Send bytes are staged in extents of large registered slabs (one MR per slab,
sub-allocated by `slabs.SlabAllocator`); receive slots are one registered slab. Payload bytes
are thus copied once on each side, into / out of registered memory.

    RdmaLink owns, in the order it acquires them (released in reverse, also when a later
    step of its set-up fails):
      receive slab (mmap + MR) → send slabs (mmap + MR each) → CQ → QP → posted receives
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable

from transports.core.codec import (
    DEFAULT_MAX_PAYLOAD,
    Frame,
    FrameDecoder,
    MissReason,
    ProtocolError,
    encode_parts,
    payload_pieces,
)
from transports.core.link import LinkBase
from transports.core.metrics import TransportMetrics
from transports.core.slabs import Extent
from transports.rdma.control import MTU_CODES, ControlError, RdmaParams, gid_text
from transports.rdma.device import RdmaDeviceError, _Device, _RegisteredSlabs
from transports.tls.channel import TlsChannel

logger = logging.getLogger(__name__)

TRANSPORT = "rdma"
MAX_SEND_WR = 64


class RdmaLink(LinkBase):
    """Frames over one RC queue pair; the TLS control socket is watched and closes the link.

    A thread polls the completion queue (adaptive sleep when idle) and hands completions to the
    event loop; posting, decoding and bookkeeping happen on the loop thread."""

    def __init__(self, device: _Device, control: TlsChannel, decoder: FrameDecoder,
                 on_frames: Callable[[list[Frame]], None], on_closed: Callable[[MissReason], None],
                 frame_timeout_s: float, metrics: TransportMetrics, *, max_payload: int = DEFAULT_MAX_PAYLOAD,
                 recv_slots: int = 32, slot_size: int = 1 << 20, send_slab_size: int = 32 << 20,
                 max_send_slabs: int = 4, batch_frames: bool = False) -> None:
        import pyverbs.enums as e
        from pyverbs.cq import CQ
        from pyverbs.pyverbs_error import PyverbsError
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

        self._e = e
        self._init_link(TRANSPORT, metrics)
        self._device = device
        self._control = control
        self._decoder = decoder
        self._on_frames = on_frames
        self._on_closed = on_closed
        self.max_payload = max_payload
        self.frame_timeout_s = frame_timeout_s
        self.batch_frames = batch_frames
        self.slot_size = slot_size
        self._num_slots = recv_slots
        self._remote: RdmaParams | None = None
        self.psn = secrets.randbelow(1 << 24)
        # Whatever was acquired is released (in reverse) when a later step fails: the pinned
        # memory of a registered region outlives this object otherwise.
        with contextlib.ExitStack() as undo:
            try:
                self._recv = _RegisteredSlabs(device, recv_slots * slot_size, 1)
                undo.callback(self._recv.close)
                slots = [self._recv.allocate(slot_size) for _ in range(recv_slots)]
                self._slots: list[Extent] = [s for s in slots if s is not None]
                self._send = _RegisteredSlabs(device, send_slab_size, max_send_slabs)
                undo.callback(self._send.close)
                self.cq = CQ(device.ctx, recv_slots + MAX_SEND_WR + 1)
                undo.callback(self.cq.close)
                cap = QPCap(max_send_wr=MAX_SEND_WR, max_recv_wr=recv_slots, max_send_sge=1, max_recv_sge=1)
                init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap)
                self.qp = QP(device.pd, init, QPAttr(port_num=device.port_num))
                undo.callback(self.qp.close)
                for slot in range(recv_slots):
                    self._post_recv(slot)
            except PyverbsError as err:
                raise RdmaDeviceError(f"cannot set up an RDMA queue pair on {device.name}: {err}") from err
            undo.pop_all()
        self._backlog: deque[memoryview] = deque()
        self._backlog_bytes = 0
        self._sends: dict[int, Extent] = {}
        self._next_wr = recv_slots
        self._held: deque[tuple[int, int]] = deque()   # completed receives while paused
        self._reading = False
        self._stopping = threading.Event()
        self._poller: threading.Thread | None = None

    def local_params(self, node: str) -> RdmaParams:
        return RdmaParams(node, self.qp.qp_num, self.psn, self._device.lid, self._device.gid, self._device.port_num,
                          self._device.mtu, self._num_slots, self.slot_size, self.max_payload)

    def connect(self, remote: RdmaParams) -> None:
        """Move the queue pair to RTS towards `remote` (INIT → RTR → RTS)."""
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.pyverbs_error import PyverbsError
        from pyverbs.qp import QPAttr

        attr = QPAttr(port_num=self._device.port_num)
        attr.dest_qp_num = remote.qp_num
        attr.path_mtu = MTU_CODES[min(remote.mtu, self._device.mtu)]
        attr.rq_psn = remote.psn
        attr.sq_psn = self.psn
        attr.max_dest_rd_atomic = attr.max_rd_atomic = 1
        attr.min_rnr_timer = 12
        attr.timeout = 14          # 4.096 µs × 2^14 ≈ 67 ms per transport retry
        attr.retry_cnt = 7
        attr.rnr_retry = 7         # 7 = retry forever: a paused receiver is back-pressure, not an error
        is_global = int(any(remote.gid))
        route = GlobalRoute(dgid=GID(gid_text(remote.gid)), sgid_index=self._device.gid_index) if is_global else None
        attr.ah_attr = AHAttr(port_num=self._device.port_num, dlid=remote.lid, is_global=is_global, gr=route)
        try:
            self.qp.to_rts(attr)
        except PyverbsError as err:
            raise RdmaDeviceError(f"cannot connect the queue pair to {remote.node}: {err}") from err
        self._remote = remote

    # -- FrameLink surface
    def start(self) -> None:
        self._poller = threading.Thread(target=self._poll, name="kvfabric-rdma-cq", daemon=True)
        self._poller.start()
        self._loop.add_reader(self._control.fileno(), self._on_control)
        self.resume_reading()

    def pause_reading(self) -> None:
        self._reading = False

    def resume_reading(self) -> None:
        if self._reading or self.closed:
            return
        self._reading = True
        frames: list[Frame] = []
        while self._held and self._reading and not self.closed:
            slot, nbytes = self._held.popleft()
            frames += self._consume(slot, nbytes)
        self._deliver(frames)

    @property
    def mid_frame(self) -> bool:
        return self._decoder.mid_frame

    def _queued_bytes(self) -> int:
        return self._backlog_bytes

    @property
    def write_pending(self) -> bool:
        # Posted sends not yet completed count too: the peer has not taken them yet.
        return bool(self._backlog or self._sends)

    def send(self, frame: Frame) -> None:
        if self.closed:
            return
        head, payload = encode_parts(frame, max_payload=self.max_payload)
        if not self.write_pending:  # the send-stall timer runs from the moment something waits
            self.last_tx = self._loop.time()
        self._empty.clear()
        for part in (memoryview(head), *(memoryview(p).cast("B") for p in payload_pieces(payload))):
            if part.nbytes:
                self._backlog.append(part)
                self._backlog_bytes += part.nbytes
        self._pump()

    def close(self, reason: MissReason, why: str) -> None:
        if self.closed:
            return
        logger.debug("closing RDMA link: %s", why)
        self.closed = True
        self._reading = False
        self._stopping.set()
        self._loop.remove_reader(self._control.fileno())
        if self._poller is not None:
            self._poller.join(timeout=1.0)
        self.qp.close()       # flushes outstanding work requests before their memory goes away
        self.cq.close()
        self._send.close()
        self._recv.close()
        self._control.close()
        self._backlog.clear()
        self._backlog_bytes = 0
        self._drained.set()
        self._empty.set()
        self._on_closed(reason)

    # -- internals
    def _post_recv(self, slot: int) -> None:
        from pyverbs.wr import RecvWR

        extent = self._slots[slot]
        self.qp.post_recv(RecvWR(wr_id=slot, num_sge=1, sg=[self._recv.sge(extent, self.slot_size)]), None)

    def _pump(self) -> None:
        """Stage backlog bytes into registered extents and post them as SENDs."""
        from pyverbs.wr import SendWR

        e = self._e
        chunk_max = self._remote.slot_size if self._remote is not None else self.slot_size
        while self._backlog and len(self._sends) < MAX_SEND_WR and not self.closed:
            size = min(chunk_max, self._backlog_bytes, self._send.alloc.slab_size)
            extent = self._send.allocate(size)
            if extent is None:
                break  # staging memory is full: send completions will free some
            view, filled = self._send.view(extent), 0
            while filled < size:
                part = self._backlog[0]
                take = min(part.nbytes, size - filled)
                view[filled:filled + take] = part[:take]
                filled += take
                if take == part.nbytes:
                    self._backlog.popleft()
                else:
                    self._backlog[0] = part[take:]
            self._backlog_bytes -= size
            wr_id, self._next_wr = self._next_wr, self._next_wr + 1
            wr = SendWR(wr_id=wr_id, opcode=e.IBV_WR_SEND, num_sge=1, sg=[self._send.sge(extent, size)],
                        send_flags=e.IBV_SEND_SIGNALED)
            self.qp.post_send(wr, None)
            self._sends[wr_id] = extent
        if self._backlog_bytes <= self.write_high:
            self._drained.set()
        if not self.write_pending:
            self._empty.set()

    def _poll(self) -> None:
        idle = 0.0
        while not self._stopping.is_set():
            count, wcs = self.cq.poll(64)
            if count:
                idle = 0.0
                done = [(wc.wr_id, wc.status, wc.byte_len) for wc in wcs]
                self._loop.call_soon_threadsafe(self._on_completions, done)
            else:  # back off from 50 µs to 2 ms while idle
                idle = min(0.002, idle * 2 or 0.00005)
                time.sleep(idle)

    def _on_completions(self, done: list[tuple[int, int, int]]) -> None:
        if self.closed:
            return
        frames: list[Frame] = []
        received = False
        now = self._loop.time()
        for wr_id, status, nbytes in done:
            if status != self._e.IBV_WC_SUCCESS:
                self._deliver(frames)
                self.close(MissReason.PEER_GONE, f"work request {wr_id} failed with status {status}")
                return
            if wr_id < self._num_slots:
                self.last_rx = now
                received = True
                if self._reading:
                    frames += self._consume(wr_id, nbytes)
                    if not self.batch_frames:
                        self._deliver(frames)
                        frames = []
                else:
                    self._held.append((wr_id, nbytes))
            else:
                self.last_tx = now
                self._send.free(self._sends.pop(wr_id))
            if self.closed:
                return
        self._deliver(frames, received)
        self._pump()

    def _consume(self, slot: int, nbytes: int) -> list[Frame]:
        try:
            frames = self._decoder.feed(self._recv.view(self._slots[slot])[:nbytes])
        except ProtocolError as err:
            self.protocol_error(err)
            return []
        if not self.closed:
            self._post_recv(slot)
        return frames

    def _deliver(self, frames: list[Frame], received: bool = False) -> None:
        """Frames of a batch of completions; none but `received` still tells the session that
        bytes arrived (its total frame deadline)."""
        if (not frames and not received) or self.closed:
            return
        try:
            self._on_frames(frames)
        except ProtocolError as err:
            self.protocol_error(err)

    def _on_control(self) -> None:
        try:
            data = self._control.recv(4096)
        except ssl.SSLWantReadError:
            return
        except (ssl.SSLError, OSError) as err:
            self.close(MissReason.PEER_GONE, f"control connection failed: {err}")
            return
        if not data:
            self.close(MissReason.PEER_GONE, "control connection closed")
        else:
            self.protocol_error(ControlError("unexpected bytes on the RDMA control connection"))

