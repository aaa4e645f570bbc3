"""The transformers adapter across nodes: engines on three real Ray nodes, KV pulled over the fabric's
TLS transport from the node that computed it, and a block corrupted on the owner's SSD.

One cluster per module (~20-30 s to start on 2 cores); the model is a seeded random GQA Llama saved
as a checkpoint that every engine actor loads, so all three run the same weights.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

import numpy as np
import pytest
import ray
import torch
from testkit import Wait
from transformers import LlamaConfig, LlamaForCausalLM

from cluster.client import FabricClient
from cluster.engines.hf.actor import OMP_SPIN_COUNT, Answer, spawn_engines
from cluster.engines.hf.engine import HFEngine, LoadMode, save_checkpoint
from cluster.engines.hf.kv import fingerprint_state_dict
from cluster.launch import LocalCluster, start_local_cluster
from cluster.node.actor import node_name_for
from fabric.config import AuditConfig, ClusterConfig, Config, KVConfig
from fabric.keys import BlockAddress, block_hashes
from fabric.tiers.ssd_format import HEADER_SIZE

BLOCK = 16
VOCAB = 512
TOLERANCE = 1e-4
Cluster = tuple[LocalCluster, dict[str, ray.actor.ActorHandle]]


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("hf-cluster")
    model = tiny_llama()
    checkpoint = save_checkpoint(model, root / "checkpoint")
    # A RAM tier smaller than one payload: every block is served off the SSD, digest-checked.
    # Audit sampling off: these tests assert where each prefix came from (test_audit_cluster.py samples).
    config = Config(kv=KVConfig(ram_gib=1e-6, ssd_gib=1.0, write_through=True, o_direct=False),
                    cluster=ClusterConfig(heartbeat_s=0.5, lease_s=5.0), audit=AuditConfig(rate=0.0))
    local = start_local_cluster(3, root / "fabric", config)
    try:
        engines = spawn_engines(local.node_ids(), str(checkpoint), fingerprint=fingerprint_state_dict(model),
                                model_id="tiny-llama", block_size=BLOCK, num_threads=1)
        yield local, engines
    finally:
        local.shutdown()


def test_engine_actors_start_with_a_short_openmp_spin(cluster: Cluster) -> None:
    _, engines = cluster
    assert ray.get([e.omp_spin_count.remote() for e in engines.values()]) == [str(OMP_SPIN_COUNT)] * len(engines)


def chat(seed: int, num_system: int = 150) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(num_system)]
    return (system + [rng.randrange(VOCAB) for _ in range(20)],
            system + [rng.randrange(VOCAB) for _ in range(25)])


def diff(a: Answer, b: Answer) -> float:
    return float(np.abs(a.logits - b.logits).max())


@pytest.mark.parametrize("mode", [LoadMode.FULL, LoadMode.LAYERWISE])
def test_kv_pulled_from_another_node_continues_exactly_as_a_recompute(
        cluster: Cluster, mode: LoadMode, wait_until: Wait) -> None:
    _, engines = cluster
    owner, reader, _ = sorted(engines)
    first, second = chat(seed=1 if mode is LoadMode.FULL else 2)
    wrote: Answer = ray.get(engines[owner].answer.remote(first, 1))
    assert wrote.num_reused_tokens == 0
    _wait_listed(engines[owner], reader, first, wait_until)

    # Pull whatever the owner holds (deadline_s=inf): recomputing this tiny model's prompt may be
    # cheaper than a pull, and the node would rightly recompute; this test is about the pulled KV.
    got, expected = ray.get(engines[reader].serve.remote(second, 32, mode=mode.value, deadline_s=math.inf))
    assert got.num_pulled_tokens == got.num_reused_tokens == 150 // BLOCK * BLOCK
    assert all(s == f"peer:{owner}" for s in got.sources)
    assert got.pulled_bytes > 0
    assert diff(got, expected) <= TOLERANCE
    assert got.tokens == expected.tokens and len(got.tokens) == 32


def _wait_listed(owner: ray.actor.ActorHandle, reader: str, tokens: list[int], wait_until: Wait) -> None:
    """Until the reader's node sees the owner's blocks of `tokens` (its register batch reached the
    directory)."""
    ns = ray.get(owner.namespace.remote())
    fabric = FabricClient.connect(node_id=reader)
    wait_until(lambda: fabric.lookup(ns, tokens).num_tokens == len(tokens) // BLOCK * BLOCK,
               "the directory lists the owner's blocks for the reader")


def test_block_corrupted_on_the_owners_ssd_is_recomputed_with_identical_output(
        cluster: Cluster, wait_until: Wait) -> None:
    local, engines = cluster
    owner, _, reader = sorted(engines)
    first, second = chat(seed=3)
    ray.get(engines[owner].answer.remote(first, 1))
    _wait_listed(engines[owner], reader, first, wait_until)
    ns = ray.get(engines[owner].namespace.remote())
    hashes = block_hashes(ns, first)
    owner_fabric = FabricClient.connect(node_id=owner)
    assert [loc.where.value for loc in owner_fabric.lookup(ns, first).locations] == ["ssd"] * 10
    key = BlockAddress(hashes[4], 1).storage_key
    path = local.root / "ssd" / node_name_for(owner) / f"{key[0]:02x}" / f"{key.hex()[:16]}-1.kvb"
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE + 7] ^= 0x10
    path.write_bytes(bytes(data))

    got, expected = ray.get(engines[reader].serve.remote(second, 32, mode=LoadMode.LAYERWISE.value,
                                                         deadline_s=math.inf))
    assert got.num_reused_tokens == 4 * BLOCK   # blocks 0-3 came over the fabric, 4.. were recomputed
    assert diff(got, expected) <= TOLERANCE
    assert got.tokens == expected.tokens
    # And the answer matches a single-process engine that never saw a fabric.
    local_engine = HFEngine(tiny_llama(), None, block_size=BLOCK)
    assert got.tokens == local_engine.generate(second, 32).tokens


def test_paged_engine_pulls_blocks_from_another_node(cluster: Cluster, wait_until: Wait) -> None:
    """The paged engine (block manager + pool) on two nodes' fabrics: pool hits first, then the node's
    tiers, then pulls; logits equal a full prefill."""
    from cluster.engines.reference.paged import PagedEngine
    from cluster.engines.reference.tiny_llama import TinyLlama, TinyLlamaConfig

    _, engines = cluster
    owner, reader, _ = sorted(engines)
    model = TinyLlama(TinyLlamaConfig(vocab_size=VOCAB, dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                      ffn_dim=128, seed=5))
    first, second = chat(seed=4)
    writer = PagedEngine(model, 64, BLOCK, fabric=FabricClient.connect(node_id=owner))
    wrote = writer.prefill(first)
    assert wrote.num_stored_blocks == len(first) // BLOCK
    ns = writer.namespace
    reader_fabric = FabricClient.connect(node_id=reader)
    wait_until(lambda: reader_fabric.lookup(ns, first).num_tokens == len(first) // BLOCK * BLOCK,
               "the directory lists the owner's blocks for the reader")

    paged = PagedEngine(model, 64, BLOCK, fabric=FabricClient.connect(node_id=reader))
    got = paged.prefill(second)
    assert got.num_device_hit_tokens == 0 and got.num_store_hit_tokens == 150 // BLOCK * BLOCK
    full, _ = model(torch.tensor(second))
    assert float((full[got.num_reused_tokens:] - got.logits).abs().max()) <= 1e-4
    paged.finish(got.seq)
    again = paged.prefill(second)   # now the pool's own blocks come first
    assert again.num_device_hit_tokens == len(second) // BLOCK * BLOCK   # 175 tokens: 10 full blocks
