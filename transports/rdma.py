"""RDMA transport (pyverbs, optional extra `rdma`): the kvfabric codec over RC queue pairs.

    client                                        server
    TLS 1.3 control connection: `tls_link.open_tls`, the same certificates and checks as TLS-TCP
    RC QP created (INIT), receive slots posted
    {"type": "rdma_params", …client}  ───────►    QP created, slots posted, QP → RTR → RTS
                                      ◄───────    {"type": "rdma_params", …server}
    QP → RTR → RTS
    HELLO, PULL…    ═══ RDMA SEND ═════════►      the TLS-TCP connection logic, unchanged
                    ◄══ RDMA SEND ═════════       HELLO, BLOCK / MISS … END
    The control connection stays open; when it closes, the queue pair is torn down.

Data path. The codec's byte stream is cut into SEND messages of at most the peer's receive slot
size; RC delivers them in order, so the receiver feeds each completed slot to `FrameDecoder.feed`
(the same frame state machine as TLS-TCP and QUIC) and re-posts it. A receiver that pauses
simply stops re-posting, and the sender's HCA waits (rnr_retry = 7, i.e. forever): RC's own
flow control. Send bytes are staged in extents of large registered slabs (one MR per slab,
sub-allocated by `SlabAllocator`); receive slots are one registered slab. Payload bytes are thus
copied once on each side, into / out of registered memory. SEND/RECV needs no remote keys, so
the parameters carry no rkey/addr; one-sided READ/WRITE would add them to `RdmaParams`.

Pure parts, tested without a device: `slabs.SlabAllocator`, `RdmaParams` with its msgpack
encoding and validation, the control framing (`encode_control`, `ControlDecoder`), GID text
conversion. Control messages are msgpack maps behind a 4-byte length; the frame codec is not
changed.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import mmap
import secrets
import ssl
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import msgpack

from transports.base import BlockSource, Peer
from transports.certs import NodeCredentials
from transports.codec import (
    DEFAULT_MAX_PAYLOAD,
    Frame,
    FrameDecoder,
    MissReason,
    ProtocolError,
    encode_parts,
    unpack_map,
)
from transports.metrics import TransportMetrics
from transports.slabs import Extent, SlabAllocator
from transports.tls_link import FrameLink, LinkBase, tls_recv, tls_send_all
from transports.tls_tcp import TlsTcpClient, TlsTcpServer, _ClientConnection, _ServerConnection

logger = logging.getLogger(__name__)

TRANSPORT = "rdma"
CONTROL_MAX = 64 * 1024
CONTROL_LEN = struct.Struct("<I")
PARAMS_VERSION = 1
MTU_CODES = {256: 1, 512: 2, 1024: 3, 2048: 4, 4096: 5}   # enum ibv_mtu
MAX_SEND_WR = 64


class ControlError(ProtocolError):
    """A control message of the RDMA handshake is malformed or does not fit this connection."""


class RdmaDeviceError(OSError):
    """The RDMA device refused an operation (pyverbs error), or a work request failed."""


# ---------------------------------------------------------------------------------------------
# Connection parameters and control framing (pure)


def gid_text(raw: bytes) -> str:
    """16 GID bytes as pyverbs writes them: eight colon-separated groups of four hex digits."""
    if len(raw) != 16:
        raise ValueError(f"a GID has 16 bytes, got {len(raw)}")
    return ":".join(raw[i:i + 2].hex() for i in range(0, 16, 2))


def gid_bytes(text: str) -> bytes:
    groups = text.split(":")
    if len(groups) != 8 or not all(len(g) == 4 for g in groups):
        raise ValueError(f"not a GID in eight groups of four hex digits: {text!r}")
    return bytes.fromhex("".join(groups))


_INT_RANGES = {
    "qp_num": (1, 2**24 - 1), "psn": (0, 2**24 - 1), "lid": (0, 2**16 - 1), "port_num": (1, 255),
    "recv_slots": (1, 65536), "slot_size": (4096, 2**30), "max_payload": (1, 2**40),
}


@dataclass(frozen=True, slots=True)
class RdmaParams:
    """What a peer needs to connect its RC queue pair to ours and to size its SENDs."""

    node: str
    qp_num: int
    psn: int
    lid: int
    gid: bytes
    port_num: int
    mtu: int          # bytes: 256 … 4096
    recv_slots: int
    slot_size: int    # largest SEND we accept
    max_payload: int

    def __post_init__(self) -> None:
        for name, (low, high) in _INT_RANGES.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ControlError(f"rdma_params {name} must be an integer in [{low}, {high}], got {value!r}")
        if not isinstance(self.node, str) or not 0 < len(self.node) <= 253:
            raise ControlError(f"rdma_params node must be a non-empty name, got {self.node!r}")
        if not isinstance(self.gid, bytes) or len(self.gid) != 16:
            raise ControlError("rdma_params gid must be 16 bytes")
        if self.mtu not in MTU_CODES:
            raise ControlError(f"rdma_params mtu must be one of {sorted(MTU_CODES)}, got {self.mtu!r}")
        if self.lid == 0 and not any(self.gid):
            raise ControlError("rdma_params need a LID (InfiniBand) or a GID (RoCE); both are zero")

    def to_message(self) -> dict[str, Any]:
        return {"type": "rdma_params", "v": PARAMS_VERSION, "node": self.node, "qp_num": self.qp_num,
                "psn": self.psn, "lid": self.lid, "gid": self.gid, "port_num": self.port_num, "mtu": self.mtu,
                "recv_slots": self.recv_slots, "slot_size": self.slot_size, "max_payload": self.max_payload}

    @classmethod
    def from_message(cls, msg: dict[str, Any]) -> RdmaParams:
        """Validated parameters from a peer's control message (unknown extra keys are ignored)."""
        if msg.get("type") == "error":
            raise ControlError(f"peer refused the RDMA connection: {msg.get('message')!r}")
        if msg.get("type") != "rdma_params":
            raise ControlError(f"expected an rdma_params message, got type {msg.get('type')!r}")
        if msg.get("v") != PARAMS_VERSION:
            raise ControlError(f"rdma_params version {msg.get('v')!r} unsupported (this side: {PARAMS_VERSION})")
        names = ("node", "qp_num", "psn", "lid", "gid", "port_num", "mtu", "recv_slots", "slot_size", "max_payload")
        missing = [n for n in names if n not in msg]
        if missing:
            raise ControlError(f"rdma_params lacks {', '.join(missing)}")
        return cls(**{n: msg[n] for n in names})


