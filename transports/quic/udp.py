"""A UDP endpoint for aioquic that reads datagrams in batches (asyncio's reads one per loop turn).

`udp_socket` makes the non-blocking socket (large buffers: bursts of jumbo datagrams overflow the
defaults, and loss halves QUIC's congestion window); `UdpEndpoint` is the asyncio transport over it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

logger = logging.getLogger(__name__)


def udp_socket(host: str, port: int, buffer_size: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        if buffer_size:  # bursts of jumbo datagrams overflow the default buffers: loss halves cwnd
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                sock.setsockopt(socket.SOL_SOCKET, opt, buffer_size)
        sock.setblocking(False)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class UdpEndpoint(asyncio.DatagramTransport):
    """A UDP socket read in batches, feeding one aioquic datagram protocol.

    asyncio's datagram transport reads one datagram per event-loop turn, so aioquic builds packets
    and re-arms timers once per received datagram. Here up to READ_BATCH datagrams are read per
    readiness event and the protocols transmit once afterwards (`_transmit_soon`), which removes
    most of that per-packet work at high packet rates. A send that would block is dropped, as a
    full buffer on the path would drop it; QUIC loss recovery sends it again.
    """

    READ_BATCH = 64

    def __init__(self, sock: socket.socket, protocol: asyncio.DatagramProtocol) -> None:
        super().__init__()
        self._loop = asyncio.get_running_loop()
        self._sock = sock
        self._protocol = protocol
        self._closed = False
        self._loop.add_reader(sock.fileno(), self._read)
        protocol.connection_made(self)

    def _read(self) -> None:
        for _ in range(self.READ_BATCH):
            try:
                data, addr = self._sock.recvfrom(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # e.g. an ICMP error for an earlier send; nothing to do
                logger.debug("UDP receive error: %s", e)
                continue
            self._protocol.datagram_received(data, addr)

    def sendto(self, data: Any, addr: Any = None) -> None:
        if self._closed:
            return
        try:
            self._sock.sendto(data, addr)
        except OSError as e:  # includes BlockingIOError: the datagram is lost, QUIC resends it
            logger.debug("UDP send to %s failed: %s", addr, e)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._sock if name == "socket" else default

    def is_closing(self) -> bool:
        return self._closed

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
