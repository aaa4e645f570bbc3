"""The measuring end of `bench_network.py`: pulls, single gets and bare streams against the servers of
`network_serve.py`, from whatever network namespace the calling thread is in.

    stream_mb_s      plain TCP or TLS 1.3 stream: one request, `count` blocks back to back
    round_ms         bare TLS request/response of one block (the floor for a single get)
    pull_mb_s        kvfabric pulls of BATCH_BYTES of blocks, PULLS_IN_FLIGHT at a time, every digest verified
    get_ms           kvfabric single-block gets, one after another
    loaded_get_ms    single gets while `num_loaders` pulls of other prefixes run on the same client

Every function is bounded by a time limit and a count; all return what they measured, never raise
on a slow link.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import credentials
from benchmarks.lib.network_serve import CLIENT_NODE, SERVER_NODE, address, num_blocks
from benchmarks.lib.stream_blocks import receive_blocks
from fabric.keys import BlockAddress
from transports.core.base import Hit, Peer, TransportClient
from transports.quic import QuicTransportClient, QuicTuning
from transports.tls.client import TlsTcpClient

MB = 1_000_000
BATCH_BYTES = 8 << 20
PULLS_IN_FLIGHT = 2


@dataclass(frozen=True, slots=True)
class ServerHost:
    """The server host's address and the certificates both ends use."""

    host: str
    cert_dir: Path


def _connect(server: ServerHost, port: int, use_tls: bool) -> socket.socket:
    raw = socket.create_connection((server.host, port), timeout=30)
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if not use_tls:
        return raw
    ctx = credentials(server.cert_dir, CLIENT_NODE).ssl_context(server=False)
    return ctx.wrap_socket(raw, server_hostname=SERVER_NODE)


def stream_mb_s(server: ServerHost, port: int, use_tls: bool, size: int, limit_s: float) -> float:
    """MB/s of a bare stream of `size`-byte blocks, requested BATCH_BYTES at a time for `limit_s`."""
    with _connect(server, port, use_tls) as conn:
        buf = memoryview(bytearray(size))
        receive_blocks(conn, size, 2, buf)   # warm-up: handshake, windows
        step = max(1, BATCH_BYTES // size)
        moved, start = 0, time.perf_counter()
        while time.perf_counter() - start < limit_s:
            moved += receive_blocks(conn, size, step, buf)
        return moved / MB / (time.perf_counter() - start)


def round_ms(server: ServerHost, port: int, size: int, count: int, limit_s: float) -> list[float]:
    """Bare TLS request/response rounds of one `size`-byte block, in milliseconds."""
    with _connect(server, port, True) as conn:
        buf = memoryview(bytearray(size))
        receive_blocks(conn, size, 1, buf)
        times: list[float] = []
        start = time.perf_counter()
        while len(times) < count and time.perf_counter() - start < limit_s:
            t0 = time.perf_counter()
            receive_blocks(conn, size, 1, buf)
            times.append((time.perf_counter() - t0) * 1e3)
        return times


def make_client(kind: str, server: ServerHost, tuning: QuicTuning | None = None) -> TransportClient:
    creds = credentials(server.cert_dir, CLIENT_NODE)
    if kind == "tls_tcp":
        return TlsTcpClient(creds)
    return QuicTransportClient(creds, tuning=tuning, frame_timeout_s=30.0)


async def _pull(client: TransportClient, peer: Peer, addresses: Sequence[BlockAddress]) -> int:
    moved = 0
    async for result in client.pull(peer, addresses):
        if not isinstance(result, Hit):
            raise RuntimeError(f"pull over {peer} missed {result}: the benchmark counts only hits")
        moved += len(result.payload)
    return moved


def _batch(size: int, first: int, count: int, lo: int = 0, hi: int | None = None) -> list[BlockAddress]:
    """`count` addresses of `size` blocks from `first`, cycling within blocks [lo, hi)."""
    hi = num_blocks(size) if hi is None else hi
    return [address(size, lo + (first + i) % (hi - lo)) for i in range(count)]


async def pull_mb_s(client: TransportClient, peer: Peer, size: int, limit_s: float) -> float:
    """MB/s of verified pulls of BATCH_BYTES each, PULLS_IN_FLIGHT at a time, for `limit_s`."""
    step = max(1, BATCH_BYTES // size)
    await _pull(client, peer, _batch(size, 0, 2))   # warm-up: connect, handshake
    state = {"moved": 0, "next": 0}
    start = time.perf_counter()

    async def worker() -> None:
        while time.perf_counter() - start < limit_s:
            first = state["next"]
            state["next"] += step
            got = await _pull(client, peer, _batch(size, first, step))
            state["moved"] += got   # after the await: `+= await` would add to a stale total

    await asyncio.gather(*(worker() for _ in range(PULLS_IN_FLIGHT)))
    return state["moved"] / MB / (time.perf_counter() - start)


async def get_ms(client: TransportClient, peer: Peer, size: int, count: int, limit_s: float) -> list[float]:
    """Single-block gets one after another, in milliseconds."""
    await _pull(client, peer, _batch(size, 0, 1))
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < count and time.perf_counter() - start < limit_s:
        t0 = time.perf_counter()
        await _pull(client, peer, _batch(size, len(times), 1))
        times.append((time.perf_counter() - t0) * 1e3)
    return times


async def loaded_get_ms(client: TransportClient, peer: Peer, size: int, num_loaders: int,
                        count: int, limit_s: float) -> tuple[list[float], float]:
    """Single gets of `size` blocks while `num_loaders` pulls of 1 MiB blocks, each over its own
    prefix (a disjoint range of blocks), run on the same client. Returns the get times (ms) and the
    loaders' MB/s."""
    big = 1 << 20
    span = num_blocks(big) // num_loaders
    step = max(1, BATCH_BYTES // big // 2)
    await _pull(client, peer, _batch(size, 0, 1))
    state = {"moved": 0, "done": 0}

    async def loader(k: int) -> None:
        first = 0
        while not state["done"]:
            got = await _pull(client, peer, _batch(big, first, step, k * span, (k + 1) * span))
            state["moved"] += got
            first += step

    start = time.perf_counter()
    loaders = [asyncio.create_task(loader(k)) for k in range(num_loaders)]
    times: list[float] = []
    try:
        await asyncio.sleep(0.1)   # the loaders' windows open before the first get
        while len(times) < count and time.perf_counter() - start < limit_s:
            t0 = time.perf_counter()
            await _pull(client, peer, _batch(size, len(times), 1))
            times.append((time.perf_counter() - t0) * 1e3)
            await asyncio.sleep(0.005)
    finally:
        state["done"] = 1
        await asyncio.gather(*loaders)
    return times, state["moved"] / MB / (time.perf_counter() - start)
