"""`transfer_costs.cores_apart`: the one-block gets of bench_transfer.py are timed with the client on one CPU
and every thread of every server on another, and each thread gets its own CPU set back afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks.lib.transfer_costs import cores_apart

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs (this machine offers one)")

# A server stand-in with a second thread: both must be pinned.
SERVER = """
import threading, time, sys
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("READY", flush=True)
sys.stdin.read()
"""


def _thread_masks(pid: int) -> dict[int, set[int]]:
    return {int(tid): os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def test_the_client_and_every_server_thread_run_on_two_cpus_and_get_their_sets_back() -> None:
    before_client = os.sched_getaffinity(0)
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().startswith("READY")
        deadline = time.monotonic() + 10
        while len(os.listdir(f"/proc/{server.pid}/task")) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        before_server = _thread_masks(server.pid)
        assert len(before_server) == 2
        with cores_apart([server.pid]) as pinned:
            assert pinned
            client_cpus = os.sched_getaffinity(0)
            server_cpus = set().union(*_thread_masks(server.pid).values())
            assert len(client_cpus) == 1 and len(server_cpus) == 1
            assert client_cpus != server_cpus
            assert client_cpus | server_cpus <= before_client
        assert os.sched_getaffinity(0) == before_client
        assert _thread_masks(server.pid) == before_server
    finally:
        server.stdin.close()   # type: ignore[union-attr]
        server.wait(timeout=30)


def test_a_server_gone_before_the_pinning_is_no_error() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    before = os.sched_getaffinity(0)
    with cores_apart([gone.pid]) as pinned:
        assert pinned and len(os.sched_getaffinity(0)) == 1
    assert os.sched_getaffinity(0) == before