def encode_control(msg: dict[str, Any]) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    if len(body) > CONTROL_MAX:
        raise ValueError(f"control message of {len(body)} bytes exceeds {CONTROL_MAX}")
    return CONTROL_LEN.pack(len(body)) + body


class ControlDecoder:
    """Length-prefixed msgpack maps from a byte stream; any split of the stream is accepted."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buf += data
        out: list[dict[str, Any]] = []
        while len(self._buf) >= CONTROL_LEN.size:
            (size,) = CONTROL_LEN.unpack_from(self._buf)
            if size > CONTROL_MAX:
                raise ControlError(f"control message of {size} bytes exceeds {CONTROL_MAX}")
            if len(self._buf) < CONTROL_LEN.size + size:
                break
            body = bytes(self._buf[CONTROL_LEN.size:CONTROL_LEN.size + size])
            del self._buf[:CONTROL_LEN.size + size]
            out.append(unpack_map(body, "control message", ControlError))
        return out


async def exchange_params(sock: ssl.SSLSocket, mine: RdmaParams, *, initiator: bool, expected_node: str,
                          timeout_s: float,
                          before_reply: Callable[[RdmaParams], None] | None = None) -> RdmaParams:
    """Swap RdmaParams over the authenticated control connection.

    The initiator (client) sends first. The responder calls `before_reply(theirs)` (connect its
    queue pair) before answering, so the initiator never sends to a queue pair not yet ready.
    The peer's params must name `expected_node`, the node its certificate proved."""
    decoder = ControlDecoder()

    async def receive() -> RdmaParams:
        while True:
            data = await tls_recv(sock)
            if not data:
                raise ControlError("control connection closed during the RDMA handshake")
            msgs = decoder.feed(data)
            if msgs:
                theirs = RdmaParams.from_message(msgs[0])
                if theirs.node != expected_node:
                    raise ControlError(f"rdma_params name {theirs.node!r} but the certificate names "
                                       f"{expected_node!r}")
                return theirs

    async with asyncio.timeout(timeout_s):
        if initiator:
            await tls_send_all(sock, encode_control(mine.to_message()))
            return await receive()
        theirs = await receive()
        if before_reply is not None:
            before_reply(theirs)
        await tls_send_all(sock, encode_control(mine.to_message()))
        return theirs


