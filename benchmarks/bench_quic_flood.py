"""An unauthenticated QUIC Initial flood against kvfabric's QUIC server: its memory and a good client's pulls.

    .venv/bin/python benchmarks/bench_quic_flood.py [--quick] [--count 8000] [--rate 600]

A server that makes a connection for every unauthenticated Initial grows by hundreds of MiB under
such a flood and, when the half-open connections expire, stalls its event loop for seconds (figures
in docs/benchmarks.md). This measures the attack against three server settings, each in a fresh
server subprocess on 127.0.0.1:

    retry           Retry (address validation) on, half-open cap 128: the default
    no_retry_cap    Retry off, half-open cap 128
    no_retry_open   Retry off, no cap (the unprotected server, for comparison)

A flooder subprocess sends `--count` real Initials (each a new aioquic client connection that never
goes on) at `--rate` per second from one UDP socket. Meanwhile a good client (a cluster certificate)
pulls 4 blocks of 64 KiB every 50 ms over its pooled connection. The flood's half-open connections
expire after the server's `idle_timeout_s` (3 s here); the run goes on until then plus 2 s. Reported
per setting: server RSS before, at its peak and at the end (MiB, /proc), the good client's pull
latency p50 / p99 / max (ms) and its failed pulls, and how long sending the flood took (`flood_s`:
above count / rate when the flooder could not keep the rate). A table, then one JSON line. Client, flooder and
server share this machine's cores: the latencies include that contention.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import blake3

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection

from benchmarks.harness import MemorySource, credentials, emit_json, ensure_certs, percentile, print_table, rss_mib
from benchmarks.lib.transfer_baselines import stop_process
from fabric.keys import BlockAddress, BlockHash
from transports.core.base import Hit, Peer
from transports.quic import ALPN, QuicTransportClient, QuicTransportServer

SERVER_NODE, CLIENT_NODE = "flood-server", "flood-client"
SETTINGS = {"retry": (True, 128), "no_retry_cap": (False, 128), "no_retry_open": (False, 1 << 30)}
IDLE_TIMEOUT_S = 3.0
BLOCK_SIZE, NUM_BLOCKS, PULL_BLOCKS, PULL_EVERY_S = 64 << 10, 16, 4, 0.05


def address(i: int) -> BlockAddress:
    return BlockAddress(BlockHash(blake3.blake3(b"quic-flood-%d" % i).digest()), 0)


async def _serve(cert_dir: Path, retry: bool, cap: int) -> None:
    source = MemorySource((address(i), os.urandom(BLOCK_SIZE)) for i in range(NUM_BLOCKS))
    server = QuicTransportServer(credentials(cert_dir, SERVER_NODE), source, retry=retry, max_half_open=cap,
                                 idle_timeout_s=IDLE_TIMEOUT_S)
    _, port = await server.start()
    print(f"READY {port}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
    await server.close()


def _flood(port: int, count: int, rate: float) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    config = QuicConfiguration(is_client=True, alpn_protocols=[ALPN], server_name=SERVER_NODE)
    start = time.monotonic()
    for i in range(count):
        quic = QuicConnection(configuration=config)
        quic.connect(("127.0.0.1", port), now=0.0)
        for data, addr in quic.datagrams_to_send(now=0.0):
            sock.sendto(data, addr)
        ahead = start + (i + 1) / rate - time.monotonic()
        if ahead > 0:
            time.sleep(ahead)
    sock.close()


def _child(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


async def one_setting(cert_dir: Path, name: str, count: int, rate: float) -> dict[str, float | int | None]:
    retry, cap = SETTINGS[name]
    server = _child("--serve", "--cert-dir", str(cert_dir), "--retry", str(int(retry)), "--cap", str(cap))
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        if not line.startswith("READY "):
            raise RuntimeError(f"server did not start (said {line!r})")
        peer = Peer(SERVER_NODE, "127.0.0.1", int(line.split()[1]))
        client = QuicTransportClient(credentials(cert_dir, CLIENT_NODE), frame_timeout_s=5.0, connect_timeout_s=5.0)
        wanted = [address(i) for i in range(PULL_BLOCKS)]
        latencies: list[float] = []
        failed = 0

        async def pull() -> None:
            nonlocal failed
            start = time.perf_counter()
            results = [r async for r in client.pull(peer, wanted)]
            latencies.append((time.perf_counter() - start) * 1e3)
            failed += not all(isinstance(r, Hit) for r in results)

        for _ in range(5):  # warm up: connect, handshake, first pulls
            await pull()
        latencies.clear()
        pid = server.pid
        before = rss_mib(pid)
        peak = before or 0.0
        flooder = _child("--flood", str(peer.port), "--count", str(count), "--rate", str(rate))
        started = time.monotonic()
        flood_s: float | None = None
        try:
            # until the flood is over and its half-open connections have expired, plus 2 s
            while flood_s is None or time.monotonic() < started + flood_s + IDLE_TIMEOUT_S + 2.0:
                await pull()
                peak = max(peak, rss_mib(pid) or 0.0)
                if flood_s is None and flooder.poll() is not None:
                    flood_s = time.monotonic() - started
                await asyncio.sleep(PULL_EVERY_S)
        finally:
            flooder.wait()
            await client.close()
        end = rss_mib(pid)
    finally:
        if server.stdin is not None:
            server.stdin.close()
        stop_process(server)
    return {"rss_before_mib": _r(before), "rss_peak_mib": _r(peak), "rss_end_mib": _r(end),
            "pull_p50_ms": _r(percentile(latencies, 50)), "pull_p99_ms": _r(percentile(latencies, 99)),
            "pull_max_ms": _r(max(latencies)), "failed_pulls": failed, "pulls": len(latencies),
            "flood_s": _r(flood_s)}


def _r(value: float | None) -> float | None:
    return round(value, 1) if value is not None else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="500 Initials at 250/s (smoke test)")
    parser.add_argument("--count", type=int, default=8000, help="Initials sent")
    parser.add_argument("--rate", type=float, default=600.0, help="Initials per second")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cert-dir", help=argparse.SUPPRESS)
    parser.add_argument("--retry", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--cap", type=int, default=128, help=argparse.SUPPRESS)
    parser.add_argument("--flood", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(_serve(Path(args.cert_dir), bool(args.retry), args.cap))
        return
    if args.flood:
        _flood(args.flood, args.count, args.rate)
        return
    count, rate = (500, 250.0) if args.quick else (args.count, args.rate)
    with tempfile.TemporaryDirectory(prefix="kvfabric-quic-flood-") as tmp:
        cert_dir = ensure_certs(tmp, (SERVER_NODE, CLIENT_NODE), days=1)
        result = {name: asyncio.run(one_setting(cert_dir, name, count, rate)) for name in SETTINGS}
    columns = ["rss_before_mib", "rss_peak_mib", "rss_end_mib", "pull_p50_ms", "pull_p99_ms", "pull_max_ms",
               "failed_pulls", "pulls", "flood_s"]
    print_table(f"QUIC Initial flood: {count} Initials at {rate:.0f}/s; a good client pulls "
                f"{PULL_BLOCKS} x 64 KiB every {PULL_EVERY_S * 1e3:.0f} ms",
                ["server setting", *columns],
                [[name, *(r[c] if r[c] is not None else "-" for c in columns)] for name, r in result.items()])
    out: dict[str, object] = {f"{name}_{key}": value for name, r in result.items() for key, value in r.items()}
    out.update(count=count, rate=rate, quick=args.quick)
    emit_json(out)


if __name__ == "__main__":
    main()
