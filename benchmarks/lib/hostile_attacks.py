"""Hostile peers against one kvfabric node, for a bounded time: what `soak_hostile.py` runs in a
process of its own while a good client pulls (and what the hostile-peer tests reuse).

    .venv/bin/python benchmarks/lib/hostile_attacks.py --cert-dir DIR --quic-port P --tcp-port P --seconds S

The attacker holds a valid cluster certificate ("bad-1") and, all at once:

  * streams that end right after their PULL (BYE, ERROR) on QUIC, a few per second;
  * 32 half-open QUIC handshakes (answering the Retry) from 127.0.0.2 every 2 s;
  * a flood of PULLs of missing addresses, as fast as the node takes them, over TLS-TCP and QUIC;
  * more TLS-TCP connections than the per-peer cap;
  * a pull of a block over its own payload limit (1 MiB), once a second.

Prints one JSON line of counts (what was sent, what the node answered) when done.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import ssl
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from aioquic._buffer import Buffer
from aioquic.asyncio.client import connect
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import QuicPacketType, pull_quic_header

from benchmarks.lib.soak_node import big_address
from fabric.keys import BlockAddress, BlockHash
from transports.core.base import Peer
from transports.core.codec import Bye, End, Error, ErrorCode, FrameDecoder, Hello, Miss, MissReason, Pull, encode
from transports.quic import ALPN, QuicTransportClient
from transports.trust.certs import CredentialFiles, NodeCredentials

SERVER_NODE, ATTACKER = "node-a", "bad-1"
FLOOD_BATCH = 64   # PULLs written per round of the TLS-TCP flood
CASES = ("ended_streams", "half_open", "tls_flood", "quic_flood", "extra_connections", "oversize")


def hold_half_open(port: int, count: int, source_host: str, server_node: str = SERVER_NODE) -> int:
    """`count` QUIC handshakes from `source_host` that answer the server's Retry (so the server keeps
    a connection for each) and then never go on; how many Retries were answered."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((source_host, 0))
    sock.settimeout(0.2)
    config = QuicConfiguration(is_client=True, alpn_protocols=[ALPN], server_name=server_node)
    clients: dict[bytes, QuicConnection] = {}
    for _ in range(count):
        quic = QuicConnection(configuration=config)
        quic.connect(("127.0.0.1", port), now=0.0)
        clients[quic.host_cid] = quic
        for data, addr in quic.datagrams_to_send(now=0.0):
            sock.sendto(data, addr)
    answered = 0
    with contextlib.suppress(TimeoutError):
        while answered < count:
            data, addr = sock.recvfrom(65536)
            header = pull_quic_header(Buffer(data=data), host_cid_length=8)
            found = clients.get(header.destination_cid)
            if found is None or header.packet_type != QuicPacketType.RETRY:
                continue
            found.receive_datagram(data, addr, now=0.0)
            for out, to in found.datagrams_to_send(now=0.0):
                sock.sendto(out, to)
            answered += 1
    sock.close()
    return answered


def missing(i: int) -> BlockAddress:
    return BlockAddress(BlockHash(i.to_bytes(8, "little") * 4), 0)


