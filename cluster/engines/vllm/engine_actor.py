"""A vLLM engine with the fabric connector in a Ray actor pinned to its node: what the demo, the
benchmark, the example job and the tests run.

    driver ──generate(prompts)──► VLLMEngineActor (node k) ── vLLM LLM ── KVFabricConnector
                                                                           └─► NodeActor (node k)

`multiprocess=False` runs vLLM's engine core in the actor's own process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`): the connector then uses the actor's Ray connection. With
`multiprocess=True` (vLLM's default) the engine core and its worker are child processes, and each
joins the cluster itself through `ray_address` (link.py). `fabric=False` is the same engine without
the connector (the recompute baseline). Prompts and answers are token ids.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.client import FabricClient
from cluster.engines.load_gate import LoadGate

MAX_ACCEPTED = 16      # requests an engine actor accepts at once (vLLM computes them one call at a time)
CONNECTOR = "KVFabricConnector"
CONNECTOR_MODULE = "cluster.engines.vllm.connector"


def kv_transfer_config(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `--kv-transfer-config` that puts the fabric under vLLM."""
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": dict(extra or {})}


@dataclass(frozen=True, slots=True)
class Completion:
    tokens: list[int]          # greedy answer, without the prompt
    num_cached_tokens: int     # prompt tokens vLLM did not compute: its prefix cache plus the fabric
    seconds: float             # wall time of the request on its own (with max_tokens=1: its TTFT)


@dataclass(frozen=True, slots=True)
class BatchRun:
    """`VLLMEngineActor.generate_batch`'s answers and what the engine still held once drained."""

    completions: dict[int, Completion]   # by prompt index: the requests that were not aborted
    finished_at: dict[int, int]          # by prompt index: the engine step that finished it
    max_preemptions: int                 # the most times vLLM preempted any one request
    held_requests: int                   # requests vLLM's scheduler still holds (0: all released)
    free_blocks: int                     # vLLM's free KV pages ...
    total_blocks: int                    # ... of all it has
    connector_requests: int              # requests the connector still tracks (scheduler and worker side)


