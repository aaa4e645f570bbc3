"""Load or recompute: a pull that overruns its deadline is cut and the leading verified run that
arrived is returned; a peer measured too slow is not pulled from at all; an engine's answer after a
cut load equals a full recompute. Real 2-node Ray cluster whose TLS-TCP servers are capped at
`SEND_RATE_MB_S` (`[transport] send_rate_mb_s`: a slow link between the nodes)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import numpy as np
import pytest
import ray
import torch
from testkit import wait_until
from transformers import LlamaConfig, LlamaForCausalLM

from cluster.api import EngineLoad, payload_shape
from cluster.client import FabricClient
from cluster.engines.hf.engine import HFEngine, LoadMode
from cluster.launch import LocalCluster, start_local_cluster
from fabric.config import AuditConfig, ClusterConfig, Config, KVConfig, TransportConfig
from fabric.keys import Namespace
from fabric.layout import KVLayout

SEND_RATE_MB_S = 0.1            # 64 blocks x 16 KiB (1 MiB) take ~10 s over it
LAYOUT = KVLayout.mha(4, 2, 16, "f32")   # 16 KiB per block at 16 tokens
NS = Namespace("deadline-model", LAYOUT, block_size=16, weights_fingerprint="deadline")
VOCAB = 512


@pytest.fixture(scope="module")
def fabric(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    config = Config(kv=KVConfig(ram_gib=0.1, ssd_gib=0.5, o_direct=False),
                    transport=TransportConfig(send_rate_mb_s=SEND_RATE_MB_S),
                    cluster=ClusterConfig(heartbeat_s=0.5, lease_s=30.0),
                    audit=AuditConfig(rate=0.0))   # what is pulled is asserted: no audit sampling
    local = start_local_cluster(2, tmp_path_factory.mktemp("deadline"), config)
    try:
        yield local
    finally:
        local.shutdown()


def nodes(fabric: LocalCluster) -> tuple[FabricClient, FabricClient]:
    head = ray.get_runtime_context().get_node_id()
    other = next(n for n in fabric.node_ids() if n != head)
    return FabricClient.connect(node_id=head), FabricClient.connect(node_id=other)


def listed(client: FabricClient, ns: Namespace, tokens: list[int], num_blocks: int) -> None:
    wait_until(lambda: client.lookup(ns, tokens).num_blocks >= num_blocks, "the directory listing the owner's blocks",
               10)


def test_a_pull_past_its_deadline_returns_the_leading_run_that_arrived(fabric: LocalCluster) -> None:
    owner, puller = nodes(fabric)
    tokens = [random.Random(1).randrange(50_000) for _ in range(64 * 16)]
    data = np.random.default_rng(2).integers(0, 256, payload_shape(NS, 64), dtype=np.uint8)
    assert owner.store(NS, tokens, data).num_stored == 64
    listed(puller, NS, tokens, 64)
    cuts = puller.stats()["estimates"]
    t0 = time.monotonic()
    reply = puller.load(NS, tokens, deadline_s=0.5)
    took = time.monotonic() - t0
    assert took < 4.0, took                       # the whole prefix takes ~10 s at the capped rate
    assert 0 < reply.num_blocks < 64
    assert np.array_equal(reply.payloads, data[:reply.num_blocks])
    stats = puller.stats()
    peers = stats["estimates"]["peers"]
    assert peers and next(iter(peers.values()))["bandwidth_mb_s"] < 10 * SEND_RATE_MB_S, (cuts, peers)


def test_a_peer_measured_too_slow_is_not_pulled_from(fabric: LocalCluster) -> None:
    owner, puller = nodes(fabric)
    tokens = [random.Random(3).randrange(50_000) for _ in range(32 * 16)]
    data = np.random.default_rng(4).integers(0, 256, payload_shape(NS, 32), dtype=np.uint8)
    assert owner.store(NS, tokens, data).num_stored == 32
    listed(puller, NS, tokens, 32)
    # The engine on the puller's node prefills 10,000 tokens/s: 512 tokens take 0.05 s to compute,
    # while 512 KiB from a peer measured at ~0.1 MB/s take seconds. Nothing is pulled.
    puller.report_prefill(NS, 10_000, 1.0)
    t0 = time.monotonic()
    reply = puller.load(NS, tokens)
    assert reply.num_blocks == 0 and reply.pulled_bytes == 0
    assert time.monotonic() - t0 < 2.0


def test_an_engines_answer_after_a_cut_load_equals_a_full_recompute(fabric: LocalCluster) -> None:
    owner, puller = nodes(fabric)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=1024))
    rng = random.Random(5)
    prompt = [rng.randrange(VOCAB) for _ in range(60 * 16 + 5)]
    HFEngine(model, owner, model_id="deadline-llama").prefill(prompt)          # computes and stores
    ns = HFEngine(model, None, model_id="deadline-llama").namespace
    listed(puller, ns, prompt, 60)
    # A fresh estimate for this model on the puller: no prefill rate yet, so the cut is the deadline's.
    cut = HFEngine(model, puller, model_id="deadline-llama", deadline_s=0.5).prefill(prompt, mode=LoadMode.FULL)
    whole = HFEngine(model, None, model_id="deadline-llama").prefill(prompt)
    assert 0 <= cut.num_reused_tokens < 60 * 16
    assert float((cut.logits - whole.logits).abs().max()) <= 1e-4


def test_lookups_carry_the_load_the_nodes_engine_reported(fabric: LocalCluster) -> None:
    _, puller = nodes(fabric)
    puller.report_load(EngineLoad(running_requests=1, queued_requests=2, queued_prefill_tokens=300))
    wait_until(lambda: puller.lookup(NS, [1] * 32).load == EngineLoad(1, 2, 300), "the reported load in a lookup", 5)
    assert puller.stats()["engine_load"] == {"running_requests": 1, "queued_requests": 2,
                                             "queued_prefill_tokens": 300}