class Attack:
    """The attacker's counters and its end time."""

    def __init__(self, cert_dir: Path, quic_port: int, tcp_port: int, seconds: float) -> None:
        self.cert_dir = cert_dir
        self.quic_port, self.tcp_port = quic_port, tcp_port
        self.until = time.monotonic() + seconds
        self.counts: dict[str, int] = {}

    def count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

    @property
    def running(self) -> bool:
        return time.monotonic() < self.until

    def quic_config(self) -> QuicConfiguration:
        config = QuicConfiguration(is_client=True, alpn_protocols=[ALPN], server_name=SERVER_NODE)
        config.load_verify_locations(cadata=(self.cert_dir / "ca.pem").read_bytes())
        config.load_cert_chain(self.cert_dir / f"{ATTACKER}.pem", self.cert_dir / f"{ATTACKER}.key")
        return config

    def tls_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.load_verify_locations(cafile=str(self.cert_dir / "ca.pem"))
        ctx.load_cert_chain(self.cert_dir / f"{ATTACKER}.pem", self.cert_dir / f"{ATTACKER}.key")
        return ctx

    # -- the cases
    async def ended_streams(self) -> None:
        """PULL then BYE (or ERROR) at once on one stream: the node must end it and go on."""
        async with connect("127.0.0.1", self.quic_port, configuration=self.quic_config()) as quic:
            i = 0
            while self.running:
                last = Bye("done") if i % 2 else Error(1, ErrorCode.INTERNAL, "gave up")
                reader, writer = await quic.create_stream()
                writer.write(encode(Pull(1, (missing(i),))) + encode(last))
                writer.write_eof()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(reader.read(), 2)
                    self.count("ended_streams")
                i += 1
                await asyncio.sleep(0.2)

    async def half_open(self) -> None:
        while self.running:
            self.count("half_open_answered", await asyncio.to_thread(hold_half_open, self.quic_port, 32, "127.0.0.2"))
            await asyncio.sleep(2.0)

    async def tls_flood(self) -> None:
        """PULLs of missing addresses over one TLS-TCP connection, as fast as the node reads them."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.tcp_port, ssl=self.tls_context(),
                                                       server_hostname=SERVER_NODE)
        writer.write(encode(Hello(ATTACKER)))
        reading = asyncio.create_task(self._read_answers(reader, "tls"))
        rid = 1
        try:
            while self.running and not reading.done():
                writer.write(b"".join(encode(Pull(rid + k, (missing(rid + k),))) for k in range(FLOOD_BATCH)))
                rid += FLOOD_BATCH
                self.count("tls_flood_pulls", FLOOD_BATCH)
                try:   # the node stops reading a peer over its budget: writing blocks until it reads again
                    await asyncio.wait_for(writer.drain(), max(0.1, self.until - time.monotonic()))
                except TimeoutError:
                    break
        finally:
            reading.cancel()
            writer.close()

    async def _read_answers(self, reader: asyncio.StreamReader, label: str) -> None:
        decoder = FrameDecoder()
        while data := await reader.read(65536):
            for frame in decoder.feed(data):
                self._tally(frame, label)

    def _tally(self, frame: object, label: str) -> None:
        if isinstance(frame, Error) and frame.code is ErrorCode.OVERLOADED:
            self.count(f"{label}_flood_overloaded")
        elif isinstance(frame, End):
            self.count(f"{label}_flood_answered")

    async def quic_flood(self) -> None:
        """One stream per PULL of a missing address, 64 streams open at a time."""
        async with connect("127.0.0.1", self.quic_port, configuration=self.quic_config()) as quic:
            slots = asyncio.Semaphore(64)

            async def one(i: int) -> None:
                try:
                    reader, writer = await quic.create_stream()
                    writer.write(encode(Pull(i, (missing(i),))))
                    writer.write_eof()
                    with contextlib.suppress(TimeoutError, ConnectionError):
                        for frame in FrameDecoder().feed(await asyncio.wait_for(reader.read(), 5)):
                            self._tally(frame, "quic")
                finally:
                    slots.release()

            tasks: set[asyncio.Task[None]] = set()
            i = 0
            while self.running:
                await slots.acquire()
                i += 1
                self.count("quic_flood_pulls")
                task = asyncio.create_task(one(i))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.gather(*tasks, return_exceptions=True)

    async def extra_connections(self) -> None:
        """Connections past the per-peer cap: each refused one must hear ERROR overloaded."""
        held = []
        for _ in range(10):
            reader, writer = await asyncio.open_connection("127.0.0.1", self.tcp_port, ssl=self.tls_context(),
                                                           server_hostname=SERVER_NODE)
            writer.write(encode(Hello(ATTACKER)))
            held.append((reader, writer))
        for reader, _ in held:
            with contextlib.suppress(TimeoutError, ConnectionError, ssl.SSLError):
                frames = FrameDecoder().feed(await asyncio.wait_for(reader.read(4096), 3))
                if frames and isinstance(frames[0], Error) and frames[0].code is ErrorCode.OVERLOADED:
                    self.count("connections_refused_overloaded")
        while self.running:
            await asyncio.sleep(0.2)
        for _, writer in held:
            writer.close()

    async def oversize(self) -> None:
        creds = NodeCredentials(CredentialFiles.for_node(self.cert_dir, ATTACKER))
        client = QuicTransportClient(creds, max_payload=1 << 20, frame_timeout_s=5.0)
        try:
            while self.running:
                results = [r async for r in client.pull(Peer(SERVER_NODE, "127.0.0.1", self.quic_port),
                                                        [big_address()])]
                if isinstance(results[0], Miss) and results[0].reason is MissReason.TOO_LARGE:
                    self.count("oversize_too_large")
                await asyncio.sleep(1.0)
        finally:
            await client.close()


async def attack(args: argparse.Namespace) -> dict[str, int]:
    a = Attack(Path(args.cert_dir), args.quic_port, args.tcp_port, args.seconds)
    cases: list[Callable[[], Coroutine[Any, Any, None]]] = [getattr(a, name) for name in args.cases.split(",")]
    results = await asyncio.gather(*(case() for case in cases), return_exceptions=True)
    for case, result in zip(cases, results, strict=True):
        if isinstance(result, BaseException):
            a.count(f"failed_{getattr(case, '__name__', 'case')}")
            print(f"{getattr(case, '__name__', 'case')}: {result!r}", file=sys.stderr)
    return a.counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cert-dir", required=True)
    parser.add_argument("--quic-port", type=int, required=True)
    parser.add_argument("--tcp-port", type=int, required=True)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: " + ", ".join(CASES))
    counts = asyncio.run(attack(parser.parse_args()))
    print(json.dumps(counts, sort_keys=True), flush=True)


if __name__ == "__main__":
    main()
