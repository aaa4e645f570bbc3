"""QUIC transport (aioquic): `server.QuicTransportServer` and `client.QuicTransportClient`
over the sans-I/O sessions, and what they share (`base`), under one import.

Pick the datagram size your network carries: aioquic builds every packet in Python, so QUIC's
throughput follows packets per second, and 8952-byte (jumbo) datagrams move several times what
1452-byte ones do. Where TCP is allowed, TLS-TCP moves bulk pulls faster than either.
"""

from __future__ import annotations

from transports.quic.base import ALPN, MAX_ADDRESSES_PER_STREAM, TRANSPORT, QuicTuning
from transports.quic.client import ConnectionInfo, QuicTransportClient
from transports.quic.server import QuicTransportServer

__all__ = ["ALPN", "MAX_ADDRESSES_PER_STREAM", "TRANSPORT", "ConnectionInfo", "QuicTransportClient",
           "QuicTransportServer", "QuicTuning"]
