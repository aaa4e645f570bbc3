"""One kvfabric transport node in a process of its own: a QUIC and a TLS-TCP server over one
in-memory block source, stopped cleanly by SIGTERM. The soak benchmark and the hostile-peer tests
run it, so that a server hung by a peer shows as a process that stops answering.

    .venv/bin/python benchmarks/lib/soak_node.py --cert-dir DIR [--node NAME] [--config node.toml]

stdout: `READY <quic port> <tcp port>` once both listen; then once a second `LAG <max ms> <p99 ms>`
(how late a 10 ms timer on the event loop fired, over the last second); `STOPPED` after SIGTERM.
Blocks: `--blocks` of `--block-size` random bytes at `address(i)`, plus `--big-bytes` at `big_address()`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

import blake3

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.harness import MemorySource, credentials, percentile
from fabric.config import Config
from fabric.keys import BlockAddress, BlockHash
from transports.quic import QuicTransportServer
from transports.tls.server import TlsTcpServer

LAG_TICK_S = 0.01


def address(i: int) -> BlockAddress:
    return BlockAddress(BlockHash(blake3.blake3(b"soak-node-%d" % i).digest()), 0)


def big_address() -> BlockAddress:
    return BlockAddress(BlockHash(blake3.blake3(b"soak-node-big").digest()), 0)


async def _report_lag(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    lags: list[float] = []
    next_report = loop.time() + 1.0
    while not stop.is_set():
        start = loop.time()
        await asyncio.sleep(LAG_TICK_S)
        lags.append(max(0.0, loop.time() - start - LAG_TICK_S) * 1e3)
        if loop.time() >= next_report:
            print(f"LAG {max(lags):.2f} {percentile(lags, 99):.2f}", flush=True)
            lags.clear()
            next_report = loop.time() + 1.0


async def serve(args: argparse.Namespace) -> None:
    config = Config.load(args.config) if args.config else Config()
    creds = credentials(args.cert_dir, args.node)
    source = MemorySource((address(i), os.urandom(args.block_size)) for i in range(args.blocks))
    if args.big_bytes:
        source.put(big_address(), os.urandom(args.big_bytes))
    quic = QuicTransportServer.from_config(config.transport, creds, source)
    tls = TlsTcpServer.from_config(config.transport, creds, source)
    _, quic_port = await quic.start()
    _, tcp_port = await tls.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"READY {quic_port} {tcp_port}", flush=True)
    lag = loop.create_task(_report_lag(stop))
    await stop.wait()
    await lag
    await quic.close()
    await tls.close()
    print("STOPPED", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cert-dir", required=True)
    parser.add_argument("--node", default="node-a")
    parser.add_argument("--config", help="a kvfabric TOML file (its [transport] section sets the servers)")
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=64 * 1024)
    parser.add_argument("--big-bytes", type=int, default=0)
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
