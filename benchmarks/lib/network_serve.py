"""The serving end of `bench_network.py`, run inside one host of a network test bed.

    python benchmarks/lib/network_serve.py --cert-dir DIR

One process, fixed ports (the host's namespace is the bed's own, so nothing else listens there):

    TLS_TCP_PORT      kvfabric TLS-TCP server
    QUIC_PORT         kvfabric QUIC server (`auto` backend, QuicTuning(1452): tuned for a datacenter)
    QUIC_STOCK_PORT   the same server with the library's own defaults for the tuned knobs (the
                      "before" of the paired QUIC tuning figures)
    TCP_PORT          plain TCP stream: a request (block size, count) is answered by `count` blocks
    TLS_PORT          the same over TLS 1.3 with the same certificates (mTLS)

Every server holds the same random blocks of each size in `BLOCK_SIZES` (`address(size, i)`), so the
kvfabric methods and the bare streams move the same bytes. Prints `READY` once all listen; stops on
SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import signal
import socket
import ssl
import sys
import threading
from pathlib import Path

import blake3

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.harness import MemorySource, credentials
from benchmarks.lib.stream_blocks import answer_requests
from fabric.keys import BlockAddress, BlockHash
from transports.core.base import TransportServer
from transports.quic import QuicTransportServer, QuicTuning
from transports.quic.backend import resolve
from transports.tls.server import TlsTcpServer

SERVER_NODE, CLIENT_NODE = "net-server", "net-client"
TLS_TCP_PORT, QUIC_PORT, QUIC_STOCK_PORT, TCP_PORT, TLS_PORT = 7101, 7102, 7103, 7104, 7105
DATAGRAM = 1452                      # what a 1500-byte-MTU link (the bed's veths) carries
BLOCK_SIZES = {"1m": 1 << 20, "64k": 64 << 10}
SERVED_BYTES = 48 << 20              # distinct bytes per block size


def num_blocks(size: int) -> int:
    return SERVED_BYTES // size


@functools.cache   # names are made once per run, not inside the timed loops
def address(size: int, i: int) -> BlockAddress:
    return BlockAddress(BlockHash(blake3.blake3(b"bench-network-%d-%d" % (size, i)).digest()), 0)


def _stream_server(port: int, ctx: ssl.SSLContext | None, payloads: dict[int, list[bytes]]) -> None:
    """Blocking stream server, one thread per connection (the client opens one per method)."""
    listener = socket.create_server(("0.0.0.0", port))

    def answer(raw: socket.socket) -> None:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            conn = ctx.wrap_socket(raw, server_side=True) if ctx is not None else raw
            with conn:
                answer_requests(conn, payloads)
        except (OSError, ssl.SSLError):
            raw.close()   # the client went away mid-answer: nothing to keep

    def accept() -> None:
        while True:
            raw, _ = listener.accept()
            threading.Thread(target=answer, args=(raw,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()


async def serve(cert_dir: Path) -> None:
    payloads = {size: [os.urandom(size) for _ in range(num_blocks(size))] for size in BLOCK_SIZES.values()}
    creds = credentials(cert_dir, SERVER_NODE)
    source = MemorySource((address(size, i), p) for size, ps in payloads.items() for i, p in enumerate(ps))
    servers: list[TransportServer] = [TlsTcpServer(creds, source, "0.0.0.0", TLS_TCP_PORT),
               QuicTransportServer(creds, source, host="0.0.0.0", port=QUIC_PORT,
                                   tuning=QuicTuning(DATAGRAM)),
               QuicTransportServer(creds, source, host="0.0.0.0", port=QUIC_STOCK_PORT,
                                   tuning=QuicTuning.library_defaults(DATAGRAM, resolve("auto")))]
    for server in servers:
        await server.start()
    _stream_server(TCP_PORT, None, payloads)
    _stream_server(TLS_PORT, creds.ssl_context(server=True), payloads)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("READY", flush=True)
    await stop.wait()
    for server in servers:
        await server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cert-dir", required=True)
    asyncio.run(serve(Path(parser.parse_args().cert_dir)))


if __name__ == "__main__":
    main()
