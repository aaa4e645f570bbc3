"""QUIC pull throughput: kvfabric's tuned QUIC transport beside aioquic's default settings.

    .venv/bin/python benchmarks/lib/transfer_quic.py [--quick] [--total-mb 256] [--block-size 1048576]

The server runs in a subprocess (its own interpreter and GIL) on 127.0.0.1 and serves random
1 MiB payloads from memory; the client pulls them with full digest verification. Ours uses
`QuicTuning()` (8952-byte datagrams, large flow-control windows, big socket buffers) and the
1452-byte Ethernet size; the baseline is the same transport and codec with the stock
`QuicConfiguration` values (1200-byte datagrams, 1 MiB windows). Configurations are interleaved
round by round; each run is bounded by a time limit and MB/s is computed on what moved.

The bench_transfer benchmark imports `measure_kvfabric_quic` and `measure_aioquic_default`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import blake3
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from aioquic.asyncio.client import connect
from aioquic.asyncio.server import QuicServer, serve
from aioquic.quic.configuration import QuicConfiguration

from benchmarks import harness
from benchmarks.harness import MemorySource, emit_json, median, print_table
from fabric.keys import BlockAddress, BlockHash
from transports.core.base import Hit, Peer
from transports.core.codec import FrameDecoder, MissReason, Pull, encode, encode_parts, payload_pieces
from transports.core.tracker import PullTracker, answer_pull
from transports.quic import ALPN, QuicTransportClient, QuicTransportServer, QuicTuning
from transports.trust.certs import CA_CERT

logger = logging.getLogger(__name__)

SERVER_NODE = "bench-server"
CLIENT_NODE = "bench-client"
SERVED_BYTES = 64 << 20      # the server holds this much (at least PULL_SIZE blocks); the client cycles
PULL_SIZE = 8                # addresses per PULL stream
WARM_UP_BLOCKS = 4
CONCURRENT_PULLS = 2         # PULL streams in flight on the connection
MB = 1_000_000


def ensure_certs(cert_dir: str | os.PathLike[str]) -> Path:
    """A cluster CA and the benchmark's two node certificates in `cert_dir` (made when missing)."""
    return harness.ensure_certs(cert_dir, (SERVER_NODE, CLIENT_NODE))


def num_blocks(block_size: int) -> int:
    return max(PULL_SIZE, SERVED_BYTES // block_size)


def bench_address(i: int) -> BlockAddress:
    return BlockAddress(BlockHash(blake3.blake3(b"kvfabric-bench-%d" % i).digest()), 0)


def random_source(num_blocks: int, block_size: int) -> MemorySource:
    """The served blocks: random (incompressible) payloads with their digests."""
    return MemorySource((bench_address(i), os.urandom(block_size)) for i in range(num_blocks))


def _tuning(max_datagram_size: int) -> QuicTuning:
    return QuicTuning.aioquic_defaults() if max_datagram_size == 0 else QuicTuning(max_datagram_size)


# -- the baseline: stock aioquic (serve/connect, asyncio stream readers/writers, default
#    QuicConfiguration), carrying the same codec frames and digest checks --------------------


async def _stock_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, source: MemorySource,
                        max_payload: int) -> None:
    decoder = FrameDecoder(max_payload=0)
    pull: Pull | None = None
    while pull is None:
        data = await reader.read(65536)
        if not data:
            writer.close()
            return
        for frame in decoder.feed(data):
            assert isinstance(frame, Pull), "the benchmark client only sends PULL frames"
            pull = frame
    for frame in answer_pull(source, pull):
        head, payload = encode_parts(frame, max_payload=max_payload)
        writer.write(head)
        for piece in payload_pieces(payload):
            if piece:
                writer.write(piece)
    writer.write_eof()


async def _stock_serve(cert_dir: Path, source: MemorySource, max_payload: int) -> tuple[QuicServer, int]:
    config = QuicConfiguration(is_client=False, alpn_protocols=[ALPN])
    config.load_cert_chain(cert_dir / f"{SERVER_NODE}.pem", cert_dir / f"{SERVER_NODE}.key")
    tasks: set[asyncio.Task[None]] = set()

    def on_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.ensure_future(_stock_answer(reader, writer, source, max_payload))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    server = await serve("127.0.0.1", 0, configuration=config, stream_handler=on_stream)
    assert server._transport is not None
    return server, server._transport.get_extra_info("sockname")[1]


