"""An engine per Ray node: `HFEngine` in a Ray actor pinned to its node, KV through that node's fabric.

    driver ──serve(tokens)──► HFEngineActor (node k) ──FabricClient──► NodeActor (node k) ──pull──► peers
                                 ├─ fabric answer: layer-wise load + suffix prefill + greedy decode
                                 └─ recompute answer: the same prompt with no fabric, the baseline

The actor loads a plain float checkpoint (`save_checkpoint`) so that N engines do not each spend
long seconds dequantising a GGUF file. It keeps up to `keep_freed_mib` of freed memory in its heap:
each request builds a KV cache the size of its prompt and drops it, and with glibc's defaults the
next request page-faults all of it back in, zeroed by the kernel, at a CPU cost that grows with the
prompt; with the heap kept, almost none after the first request of a size (docs/benchmarks.md). Requests run on
the threads of a threaded actor, so the process keeps one malloc arena for all of them (an arena per
thread would hold each request's freed cache where the next request, on another thread, cannot reuse
it).

Its OpenMP threads (torch's CPU kernels, libgomp) also spin for less time when they run out of work
(`omp_spin_count`): by default an idle worker thread busy-waits a long while before sleeping,
which in an engine is every wait for a layer, for the fabric and between requests, on the same
cores as the node's NodeActor, where perf shows it as a large share of a layer-wise engine's CPU.
A lower spin count cuts the CPU and TTFT of pulls (docs/benchmarks.md).
libgomp reads the setting when it loads, so it travels in the actor's `runtime_env`,
not through `__init__`.

Results cross back as an `Answer` (small: token ids, the first token's logits and counters), never
as a cache.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.api import AuditReport, EngineLoad
from cluster.client import FabricClient
from cluster.engines.hf.engine import Generation, HFEngine, LoadMode, load_checkpoint
from cluster.engines.load_gate import LoadGate
from fabric.keys import Namespace
from transports.core.buffers import tune_allocator

MAX_ACCEPTED = 16       # requests an engine actor accepts at once (they compute one at a time)
KEEP_FREED_MIB = 1024   # several 4k-token caches of a small model; 0 leaves glibc's defaults
OMP_SPIN_COUNT = 10_000  # libgomp's GOMP_SPINCOUNT for engine processes; None leaves its default (300k)


@dataclass(frozen=True, slots=True)
class Answer:
    """One request's outcome on one engine."""

    node_id: str
    tokens: list[int]              # greedy answer, without the prompt
    logits: np.ndarray             # float32 [vocab], first answer token's
    num_tokens: int                # prompt tokens
    num_reused_tokens: int         # from the fabric: local tiers plus pulls
    num_pulled_tokens: int         # of those, pulled from a peer
    pulled_bytes: int
    sources: tuple[str, ...]
    ttft_s: float
    load_s: float                  # of which waiting for a whole-prefix load (0 when layer-wise)
    fell_back: bool
    overlap_s: float = 0.0         # layer-wise: compute done while later layers were still arriving
    audit: AuditReport | None = None   # the load was sampled: the prefix was computed and compared

    @classmethod
    def of(cls, node_id: str, gen: Generation) -> Answer:
        pre = gen.prefill
        return cls(node_id, gen.tokens, pre.logits.numpy().copy(), pre.num_tokens, pre.num_reused_tokens,
                   pre.num_pulled_tokens, pre.pulled_bytes, pre.sources, pre.ttft_s, pre.load_s, pre.fell_back,
                   pre.overlap_s, pre.audit)