# ---------------------------------------------------------------------------------------------
# Device access (pyverbs imported lazily: this module loads without it)


def rdma_unavailable_reason() -> str | None:
    """Why RDMA cannot run here, or None when pyverbs and at least one device are present."""
    sysfs = Path("/sys/class/infiniband")
    if sys.platform == "linux" and not (sysfs.is_dir() and any(sysfs.iterdir())):
        # The hardware check comes first: without a device, installing pyverbs would not help.
        return (f"no RDMA device: {sysfs} lists none (no InfiniBand/RoCE NIC, or the rdma kernel "
                f"modules are not loaded)")
    try:
        import pyverbs.device as d
        from pyverbs.pyverbs_error import PyverbsError
    except ImportError as e:
        return f"pyverbs not installed ({e}); install the `rdma` extra on a host with rdma-core"
    try:
        devices = d.get_device_list()
    except PyverbsError as e:
        return f"cannot list RDMA devices: {e}"
    if not devices:
        return "no RDMA device: ibv_get_device_list() returned none"
    return None


class _Device:
    """An opened device: context, protection domain, port attributes, our GID."""

    _opened: ClassVar[dict[tuple[str | None, int, int], _Device]] = {}

    def __init__(self, name: str | None, port_num: int, gid_index: int) -> None:
        import pyverbs.device as d
        from pyverbs.pd import PD

        devices = d.get_device_list()
        if not devices:
            raise RdmaDeviceError("no RDMA device: ibv_get_device_list() returned none")
        self.name = name or devices[0].name.decode()
        self.ctx = d.Context(name=self.name)
        self.pd = PD(self.ctx)
        self.port_num = port_num
        self.gid_index = gid_index
        port = self.ctx.query_port(port_num)
        self.lid = int(port.lid)
        self.mtu = {code: size for size, code in MTU_CODES.items()}.get(int(port.active_mtu), 1024)
        self.gid = gid_bytes(self.ctx.query_gid(port_num, gid_index).gid)

    @classmethod
    def get(cls, name: str | None, port_num: int, gid_index: int) -> _Device:
        from pyverbs.pyverbs_error import PyverbsError

        key = (name, port_num, gid_index)
        if key not in cls._opened:
            try:
                cls._opened[key] = cls(name, port_num, gid_index)
            except PyverbsError as err:
                raise RdmaDeviceError(f"cannot open RDMA device {name or '(first)'} port {port_num}: {err}") from err
        return cls._opened[key]


class _RegisteredSlabs:
    """A SlabAllocator whose slabs are anonymous mmaps, each registered as one memory region."""

    def __init__(self, device: _Device, slab_size: int, max_slabs: int) -> None:
        import pyverbs.enums as e

        self._device = device
        self._access = e.IBV_ACCESS_LOCAL_WRITE
        self.alloc = SlabAllocator(slab_size, max_slabs)
        self._maps: list[mmap.mmap] = []
        self._mrs: list[Any] = []
        self._addrs: list[int] = []

    def allocate(self, nbytes: int) -> Extent | None:
        extent = self.alloc.allocate(nbytes)
        if extent is None and self.alloc.can_add_slab:
            self._register(self.alloc.add_slab())
            extent = self.alloc.allocate(nbytes)
        return extent

    def _register(self, slab: int) -> None:
        from pyverbs.mr import MR

        mem = mmap.mmap(-1, self.alloc.slab_size)
        anchor = ctypes.c_char.from_buffer(mem)
        address = ctypes.addressof(anchor)
        del anchor  # the mapping stays put; only the buffer export is released
        self._maps.append(mem)
        self._addrs.append(address)
        self._mrs.append(MR(self._device.pd, self.alloc.slab_size, self._access, address=address))
        assert len(self._maps) == slab + 1, "slabs must be registered in order"

    def view(self, extent: Extent) -> memoryview:
        return memoryview(self._maps[extent.slab])[extent.offset:extent.offset + extent.length]

    def sge(self, extent: Extent, length: int) -> Any:
        from pyverbs.wr import SGE

        return SGE(self._addrs[extent.slab] + extent.offset, length, self._mrs[extent.slab].lkey)

    def free(self, extent: Extent) -> None:
        self.alloc.free(extent)

    def close(self) -> None:
        for mr in self._mrs:
            mr.close()
        for mem in self._maps:
            try:
                mem.close()
            except BufferError:  # a view is still referenced somewhere: the GC unmaps it later
                logger.debug("slab still referenced at close; left to the garbage collector")
        self._mrs.clear()
        self._maps.clear()


