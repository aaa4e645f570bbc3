"""RDMA transport (pyverbs, optional extra `rdma`): the kvfabric codec over RC queue pairs.

    client                                        server
    TLS 1.3 control connection: `tls.handshake.open_tls`, the same certificates and checks as TLS-TCP
    RC QP created (INIT), receive slots posted
    {"type": "rdma_params", …client}  ───────►    QP created, slots posted, QP → RTR → RTS
                                      ◄───────    {"type": "rdma_params", …server}
    QP → RTR → RTS
    HELLO, PULL…    ═══ RDMA SEND ═════════►      the TLS-TCP connection logic, unchanged
                    ◄══ RDMA SEND ═════════       HELLO, BLOCK / MISS … END
    The control connection stays open; when it closes, the queue pair is torn down.

This module is the adapter: `RdmaServer` / `RdmaClient` are the TLS-TCP endpoints (sessions,
limits, timers) with an `RdmaLink` in place of a `TlsLink`. The parts live in
  * `control` — `RdmaParams`, control framing, GID text, `exchange_params` (pure but the
    exchange; tested without a device);
  * `device` — why RDMA cannot run here, the opened device, registered memory slabs;
  * `link` — `RdmaLink`, one RC queue pair carrying frames (same surface as `TlsLink`).
The names below are re-exported so `transports.rdma.transport` stays the one import for users.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transports.core.base import BlockSource, Peer
from transports.core.codec import MissReason
from transports.core.link import FrameLink
from transports.rdma.control import (
    CONTROL_LEN,
    CONTROL_MAX,
    MTU_CODES,
    PARAMS_VERSION,
    ControlDecoder,
    ControlError,
    RdmaParams,
    encode_control,
    exchange_params,
    gid_bytes,
    gid_text,
)
from transports.rdma.device import RdmaDeviceError, _Device, rdma_unavailable_reason
from transports.rdma.link import TRANSPORT, RdmaLink
from transports.tls.channel import TlsChannel
from transports.tls.client import ClientConnection, TlsTcpClient
from transports.tls.server import ServerConnection, TlsTcpServer
from transports.trust.certs import NodeCredentials

__all__ = [
    "CONTROL_LEN", "CONTROL_MAX", "MTU_CODES", "PARAMS_VERSION", "TRANSPORT", "ControlDecoder", "ControlError",
    "RdmaClient", "RdmaDeviceError", "RdmaLink", "RdmaOptions", "RdmaParams", "RdmaServer", "encode_control",
    "exchange_params", "gid_bytes", "gid_text", "rdma_unavailable_reason",
]


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

    async def open_link(self, sock: TlsChannel, conn: ServerConnection) -> FrameLink:
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

    async def open_link(self, peer: Peer, sock: TlsChannel, conn: ClientConnection) -> FrameLink:
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