class HFEngineActor:
    """The actor body (`spawn_engines` wraps it with `ray.remote`). Requests are accepted concurrently
    (a threaded actor) and computed one at a time; the engine's load (requests running and queued,
    prompt tokens not yet computed) goes to its NodeActor on every change, where routers read it."""

    def __init__(self, checkpoint: str, *, fingerprint: str, model_id: str, block_size: int,
                 num_threads: int | None = None, namespace: str = "kvfabric",
                 keep_freed_mib: int = KEEP_FREED_MIB) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)
        if keep_freed_mib > 0:
            tune_allocator(trim_threshold=keep_freed_mib << 20)
        model = load_checkpoint(checkpoint)
        self.node_id = str(ray.get_runtime_context().get_node_id())
        self.fabric = FabricClient.connect(namespace=namespace)
        self.engine = HFEngine(model, self.fabric, block_size=block_size, fingerprint=fingerprint,
                               model_id=model_id)
        self.baseline = HFEngine(model, None, block_size=block_size, fingerprint=fingerprint, model_id=model_id)
        self.gate = LoadGate(self.fabric.report_load)

    def load(self) -> EngineLoad:
        return self.gate.load()

    def node(self) -> str:
        return self.node_id

    def omp_spin_count(self) -> str | None:
        """GOMP_SPINCOUNT as this process started with it (None: libgomp's default)."""
        return os.environ.get("GOMP_SPINCOUNT")

    def namespace(self) -> Namespace:
        return self.engine.namespace

    def answer(self, tokens: Sequence[int], max_new_tokens: int, *, eos_token_id: int | None = None,
               mode: str = LoadMode.LAYERWISE.value, export: bool = True, deadline_s: float | None = None) -> Answer:
        """Prefill through the fabric (`mode`; a plain load's pulls cut at `deadline_s`, by default the
        node's own break-even estimate), export the new blocks, decode greedily."""
        with self.gate.request(len(tokens)):
            self.engine.deadline_s = deadline_s   # under the compute lock: this request's setting
            gen = self.engine.generate(tokens, max_new_tokens, mode=LoadMode(mode), eos_token_id=eos_token_id,
                                       export=export)
        return Answer.of(self.node_id, gen)

    def recompute(self, tokens: Sequence[int], max_new_tokens: int, *, eos_token_id: int | None = None) -> Answer:
        """The baseline: the same prompt computed from scratch, nothing read from or written to the fabric
        (its prefill time is reported: it is this node's rate for the model)."""
        with self.gate.request(len(tokens)):
            gen = self.baseline.generate(tokens, max_new_tokens, eos_token_id=eos_token_id)
        self.fabric.report_prefill(self.engine.namespace, gen.prefill.num_tokens, gen.prefill.ttft_s)
        return Answer.of(self.node_id, gen)

    def serve(self, tokens: Sequence[int], max_new_tokens: int, *, eos_token_id: int | None = None,
              mode: str = LoadMode.LAYERWISE.value, deadline_s: float | None = None) -> tuple[Answer, Answer]:
        """(fabric answer, recompute answer) for one request, measured one after the other here."""
        return (self.answer(tokens, max_new_tokens, eos_token_id=eos_token_id, mode=mode, deadline_s=deadline_s),
                self.recompute(tokens, max_new_tokens, eos_token_id=eos_token_id))


def engine_env_vars(omp_spin_count: int | None = OMP_SPIN_COUNT) -> dict[str, str]:
    """The environment an engine process starts with (libgomp and glibc read it once, at load);
    the same variable in the driver's environment wins."""
    env: dict[str, str] = {}
    spin = os.environ.get("GOMP_SPINCOUNT", None if omp_spin_count is None else str(omp_spin_count))
    if spin is not None:
        env["GOMP_SPINCOUNT"] = spin
    # One malloc arena for every thread: requests run on whichever of the actor's executor threads is
    # free, and with an arena per thread the memory one request freed is not where the next one
    # allocates, so the kept heap (`keep_freed_mib`) would be faulted in again on every request.
    env["MALLOC_ARENA_MAX"] = os.environ.get("MALLOC_ARENA_MAX", "1")
    return env


def spawn_engines(node_ids: Sequence[str], checkpoint: str, *, fingerprint: str, model_id: str, block_size: int,
                  num_threads: int | None = None, namespace: str = "kvfabric",
                  keep_freed_mib: int = KEEP_FREED_MIB, omp_spin_count: int | None = OMP_SPIN_COUNT,
                  ) -> dict[str, ray.actor.ActorHandle]:
    """One `HFEngineActor` pinned to each node (hard affinity); returns once every one has loaded.

    The engines' processes start with `engine_env_vars(omp_spin_count)` (merged into the job's
    runtime_env): GOMP_SPINCOUNT and one malloc arena."""
    remote = ray.remote(num_cpus=0, max_concurrency=MAX_ACCEPTED)(HFEngineActor)
    options: dict[str, object] = {"runtime_env": {"env_vars": engine_env_vars(omp_spin_count)}}
    handles = {
        node_id: remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                                **options).remote(
            checkpoint, fingerprint=fingerprint, model_id=model_id, block_size=block_size,
            num_threads=num_threads, namespace=namespace, keep_freed_mib=keep_freed_mib)
        for node_id in node_ids
    }
    placed = ray.get([h.node.remote() for h in handles.values()])
    if placed != list(handles):
        raise RuntimeError(f"engine actors landed on {placed}, pinned to {list(handles)}")
    return handles