class VLLMEngineActor:
    def __init__(self, model: str, *, fabric: bool = True, block_size: int = 32, multiprocess: bool = False,
                 prefix_caching: bool = True, max_model_len: int = 2048, kv_cache_gib: int = 1,
                 extra: dict[str, Any] | None = None, offload: str | None = None,
                 num_blocks: int | None = None) -> None:
        """`num_blocks`: vLLM's KV pages, fewer than `kv_cache_gib` holds (a small cache preempts)."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        from vllm import LLM

        context = ray.get_runtime_context()
        self.node_id = str(context.get_node_id())
        transfer: dict[str, Any] | None = None
        if fabric:
            link = {"ray_address": context.gcs_address, "node_id": self.node_id,
                    "ray_namespace": context.namespace}
            transfer = kv_transfer_config({**link, **(extra or {})})
        elif offload is not None:    # vLLM's own CPU offload, the benchmark's baseline
            transfer = {"kv_connector": offload, "kv_role": "kv_both", "kv_connector_extra_config": dict(extra or {})}
        self.llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                       compilation_config={"mode": 0}, max_model_len=max_model_len, block_size=block_size,
                       enable_prefix_caching=prefix_caching, kv_transfer_config=transfer, seed=0,
                       num_gpu_blocks_override=num_blocks)
        # The engine's load goes to its node's fabric, where routers read it with every lookup.
        self.fabric = FabricClient.connect(node_id=self.node_id, namespace=context.namespace) if fabric else None
        self.gate = LoadGate(self.fabric.report_load if self.fabric is not None else None)

    def node(self) -> str:
        return self.node_id

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int, *, cache_salt: str | None = None,
                 load: bool = True, store: bool = True) -> list[Completion]:
        """Greedy answers, one request at a time (so each one's time is its own)."""
        with self.gate.request(sum(len(p) for p in prompts)):
            return [self._one(p, max_tokens, cache_salt=cache_salt, load=load, store=store) for p in prompts]

    def _one(self, prompt: Sequence[int], max_tokens: int, *, cache_salt: str | None = None, load: bool = True,
             store: bool = True) -> Completion:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False,
                                extra_args={"kv_transfer_params": {"kvfabric": {"load": load, "store": store}}})
        request: dict[str, Any] = {"prompt_token_ids": list(prompt)}
        if cache_salt is not None:
            request["cache_salt"] = cache_salt
        start = time.perf_counter()
        result = self.llm.generate([request], params, use_tqdm=False)[0]   # type: ignore[arg-type]
        seconds = time.perf_counter() - start
        return Completion(list(result.outputs[0].token_ids), int(result.num_cached_tokens or 0), seconds)

    def serve(self, prompt: Sequence[int], max_tokens: int) -> tuple[Completion, Completion]:
        """(fabric, recompute) for one prompt, each as its answer with its TTFT as `seconds`: the
        first token alone is timed in its own request (TTFT), then the whole greedy answer is produced.
        The recompute reads nothing from and writes nothing to the fabric."""
        with self.gate.request(len(prompt)):
            first = self._one(prompt, 1)
            fabric = self._one(prompt, max_tokens, store=False)
            recompute = self._one(prompt, max_tokens, load=False, store=False)
            first_recompute = self._one(prompt, 1, load=False, store=False)
        return (Completion(fabric.tokens, first.num_cached_tokens, first.seconds),
                Completion(recompute.tokens, first_recompute.num_cached_tokens, first_recompute.seconds))

    def generate_batch(self, prompts: Sequence[Sequence[int]], max_tokens: int, *, abort: Sequence[int] = (),
                       abort_after_steps: int = 1, drain_s: float = 60.0) -> BatchRun:
        """Greedy answers to all `prompts` at once, the engine stepped here: vLLM batches them and,
        when its KV cache runs short, preempts some. The prompts at indexes `abort` are aborted after
        `abort_after_steps` steps. Then the engine steps until its scheduler holds no request (stores
        in flight settle) or `drain_s` passes, and what it still holds is counted. Only for an engine
        whose scheduler runs in this process (`multiprocess=False`)."""
        from vllm import RequestOutput, SamplingParams
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        from cluster.engines.vllm.connector import KVFabricConnector

        engine = self.llm.llm_engine
        core = getattr(engine.engine_core, "engine_core", None)
        if core is None:
            raise RuntimeError("generate_batch reads vLLM's scheduler: start the engine with multiprocess=False")
        scheduler = core.scheduler
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False)
        ids = {f"batch-{uuid.uuid4().hex}-{i}": i for i in range(len(prompts))}
        with self.gate.request(sum(len(p) for p in prompts)):
            for request_id, i in ids.items():
                engine.add_request(request_id, {"prompt_token_ids": list(prompts[i])}, params)
            done: dict[int, Completion] = {}
            finished_at: dict[int, int] = {}
            steps = preemptions = 0
            while engine.has_unfinished_requests():
                if abort and steps == abort_after_steps:
                    engine.abort_request([r for r, i in ids.items() if i in abort])
                for result in engine.step():
                    i = ids.get(result.request_id, -1)
                    if isinstance(result, RequestOutput) and result.finished and i >= 0 and i not in abort:
                        done[i] = Completion(list(result.outputs[0].token_ids), int(result.num_cached_tokens or 0),
                                             0.0)
                        finished_at[i] = steps
                steps += 1
                preemptions = max([preemptions, *(r.num_preemptions for r in scheduler.requests.values())])
            deadline = time.monotonic() + drain_s
            while scheduler.has_requests() and time.monotonic() < deadline:
                engine.step()
        pool = scheduler.kv_cache_manager.block_pool
        tracked = 0
        connectors = scheduler.connector, get_kv_transfer_group()
        for connector in connectors:
            if isinstance(connector, KVFabricConnector):
                tracked += connector.num_requests
        return BatchRun(done, finished_at, preemptions, len(scheduler.requests), pool.get_num_free_blocks(),
                        pool.num_gpu_blocks - 1, tracked)    # vLLM's null block is never free

    def reset_prefix_cache(self) -> bool:
        """Empty vLLM's own prefix cache (so the next hit can only come from the fabric)."""
        return bool(self.llm.reset_prefix_cache())

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


def spawn_vllm_engines(node_ids: Sequence[str], model: str, **kwargs: Any) -> dict[str, ray.actor.ActorHandle]:
    """One `VLLMEngineActor` pinned to each node (hard affinity); returns once every one has started."""
    remote = ray.remote(num_cpus=0, max_concurrency=MAX_ACCEPTED)(VLLMEngineActor)
    handles = {node_id: remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
               .remote(model, **kwargs) for node_id in node_ids}
    placed = ray.get([h.node.remote() for h in handles.values()])
    if placed != list(handles):
        raise RuntimeError(f"vLLM engine actors landed on {placed}, pinned to {list(handles)}")
    return handles
