"""What `bench_transfer.py` charges each method besides time: system calls, the crypto floor, and
the latency of one block.

    SyscallCounter   system calls of one process over a timed window, counted by the kernel: one
                     `perf stat -e raw_syscalls:sys_enter` per process, attached by PID, started
                     disabled and switched on and off through its control FIFO (no ptrace, no
                     wrapper in the measured code; the switch itself costs a few calls). Two
                     figures: every system call, and those that move bytes through a socket
                     (read, write, readv, writev, recvfrom, sendto, recvmsg, sendmsg and their
                     mmsg forms). None where perf or its syscall tracepoint is unavailable. The
                     same perf also counts the process's CPU time (task-clock, in nanoseconds:
                     /proc counts another process's CPU in 10 ms ticks).
    crypto_ms_per_mib  in this process: AES-256-GCM seal and open of random payloads in 16 KiB
                     records (cryptography's AESGCM, OpenSSL underneath, as TLS 1.3 uses), and
                     BLAKE3 of each payload: with the plain TCP method's CPU per MiB of the same
                     round, the floor of an encrypted, verified pull (measured again each round, so
                     that a method's CPU is set against a floor taken beside it).
    get_latencies    one block at a time on a warm connection: a kvfabric pull against the same
                     bytes asked of socket servers (a bare TLS socket, the record layer alone),
                     interleaved.
    cores_apart      while one-block gets are timed: the client on one CPU, every server on another.
                     A get hands its bytes from one process to the other and back; left to the
                     scheduler, whether the two ends share a core changes from run to run, and with
                     it every method's time, so that a ratio of two methods' p50s does not hold from
                     one run to the next (docs/benchmarks.md). Pinned, each method is timed with its
                     ends on two cores.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path

import blake3
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

logger = logging.getLogger(__name__)

TLS_RECORD = 16 * 1024
WARM_UP_GETS = 5
# x86-64 numbers of the system calls that move socket bytes (tracepoint filters take numbers)
_DATA_SYSCALLS_X86_64 = (0, 1, 19, 20, 44, 45, 46, 47, 299, 307)   # read write readv writev sendto recvfrom
#                                                                   sendmsg recvmsg recvmmsg sendmmsg


def _perf_works() -> bool:
    perf = shutil.which("perf")
    if perf is None:
        return False
    try:
        probe = subprocess.run([perf, "stat", "-x", ",", "-e", "raw_syscalls:sys_enter", "--", "true"],
                               capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0 and "raw_syscalls:sys_enter" in probe.stderr and "<not" not in probe.stderr


_PERF_OK: bool | None = None


def syscalls_countable() -> bool:
    """True when `perf` can count this machine's system calls (checked once)."""
    global _PERF_OK
    if _PERF_OK is None:
        _PERF_OK = _perf_works()
        if not _PERF_OK:
            logger.warning("perf cannot count system calls here (absent, or no access to raw_syscalls): "
                           "system call figures left null")
    return _PERF_OK