# ---------------------------------------------------------------------------------------------
# One RC queue pair carrying frames (same surface as tls_link.TlsLink)


class RdmaLink(LinkBase):
    """Frames over one RC queue pair; the TLS control socket is watched and closes the link.

    A thread polls the completion queue (adaptive sleep when idle) and hands completions to the
    event loop; posting, decoding and bookkeeping happen on the loop thread."""

    def __init__(self, device: _Device, control: ssl.SSLSocket, decoder: FrameDecoder,
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
        try:
            self._recv = _RegisteredSlabs(device, recv_slots * slot_size, 1)
            slots = [self._recv.allocate(slot_size) for _ in range(recv_slots)]
            self._slots: list[Extent] = [s for s in slots if s is not None]
            self._send = _RegisteredSlabs(device, send_slab_size, max_send_slabs)
            self.cq = CQ(device.ctx, recv_slots + MAX_SEND_WR + 1)
            cap = QPCap(max_send_wr=MAX_SEND_WR, max_recv_wr=recv_slots, max_send_sge=1, max_recv_sge=1)
            init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap)
            self.qp = QP(device.pd, init, QPAttr(port_num=device.port_num))
            for slot in range(recv_slots):
                self._post_recv(slot)
        except PyverbsError as err:
            raise RdmaDeviceError(f"cannot set up an RDMA queue pair on {device.name}: {err}") from err
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
        for part in (memoryview(head), memoryview(payload).cast("B")):
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


# ---------------------------------------------------------------------------------------------
# Server and client: the TLS-TCP connection logic over an RDMA link


@dataclass(frozen=True, slots=True)
class RdmaOptions:
    device: str | None = None   # None: the first device ibv_get_device_list() reports
    port_num: int = 1
    gid_index: int = 0          # RoCE v2 deployments usually need the index of their IPv4 GID
    recv_slots: int = 32
    slot_size: int = 1 << 20


class RdmaServer(TlsTcpServer):
    """Answers PULLs over RDMA; clients first authenticate on the TLS control port (host, port)."""

    transport = TRANSPORT

    def __init__(self, credentials: NodeCredentials, source: BlockSource, host: str = "127.0.0.1", port: int = 0,
                 *, options: RdmaOptions | None = None, **kw: Any) -> None:
        super().__init__(credentials, source, host, port, **kw)
        self.options = options or RdmaOptions()

    async def _open_link(self, sock: ssl.SSLSocket, conn: _ServerConnection) -> FrameLink:
        o = self.options
        link = RdmaLink(_Device.get(o.device, o.port_num, o.gid_index), sock, conn.session.decoder,
                        conn.on_frames, conn.on_closed, self.frame_timeout_s, self.metrics,
                        max_payload=self.max_payload, recv_slots=o.recv_slots, slot_size=o.slot_size)
        try:
            await exchange_params(sock, link.local_params(self.node), initiator=False, expected_node=conn.node,
                                  timeout_s=self.handshake_timeout_s, before_reply=link.connect)
        except BaseException:
            link.close(MissReason.PEER_ERROR, "RDMA handshake failed")
            raise
        return link


class RdmaClient(TlsTcpClient):
    """Pulls over RDMA from peers whose RdmaServer control port is `peer.port`."""

    transport = TRANSPORT

    def __init__(self, credentials: NodeCredentials, *, options: RdmaOptions | None = None, **kw: Any) -> None:
        super().__init__(credentials, **kw)
        self.options = options or RdmaOptions()

    async def _open_link(self, peer: Peer, sock: ssl.SSLSocket, conn: _ClientConnection) -> FrameLink:
        o = self.options
        link = RdmaLink(_Device.get(o.device, o.port_num, o.gid_index), sock,
                        conn.session.decoder, conn.on_frames, conn.on_closed,
                        self.frame_timeout_s, self.metrics, max_payload=self.max_payload,
                        recv_slots=o.recv_slots, slot_size=o.slot_size, batch_frames=True)
        try:
            theirs = await exchange_params(sock, link.local_params(self.node), initiator=True,
                                           expected_node=peer.node, timeout_s=self.connect_timeout_s)
            link.connect(theirs)
        except BaseException:
            link.close(MissReason.PEER_ERROR, "RDMA handshake failed")
            raise
        return link
