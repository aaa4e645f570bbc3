"""RDMA connection parameters and the control framing that carries them (pure), plus their
exchange over the authenticated TLS control connection.

    client                                        server
    {"type": "rdma_params", …client}  ───────►    connect its QP to the client's (before_reply)
                                      ◄───────    {"type": "rdma_params", …server}
    connect its QP to the server's

Control messages are msgpack maps behind a 4-byte little-endian length (at most `CONTROL_MAX`
bytes); the frame codec is not changed. `RdmaParams` validates every field it receives, so a
peer's malformed or out-of-range parameters are a `ControlError` (a `ProtocolError`), never a
device error. SEND/RECV needs no remote keys, so the parameters carry no rkey/addr; one-sided
READ/WRITE would add them. Everything but `exchange_params` is tested without a device.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from transports.core.codec import ProtocolError, unpack_map
from transports.tls.channel import TlsChannel
from transports.tls.handshake import tls_recv, tls_send_all

CONTROL_MAX = 64 * 1024
CONTROL_LEN = struct.Struct("<I")
PARAMS_VERSION = 1
MTU_CODES = {256: 1, 512: 2, 1024: 3, 2048: 4, 4096: 5}   # enum ibv_mtu


class ControlError(ProtocolError):
    """A control message of the RDMA handshake is malformed or does not fit this connection."""




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


async def exchange_params(sock: TlsChannel, mine: RdmaParams, *, initiator: bool, expected_node: str,
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
