"""An engine actor's process is tuned for sharing its node's cores with the fabric: it keeps the
memory of a dropped KV cache for its next request (`HFEngineActor(keep_freed_mib=...)`, through
`buffers.tune_allocator`), and its OpenMP threads stop spinning soon after they run out of work
(`spawn_engines(omp_spin_count=...)`). Each case runs in a fresh interpreter, since both settings
are process-wide and fixed once made."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]

# An engine's request, the way `HFEngine` builds a KV cache: per layer, K and V of the whole prompt
# as fresh tensors (SmolLM2 at 4k tokens: 30 layers x 2 x 3.2 MB), dropped when the request ends.
# Prints the minor page faults of the last three requests. With `threads`, each request runs on a
# thread of its own, as in the engine's threaded Ray actor (a pool of executor threads).
ENGINE_PROBE = """
import resource, sys, threading
sys.path.insert(0, {root!r})
import torch
from transports.core.buffers import tune_allocator
from cluster.engines.hf.actor import KEEP_FREED_MIB
if {tune}:
    assert tune_allocator(trim_threshold=KEEP_FREED_MIB << 20)
def request():
    cache = []
    for _ in range(30):
        k, v = torch.empty(1, 3, 4112, 64), torch.empty(1, 3, 4112, 64)
        k.fill_(1.0)
        v.fill_(1.0)
        cache.append((k, v))
def run(job):
    if {threads}:
        t = threading.Thread(target=job)
        t.start()
        t.join()
    else:
        job()
run(request)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    run(request)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt thresholds are glibc (Linux) only")
def test_an_engine_keeps_its_freed_kv_cache_memory_for_the_next_request() -> None:
    def engine_faults(tune: bool) -> int:
        out = subprocess.run([sys.executable, "-c", ENGINE_PROBE.format(root=str(ROOT), tune=tune, threads=False)],
                             capture_output=True, text=True, timeout=120, check=True)
        return int(out.stdout.strip())

    untuned, tuned = engine_faults(False), engine_faults(True)
    # Untuned, the trimmed heap is faulted back in (tens of thousands of faults); kept, only a few
    # 3 MB tensors still come back from the kernel (counts in docs/benchmarks.md).
    assert untuned >= 30_000
    assert tuned * 5 < untuned, f"{tuned} page faults for three requests into kept heap memory, {untuned} untuned"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc arenas are glibc (Linux) only")
def test_an_engine_actor_keeps_freed_memory_whichever_of_its_threads_runs_the_next_request() -> None:
    from cluster.engines.hf.actor import engine_env_vars

    def threaded_faults(env_vars: dict[str, str]) -> int:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env_vars
        out = subprocess.run([sys.executable, "-c", ENGINE_PROBE.format(root=str(ROOT), tune=True, threads=True)],
                             env=env, capture_output=True, text=True, timeout=120, check=True)
        return int(out.stdout.strip())

    bare, engine = threaded_faults({}), threaded_faults(engine_env_vars())
    # Bare, each thread allocates from an arena of its own, so the memory the previous request freed
    # (in another thread's arena) is not reused: the cache is faulted in again, zeroed by the kernel.
    assert bare >= 30_000
    assert engine * 5 < bare, f"{engine} page faults for three requests on fresh threads, {bare} without the settings"


# An engine waiting between parallel torch kernels, the way a layer-wise forward pass waits for its
# next layer: a kernel on both threads, then 3 ms with nothing to run. Prints the CPU seconds used.
WAIT_PROBE = """
import time, torch
torch.set_num_threads(2)
a, b, out = torch.randn(1 << 20), torch.randn(1 << 20), torch.empty(1 << 20)
for _ in range(20):
    torch.add(a, b, out=out)
start = time.process_time()
for _ in range(200):
    torch.add(a, b, out=out)
    time.sleep(0.003)
print(time.process_time() - start)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="GOMP_SPINCOUNT is libgomp's (torch's Linux builds)")
def test_an_engines_idle_openmp_threads_leave_the_cores_to_the_fabric() -> None:
    from cluster.engines.hf.actor import OMP_SPIN_COUNT

    def waiting_cpu_s(spin_count: int | None) -> float:
        env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
        if spin_count is not None:
            env["GOMP_SPINCOUNT"] = str(spin_count)
        out = subprocess.run([sys.executable, "-c", WAIT_PROBE], env=env, capture_output=True, text=True,
                             timeout=120, check=True)
        return float(out.stdout.strip())

    default, tuned = waiting_cpu_s(None), waiting_cpu_s(OMP_SPIN_COUNT)
    # With libgomp's default the second thread spins milliseconds after every kernel; tuned, what is
    # left is the kernels themselves and the sleeps' bookkeeping (figures in docs/benchmarks.md).
    assert tuned * 2 < default, f"{tuned:.2f} s of CPU tuned, {default:.2f} s with libgomp's default spin"
