"""The vLLM test modules' shared cluster: 3 local Ray nodes, two of them with a real vLLM engine.

Nodes: the head (the fabric only) and two workers, each with a real vLLM engine (CPU build) in a
Ray actor pinned to it:
    A  vLLM's engine core in the actor's process, prefix caching on
    B  vLLM's default multiprocess mode (engine core and worker are child processes that join the
       cluster themselves), prefix caching off
B with the fabric turned off for a request (`load=False, store=False`) is the recompute every
answer is compared with: greedy token ids, exactly. The model is a seeded random Llama saved by
`save_checkpoint`; engines pull whatever a peer holds (`deadline_s: inf`), since recomputing this
tiny model is faster than any pull and the node would otherwise rightly recompute.

Starting it costs two engines and a cluster, so the modules of this folder share one
(`vllm_cluster` in conftest.py); a test that removes a node leaves it to be started afresh for the
next test that asks.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import ray
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cluster.client import FabricClient
from cluster.engines.hf.engine import save_checkpoint
from cluster.engines.vllm.engine_actor import Completion, spawn_vllm_engines
from cluster.engines.vllm.namespace import engine_namespace, weights_fingerprint
from cluster.launch import LocalCluster, start_local_cluster
from fabric.config import ClusterConfig, Config, KVConfig
from fabric.keys import Namespace
from fabric.layout import KVLayout

BLOCK = 32
VOCAB = 512
MODEL_ID = "tiny-llama"


@dataclasses.dataclass
class Setup:
    local: LocalCluster
    a: str
    b: str
    engines: dict[str, ray.actor.ActorHandle]
    ns: Namespace

    def answer(self, node: str, prompt: list[int], **kwargs: object) -> Completion:
        out: Completion = ray.get(self.engines[node].generate.remote([prompt], 16, **kwargs))[0]
        return out

    def recompute(self, prompt: list[int]) -> list[int]:
        return self.answer(self.b, prompt, load=False, store=False).tokens

    def cached_blocks(self, node: str, prompt: list[int], ns: Namespace | None = None) -> int:
        return FabricClient.connect(node_id=node).lookup(ns or self.ns, prompt).num_blocks

    def whole(self) -> bool:
        """Both engine nodes still run (a test may have removed one)."""
        workers = {n.node_id for n in self.local.cluster.worker_nodes}
        return self.a in workers and self.b in workers


@contextlib.contextmanager
def vllm_cluster(root: Path) -> Iterator[Setup]:
    """The cluster and its two engines under `root`; stopped on the way out."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=2048))
    checkpoint = save_checkpoint(model, root / "checkpoint")
    config = Config(kv=KVConfig(ram_gib=0.25, ssd_gib=1.0), cluster=ClusterConfig(heartbeat_s=0.5, lease_s=5.0))
    local = start_local_cluster(3, root / "fabric", config)
    try:
        head = ray.get_runtime_context().get_node_id()
        a, b = sorted(n for n in local.node_ids() if n != head)
        extra = {"model_id": MODEL_ID, "deadline_s": "inf"}
        common = {"block_size": BLOCK, "extra": extra, "max_model_len": 1024}
        engines = {**spawn_vllm_engines([a], str(checkpoint), multiprocess=False, prefix_caching=True, **common),
                   **spawn_vllm_engines([b], str(checkpoint), multiprocess=True, prefix_caching=False, **common)}
        ns = engine_namespace(MODEL_ID, weights_fingerprint(str(checkpoint)), KVLayout.mha(4, 2, 32, "f32"), BLOCK,
                              "cpu:default")
        yield Setup(local, a, b, engines, ns)
        for engine in engines.values():   # vLLM's child processes stop with their engine; a dead one has none
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(engine.shutdown.remote(), timeout=60)
    finally:
        local.shutdown()
