"""The QUIC library under the QUIC transport: aioquic (pure Python) or qh3 (an aioquic fork whose
packet core is Rust), chosen by `[transport] quic_backend`.

Both expose the same sans-I/O shape (QuicConnection: receive_datagram / datagrams_to_send /
next_event / send_stream_data, events, an asyncio protocol and server), so `server` and
`client` are written once against it. What differs sits here, one `QuicBackend` per library:

  * the library's classes (configuration, connection, protocol and server bases, events);
  * the server's client-certificate enforcement (`tls` for aioquic, `tls_qh3` for qh3);
  * the few stream internals the server reads (bytes queued, whether a stream can still send);
  * the UDP endpoint: our batched reader for aioquic; for qh3 its own transport, which sends with
    GSO and receives with GRO / recvmmsg where the kernel has them.

`auto` picks qh3 when it imports (it moves several times more bytes per CPU second), else aioquic.
Session resumption exists on aioquic only (see `tls_qh3`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import cache
from types import ModuleType
from typing import Any, Literal, cast

from transports.quic.udp import UdpEndpoint
from transports.trust.client_auth import AuthFailure

logger = logging.getLogger(__name__)

BackendName = Literal["aioquic", "qh3"]
BACKENDS: tuple[BackendName, ...] = ("aioquic", "qh3")


@dataclass(frozen=True, slots=True)
class QuicBackend:
    """One QUIC library as the transport uses it."""

    name: BackendName
    configuration: Any        # QuicConfiguration class
    connection: Any           # QuicConnection class
    protocol_base: Any        # asyncio QuicConnectionProtocol class
    server_base: Any          # asyncio QuicServer class
    events: ModuleType
    resumption: bool          # session tickets offered and accepted
    install_client_auth: Callable[[Any, Callable[[], Any]], None]
    peer_node: Callable[[Any], str | None]
    auth_failure: Callable[[Any], AuthFailure | None]
    server_revoked: Callable[[Any, frozenset[int]], bool]
    queued: Callable[[Any], int]                  # stream bytes the connection still has to deliver
    can_send: Callable[[Any, int], bool]          # the stream is open for our data
    stop_reading: Callable[[Any, int, int], None]  # STOP_SENDING, unless the stream is already gone
    remote_address: Callable[[Any], Any]
    initial_header: Callable[[bytes, int], tuple[bool, bytes, bytes] | None]  # (is Initial, dcid, token)
    endpoint: Callable[[socket.socket, asyncio.DatagramProtocol], Awaitable[asyncio.DatagramTransport]]
    receive_many: Callable[[Any, list[bytes], Any, float], None]   # a batch of datagrams from one address
    peer_tenants: Callable[[Any], frozenset[str]]  # an authenticated client's tenant restriction (empty: none)


def resolve(name: str) -> QuicBackend:
    """The backend `name` ("auto", "aioquic" or "qh3") names; ImportError if that library is missing."""
    if name == "auto":
        try:
            return _qh3()
        except ImportError:
            return _aioquic()
    if name == "qh3":
        return _qh3()
    if name == "aioquic":
        return _aioquic()
    raise ValueError(f"unknown QUIC backend {name!r}; expected auto, aioquic or qh3")


def available() -> list[BackendName]:
    """The backends whose library imports here."""
    found: list[BackendName] = []
    for name in BACKENDS:
        try:
            resolve(name)
        except ImportError:
            continue
        found.append(name)
    return found


@cache
def _aioquic() -> QuicBackend:
    from aioquic._buffer import Buffer
    from aioquic.asyncio.protocol import QuicConnectionProtocol
    from aioquic.asyncio.server import QuicServer
    from aioquic.quic import events
    from aioquic.quic.configuration import QuicConfiguration
    from aioquic.quic.connection import QuicConnection
    from aioquic.quic.packet import QuicPacketType, pull_quic_header

    from transports.quic import tls as quic_tls

    def queued(quic: Any) -> int:
        return sum(len(qs.sender._buffer) for qs in quic._streams.values())

    def can_send(quic: Any, stream_id: int) -> bool:
        qs = quic._streams.get(stream_id)
        return qs is None or (qs.sender._buffer_fin is None and qs.sender._reset_error_code is None)

    def stop_reading(quic: Any, stream_id: int, code: int) -> None:
        if stream_id in quic._streams and quic._stream_can_receive(stream_id):
            quic.stop_stream(stream_id, code)

    def remote_address(quic: Any) -> Any:
        return quic._network_paths[0].addr if quic._network_paths else "?"

    def initial_header(data: bytes, cid_length: int) -> tuple[bool, bytes, bytes] | None:
        try:
            header = pull_quic_header(Buffer(data=data), host_cid_length=cid_length)
        except ValueError:
            return None
        return header.packet_type == QuicPacketType.INITIAL, header.destination_cid, header.token

    async def endpoint(sock: socket.socket, protocol: asyncio.DatagramProtocol) -> asyncio.DatagramTransport:
        return UdpEndpoint(sock, protocol)

    def receive_many(quic: Any, datagrams: list[bytes], addr: Any, now: float) -> None:
        for data in datagrams:
            quic.receive_datagram(data, addr, now=now)

    return QuicBackend("aioquic", QuicConfiguration, QuicConnection, QuicConnectionProtocol, QuicServer, events,
                       True, cast(Any, quic_tls.install_client_auth), quic_tls.peer_node, quic_tls.auth_failure,
                       quic_tls.server_revoked, queued, can_send, stop_reading, remote_address, initial_header,
                       endpoint, receive_many, quic_tls.peer_tenants)


@cache
def _qh3() -> QuicBackend:
    from qh3._hazmat import pull_quic_header
    from qh3.asyncio._transport import create_optimized_datagram_transport
    from qh3.asyncio.protocol import QuicConnectionProtocol
    from qh3.asyncio.server import QuicServer
    from qh3.quic import events
    from qh3.quic.configuration import QuicConfiguration
    from qh3.quic.connection import QuicConnection, QuicConnectionError
    from qh3.quic.packet import QuicPacketType

    from transports.quic import tls_qh3 as quic_tls_qh3

    def queued(quic: Any) -> int:
        return int(quic.get_send_buffer_size())

    def can_send(quic: Any, stream_id: int) -> bool:
        return bool(quic._stream_can_send(stream_id))

    def stop_reading(quic: Any, stream_id: int, code: int) -> None:
        if quic._core is None or quic._close_event is not None:
            return
        try:
            quic.stop_stream(stream_id, code)
        except QuicConnectionError as e:   # the core already finished with the stream: nothing to stop
            logger.debug("QUIC stream %d not stopped: %s", stream_id, e)

    def remote_address(quic: Any) -> Any:
        return quic._remote_addr or "?"

    def initial_header(data: bytes, cid_length: int) -> tuple[bool, bytes, bytes] | None:
        try:
            header = pull_quic_header(data, 0, cid_length)
        except ValueError:
            return None
        return header[1] == int(QuicPacketType.INITIAL), header[3], header[5]

    async def endpoint(sock: socket.socket, protocol: asyncio.DatagramProtocol) -> asyncio.DatagramTransport:
        loop = asyncio.get_running_loop()
        # GRO coalesces datagrams of one size; a segment size under the real one only costs a copy.
        transport, _ = await create_optimized_datagram_transport(loop, lambda: protocol, sock, gro_segment_size=1280)
        return transport

    def receive_many(quic: Any, datagrams: list[bytes], addr: Any, now: float) -> None:
        # One call into the Rust core for the whole batch (one lock, one event drain).
        quic.receive_many_datagrams(datagrams, addr, now=now)

    return QuicBackend("qh3", QuicConfiguration, QuicConnection, QuicConnectionProtocol, QuicServer, events,
                       False, quic_tls_qh3.install_client_auth, quic_tls_qh3.peer_node, quic_tls_qh3.auth_failure,
                       quic_tls_qh3.server_revoked, queued, can_send, stop_reading, remote_address, initial_header,
                       endpoint, receive_many, quic_tls_qh3.peer_tenants)