async def _stock_pull_throughput(port: int, cert_dir: Path, total_bytes: int, block_size: int,
                                 time_limit_s: float) -> float:
    config = QuicConfiguration(is_client=True, alpn_protocols=[ALPN], server_name=SERVER_NODE)
    config.load_verify_locations(cadata=(cert_dir / CA_CERT).read_bytes())
    counts = {"moved": 0, "misses": 0}
    request_ids = iter(range(1, 1 << 62))
    async with connect("127.0.0.1", port, configuration=config) as protocol:

        async def one_pull(addresses: Sequence[BlockAddress]) -> None:
            reader, writer = await protocol.create_stream()
            rid = next(request_ids)
            writer.write(encode(Pull(rid, tuple(addresses))))
            writer.write_eof()
            tracker = PullTracker(rid, addresses)
            decoder = FrameDecoder(max_payload=max(block_size, 1 << 20))
            while not tracker.done:
                data = await reader.read(1 << 20)
                if not data:
                    tracker.fail(MissReason.PEER_GONE)
                for frame in decoder.feed(data):
                    for result in tracker.on_frame(frame):
                        if isinstance(result, Hit):
                            counts["moved"] += len(result.payload)
                        else:
                            counts["misses"] += 1

        return await _drive(one_pull, counts, total_bytes, block_size, time_limit_s)


# -- the server subprocess -----------------------------------------------------------------