class SyscallCounter:
    """System calls and CPU time of process `pid` between `enable()` and `disable()`; `close()`
    returns (all calls, socket-data calls, CPU seconds), each None if perf could not count it."""

    def __init__(self, pid: int) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="kvfabric-perf-"))
        ctl, ack = self._dir / "ctl", self._dir / "ack"
        os.mkfifo(ctl)
        os.mkfifo(ack)
        events = ["-e", "task-clock", "-e", "raw_syscalls:sys_enter"]
        if platform.machine() == "x86_64":
            ids = " || ".join(f"id == {n}" for n in _DATA_SYSCALLS_X86_64)
            events += ["-e", "raw_syscalls:sys_enter", "--filter", ids]
        self._proc = subprocess.Popen(["perf", "stat", "-x", ",", *events, "-D", "-1",
                                       "--control", f"fifo:{ctl},{ack}", "-p", str(pid)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self._ctl = open(ctl, "w")   # noqa: SIM115 (held open until close(): perf reads commands from it)
        self._ack = open(ack)        # noqa: SIM115

    def _command(self, what: str) -> None:
        self._ctl.write(what + "\n")
        self._ctl.flush()
        self._ack.readline()   # perf answers once the events are switched

    def enable(self) -> None:
        self._command("enable")

    def disable(self) -> None:
        self._command("disable")

    def close(self) -> tuple[int | None, int | None, float | None]:
        self._ctl.close()
        self._ack.close()
        self._proc.send_signal(2)
        try:
            _, err = self._proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            _, err = self._proc.communicate()
        shutil.rmtree(self._dir, ignore_errors=True)
        counts: list[int | None] = []
        cpu_s: float | None = None
        for line in err.splitlines():
            fields = line.split(",")
            if len(fields) > 2 and fields[2] == "raw_syscalls:sys_enter":
                counts.append(int(fields[0]) if fields[0].isdigit() else None)
            elif len(fields) > 2 and fields[2] == "task-clock":
                with contextlib.suppress(ValueError):   # "<not counted>"
                    cpu_s = float(fields[0]) / 1e3      # perf reports milliseconds
        while len(counts) < 2:
            counts.append(None)
        return counts[0], counts[1], cpu_s


class Syscalls:
    """The counters of a client and a server process over one timed window (see `Window`)."""

    def __init__(self, client_pid: int, server_pid: int | None) -> None:
        self.counters = {"client": SyscallCounter(client_pid)}
        if server_pid is not None:
            self.counters["server"] = SyscallCounter(server_pid)
        self.all: dict[str, int | None] = {}
        self.data: dict[str, int | None] = {}
        self.cpu_s: dict[str, float | None] = {}   # CPU seconds of each end over the window

    def enable(self) -> None:
        for counter in self.counters.values():
            counter.enable()

    def disable(self) -> None:
        for counter in self.counters.values():
            counter.disable()

    def close(self) -> None:
        for end, counter in self.counters.items():
            self.all[end], self.data[end], self.cpu_s[end] = counter.close()

    def total(self, data: bool) -> int | None:
        """Both ends' calls (None unless both were counted)."""
        counts = self.data if data else self.all
        if set(counts) != {"client", "server"} or None in counts.values():
            return None
        return sum(c for c in counts.values() if c is not None)


def crypto_ms_per_mib(blocks: Sequence[bytes], passes: int = 1) -> tuple[float, float]:
    """(AES-256-GCM seal + open in TLS-sized records, BLAKE3 of each block): CPU ms per MiB in
    this process, the fastest of `passes` passes over `blocks` (distinct random payloads of one size)."""
    block_size = len(blocks[0])
    mib = len(blocks) * block_size / (1 << 20)
    aead, nonce = AESGCM(os.urandom(32)), os.urandom(12)
    seal_open, hashing = [], []
    for _ in range(passes):
        start = time.process_time()
        for block in blocks:
            view = memoryview(block)
            for i in range(0, block_size, TLS_RECORD):
                aead.decrypt(nonce, aead.encrypt(nonce, view[i:i + TLS_RECORD], None), None)
        seal_open.append((time.process_time() - start) * 1e3 / mib)
        start = time.process_time()
        for block in blocks:
            blake3.blake3(block).digest()
        hashing.append((time.process_time() - start) * 1e3 / mib)
    return round(min(seal_open), 4), round(min(hashing), 4)


async def get_latencies(kvfabric_get: Callable[[], Awaitable[None]], socket_gets: Sequence[Callable[[], None]],
                        samples: int) -> tuple[list[float], list[list[float]]]:
    """Seconds of `samples` calls of each, interleaved, on the running event loop (a socket get
    blocks it meanwhile): the kvfabric get's, and each socket get's; a few warm-up calls of each first."""
    for _ in range(WARM_UP_GETS):
        await kvfabric_get()
        for get in socket_gets:
            get()
    ours: list[float] = []
    theirs: list[list[float]] = [[] for _ in socket_gets]
    for _ in range(samples):
        start = time.perf_counter()
        await kvfabric_get()
        ours.append(time.perf_counter() - start)
        for get, times in zip(socket_gets, theirs, strict=True):
            start = time.perf_counter()
            get()
            times.append(time.perf_counter() - start)
    return ours, theirs


def _threads(pid: int) -> list[int]:
    """The thread ids of process `pid` (none once it is gone)."""
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


@contextlib.contextmanager
def cores_apart(server_pids: Sequence[int]) -> Iterator[bool]:
    """Within the block, the calling thread runs on one CPU and every thread of each of
    `server_pids` on another (see the module docstring); each thread's own CPU set is given back
    after it. Yields False, pinning nothing, where fewer than two CPUs are available or the platform
    has no `sched_setaffinity`."""
    setaffinity = getattr(os, "sched_setaffinity", None)
    cpus = sorted(os.sched_getaffinity(0)) if setaffinity is not None else []
    if setaffinity is None or len(cpus) < 2:
        yield False
        return
    client, server = cpus[0], cpus[1]
    saved: list[tuple[int, set[int]]] = []
    try:
        for tid, cpu in [(0, client)] + [(tid, server) for pid in server_pids for tid in _threads(pid)]:
            with contextlib.suppress(ProcessLookupError):   # a thread that ended meanwhile
                saved.append((tid, os.sched_getaffinity(tid)))
                setaffinity(tid, {cpu})
        yield True
    finally:
        for tid, mask in saved:
            with contextlib.suppress(ProcessLookupError):
                setaffinity(tid, mask)
