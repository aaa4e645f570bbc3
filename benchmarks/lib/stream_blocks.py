"""The bare stream baseline of the transfer benchmarks: a client asks for `count` blocks of one size,
starting at block `first` of the server's distinct blocks of that size, with a 24-byte request;
the server sends them back to back over plain TCP or TLS (no framing, no
verification). `bench_transfer.py` runs it over loopback, `bench_network.py` between bed hosts.
"""

from __future__ import annotations

import socket
import ssl
import struct
from collections.abc import Callable, Mapping, Sequence

REQUEST = struct.Struct("<QQQ")   # (block size, first block, count)

Conn = socket.socket | ssl.SSLSocket


def recv_exactly(conn: Conn, size: int) -> bytes:
    """`size` bytes, or b"" when the peer closed first."""
    data = bytearray()
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            return b""
        data += chunk
    return bytes(data)


def answer_requests(conn: Conn, payloads: Mapping[int, Sequence[bytes]]) -> None:
    """Serve one connection until the client closes it: each request gets its blocks, from its
    first on, cycling through `payloads[block size]`."""
    while header := recv_exactly(conn, REQUEST.size):
        size, first, count = REQUEST.unpack(header)
        blocks = payloads[size]
        for i in range(first, first + count):
            conn.sendall(blocks[i % len(blocks)])


def receive_blocks(conn: Conn, size: int, count: int, buf: memoryview,
                   on_block: Callable[[memoryview], object] | None = None, first: int = 0) -> int:
    """Ask for `count` blocks of `size` bytes from block `first` on and receive each into `buf`
    (reused), calling `on_block(buf)` as each lands; bytes moved."""
    conn.sendall(REQUEST.pack(size, first, count))
    for _ in range(count):
        got = 0
        while got < size:
            n = conn.recv_into(buf[got:])
            if not n:
                raise ConnectionError("stream server closed the connection")
            got += n
        if on_block is not None:
            on_block(buf)
    return size * count