async def _serve(cert_dir: Path, block_size: int, max_datagram_size: int | None, backend: str = "aioquic") -> None:
    """max_datagram_size: ours with that size, 0 ours with stock settings, None stock aioquic."""
    source = random_source(num_blocks(block_size), block_size)
    max_payload = max(block_size, 1 << 20)
    if max_datagram_size is None:
        stock, port = await _stock_serve(cert_dir, source, max_payload)
    else:
        creds = harness.credentials(cert_dir, SERVER_NODE)
        server = QuicTransportServer(creds, source, tuning=_tuning(max_datagram_size), max_payload=max_payload,
                                     backend=backend)
        _, port = await server.start()
    print(f"READY {port}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
    if max_datagram_size is None:
        stock.close()
    else:
        await server.close()


def _start_server(cert_dir: Path, block_size: int, max_datagram_size: int | None,
                  backend: str = "aioquic") -> tuple[subprocess.Popen[str], int]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", "--cert-dir", str(cert_dir),
           "--block-size", str(block_size), "--backend", backend]
    if max_datagram_size is not None:
        cmd += ["--max-datagram-size", str(max_datagram_size)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("READY "):
        proc.kill()
        raise RuntimeError(f"benchmark server did not start (said {line!r})")
    return proc, int(line.split()[1])


def _stop_server(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def _drive(one_pull: Callable[[Sequence[BlockAddress]], Awaitable[None]], counts: dict[str, int],
                 total_bytes: int, block_size: int, time_limit_s: float) -> float:
    """Warm up, then keep CONCURRENT_PULLS pulls going until `total_bytes` moved or time is up."""
    next_block = 0

    def batch(size: int = PULL_SIZE) -> list[BlockAddress]:
        nonlocal next_block
        out = [bench_address((next_block + i) % num_blocks(block_size)) for i in range(size)]
        next_block += size
        return out

    await one_pull(batch(WARM_UP_BLOCKS))  # warm-up: handshake, congestion window, allocator
    counts["moved"] = counts["misses"] = 0
    start = time.perf_counter()
    deadline = start + time_limit_s

    async def worker() -> None:
        while counts["moved"] < total_bytes and time.perf_counter() < deadline:
            await one_pull(batch())

    await asyncio.gather(*(worker() for _ in range(CONCURRENT_PULLS)))
    elapsed = time.perf_counter() - start
    if counts["misses"]:
        logger.warning("%d misses during the run", counts["misses"])
    return counts["moved"] / MB / elapsed


async def _pull_throughput(port: int, cert_dir: Path, total_bytes: int, block_size: int,
                           max_datagram_size: int, time_limit_s: float, backend: str = "aioquic") -> float:
    creds = harness.credentials(cert_dir, CLIENT_NODE)
    client = QuicTransportClient(creds, tuning=_tuning(max_datagram_size), max_payload=max(block_size, 1 << 20),
                                 max_inflight=CONCURRENT_PULLS, backend=backend)
    peer = Peer(SERVER_NODE, "127.0.0.1", port)
    counts = {"moved": 0, "misses": 0}

    async def one_pull(addresses: Sequence[BlockAddress]) -> None:
        async for result in client.pull(peer, addresses):
            if isinstance(result, Hit):
                counts["moved"] += len(result.payload)
            else:
                counts["misses"] += 1

    try:
        return await _drive(one_pull, counts, total_bytes, block_size, time_limit_s)
    finally:
        await client.close()


async def ameasure_kvfabric_quic(total_bytes: int, block_size: int, max_datagram_size: int,
                                 cert_dir: str | os.PathLike[str], time_limit_s: float,
                                 backend: str = "aioquic") -> float:
    """MB/s of verified pulls (mTLS enforced) with kvfabric's QUIC tuning at `max_datagram_size`
    over the QUIC library `backend`."""
    d = ensure_certs(cert_dir)
    proc, port = _start_server(d, block_size, max_datagram_size, backend)
    try:
        return await _pull_throughput(port, d, total_bytes, block_size, max_datagram_size, time_limit_s, backend)
    finally:
        _stop_server(proc)


async def ameasure_aioquic_default(total_bytes: int, block_size: int, cert_dir: str | os.PathLike[str],
                                   time_limit_s: float) -> float:
    """MB/s of the same pulls over stock aioquic: serve/connect, stream readers/writers, default
    QuicConfiguration (1200-byte datagrams, 1 MiB windows), same codec and digest checks."""
    d = ensure_certs(cert_dir)
    proc, port = _start_server(d, block_size, None)
    try:
        return await _stock_pull_throughput(port, d, total_bytes, block_size, time_limit_s)
    finally:
        _stop_server(proc)


async def ameasure_kvfabric_default_settings(total_bytes: int, block_size: int,
                                             cert_dir: str | os.PathLike[str], time_limit_s: float) -> float:
    """MB/s of kvfabric's transport with aioquic's default settings (isolates the tuning's effect)."""
    return await ameasure_kvfabric_quic(total_bytes, block_size, 0, cert_dir, time_limit_s)


def measure_kvfabric_quic(total_bytes: int, block_size: int, max_datagram_size: int,
                          cert_dir: str | os.PathLike[str], time_limit_s: float, backend: str = "aioquic") -> float:
    """Synchronous `ameasure_kvfabric_quic` (max_datagram_size 0: aioquic's default settings)."""
    return asyncio.run(ameasure_kvfabric_quic(total_bytes, block_size, max_datagram_size, cert_dir, time_limit_s,
                                              backend))


def measure_aioquic_default(total_bytes: int, block_size: int, cert_dir: str | os.PathLike[str],
                            time_limit_s: float) -> float:
    return asyncio.run(ameasure_aioquic_default(total_bytes, block_size, cert_dir, time_limit_s))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few seconds (smoke test)")
    parser.add_argument("--total-mb", type=float, default=256.0, help="cap per run")
    parser.add_argument("--block-size", type=int, default=1 << 20)
    parser.add_argument("--time-limit", type=float, default=4.0, help="seconds per run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cert-dir", default=None)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--max-datagram-size", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="aioquic", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.serve:
        asyncio.run(_serve(Path(args.cert_dir), args.block_size, args.max_datagram_size, args.backend))
        return
    rounds, limit, total = (1, 0.5, 32 * MB) if args.quick else (args.rounds, args.time_limit,
                                                                  int(args.total_mb * MB))
    cert_dir = Path(args.cert_dir) if args.cert_dir else Path.home() / ".cache" / "kvfabric" / "bench-certs"
    configs: list[tuple[str, Callable[[], float]]] = [
        ("kvfabric 8952", lambda: measure_kvfabric_quic(total, args.block_size, 8952, cert_dir, limit)),
        ("kvfabric 1452", lambda: measure_kvfabric_quic(total, args.block_size, 1452, cert_dir, limit)),
        ("kvfabric, aioquic default settings", lambda: measure_kvfabric_quic(total, args.block_size, 0,
                                                                             cert_dir, limit)),
        ("stock aioquic (default)", lambda: measure_aioquic_default(total, args.block_size, cert_dir, limit)),
    ]
    samples: dict[str, list[float]] = {name: [] for name, _ in configs}
    with tqdm(total=rounds * len(configs), desc="quic transfer", file=sys.stderr) as bar:
        for _ in range(rounds):
            for name, run in configs:
                samples[name].append(run())
                bar.update()
    result = {name: median(v) for name, v in samples.items()}
    base = result["stock aioquic (default)"]
    print_table(f"QUIC pull of {args.block_size}-byte blocks, server in a subprocess (median of {rounds})",
                ["configuration", "MB/s", "vs stock aioquic"],
                [(name, mb_s, f"{mb_s / base:.1f}x") for name, mb_s in result.items()])
    emit_json({"quic_mb_s": round(result["kvfabric 8952"], 2), "quic_1452_mb_s": round(result["kvfabric 1452"], 2),
               "quic_default_mb_s": round(base, 2),
               "quic_ours_default_settings_mb_s": round(result["kvfabric, aioquic default settings"], 2),
               "speedup": round(result["kvfabric 8952"] / base, 2), "block_size": args.block_size})

if __name__ == "__main__":
    main()
