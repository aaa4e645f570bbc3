"""Catching a lying producer on a real 3-node Ray cluster: a transformers engine on one node
recomputes sampled pulls, a node with a valid certificate signs wrong KV as its own (the liar: the
test stores perturbed KV through that node's own API, so its key signs it), and the quarantine
reaches every node, survives a restart and is lifted by the operator.

One cluster and one engine for the module. The audit rate is 10 % (new producers 4x that); the
sampler is seeded, so a run replays the same draws. The probability bound itself (within 50 served
prefixes in 99 % of runs at 10 %) is tests/fabric/test_audit.py's seeded simulation.
"""

from __future__ import annotations

import asyncio
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
from cluster.directory.client import DirectoryClient
from cluster.engines.hf.actor import Answer, spawn_engines
from cluster.engines.hf.engine import HFEngine, save_checkpoint
from cluster.engines.hf.kv import encode_cache, fingerprint_state_dict
from cluster.launch import LocalCluster, start_local_cluster
from cluster.node.actor import node_actor_name
from fabric.config import AuditConfig, ClusterConfig, Config, KVConfig
from fabric.keys import Namespace, block_hashes

BLOCK = 16
VOCAB = 512
NUM_BLOCKS = 5


class Bed:
    def __init__(self, local: LocalCluster, engine: ray.actor.ActorHandle, reference: HFEngine,
                 ns: Namespace) -> None:
        self.local, self.engine, self.reference, self.ns = local, engine, reference, ns
        ids = sorted(local.node_ids())
        self.checker = ray.get(engine.node.remote())
        self.liar, self.other = (n for n in ids if n != self.checker)
        self.clients = {n: FabricClient.connect(node_id=n) for n in ids}
        self.names = {n: str(c.stats()["node_name"]) for n, c in self.clients.items()}


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    root = tmp_path_factory.mktemp("audit")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=512))
    checkpoint = save_checkpoint(model, root / "checkpoint")
    fingerprint = fingerprint_state_dict(model)
    config = Config(kv=KVConfig(ram_gib=0.25, ssd_gib=1.0, write_through=True, o_direct=False, mirror_delay_s=0.0),
                    cluster=ClusterConfig(heartbeat_s=0.4, lease_s=2.0, resync_jitter_s=0.2),
                    audit=AuditConfig(rate=0.1, seed=7))
    local = start_local_cluster(3, root / "fabric", config)
    try:
        checker = sorted(local.node_ids())[1]
        engine = spawn_engines([checker], str(checkpoint), fingerprint=fingerprint, model_id="tiny-llama",
                               block_size=BLOCK, num_threads=1)[checker]
        reference = HFEngine(model, None, block_size=BLOCK, fingerprint=fingerprint, model_id="tiny-llama")
        ns = ray.get(engine.namespace.remote())
        assert ns == reference.namespace
        yield Bed(local, engine, reference, ns)
    finally:
        local.shutdown()


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(NUM_BLOCKS * BLOCK + 3)]


def _true_kv(bed: Bed, tokens: list[int]) -> np.ndarray:
    """The KV an honest engine computes for the prompt's first NUM_BLOCKS blocks (uint8 payloads)."""
    cache = bed.reference.prefill(tokens, export=False).cache
    return encode_cache(HFEngine.kv_layers(cache), 0, NUM_BLOCKS, bed.ns)


def _perturbed(kv: np.ndarray, seed: int, *, relative: float, shift: float = 0.0) -> np.ndarray:
    values = kv.view(np.float32)
    noise = np.random.default_rng(seed).uniform(-relative, relative, values.shape)
    return (values * (1 + noise) + shift).astype(np.float32).view(np.uint8)


def _produce(bed: Bed, producer: str, tokens: list[int], payloads: np.ndarray, wait_until: Wait) -> None:
    """`producer`'s node stores (and signs, as their producer) `payloads`; the checker then sees them."""
    assert bed.clients[producer].store(bed.ns, tokens, payloads).num_stored == NUM_BLOCKS
    checker = bed.clients[bed.checker]
    wait_until(lambda: checker.lookup(bed.ns, tokens).num_blocks == NUM_BLOCKS, "the checker sees the blocks")


def _serve(bed: Bed, tokens: list[int]) -> Answer:
    answer: Answer = ray.get(bed.engine.answer.remote(tokens, 4, mode="full", deadline_s=math.inf))
    return answer


def _quarantined(bed: Bed) -> dict[str, list[str]]:
    return {n: list(c.stats()["quarantined"]) for n, c in bed.clients.items()}


def test_an_honest_producer_whose_kv_differs_by_float_noise_is_checked_and_never_quarantined(
        bed: Bed, wait_until: Wait) -> None:
    audited: list[Answer] = []
    for seed in range(100, 140):
        tokens = _prompt(seed)
        _produce(bed, bed.other, tokens, _perturbed(_true_kv(bed, tokens), seed, relative=1e-5), wait_until)
        answer = _serve(bed, tokens)
        if answer.audit is not None:
            audited.append(answer)
            assert answer.num_reused_tokens == 0   # a sampled load is computed, not read
        if len(audited) == 3:
            break
    assert len(audited) == 3, "three sampled loads within 40 prompts (each load at >= 10 %)"
    for answer in audited:
        assert answer.audit is not None
        assert answer.audit.num_checked == NUM_BLOCKS and answer.audit.num_mismatched == 0
        assert answer.audit.producers == (bed.names[bed.other],) and answer.audit.quarantined == ()
    assert _quarantined(bed) == {n: [] for n in bed.clients}


def test_a_liar_is_quarantined_everywhere_and_no_wrong_byte_reaches_an_engine_after(
        bed: Bed, wait_until: Wait) -> None:
    liar, other = bed.clients[bed.liar], bed.clients[bed.other]
    liar_name = bed.names[bed.liar]
    lies: list[list[int]] = []
    # The first lie is pulled by a third node too, which mirrors it.
    first = _prompt(1)
    _produce(bed, bed.liar, first, _perturbed(_true_kv(bed, first), 1, relative=0.0, shift=0.5), wait_until)
    lies.append(first)
    assert other.load(bed.ns, first, deadline_s=math.inf).num_blocks == NUM_BLOCKS

    async def owners() -> list[set[str]]:
        located = await DirectoryClient(bed.local.config.cluster).locate(block_hashes(bed.ns, first), exclude=())
        return [set(o) for o in located.owners]
    wait_until(lambda: all(bed.other in o for o in asyncio.run(owners())[:NUM_BLOCKS]), "the third node mirrors")

    caught: Answer | None = None
    served = 0
    for seed in range(1, 51):   # each served prefix: a fresh lie, signed by the liar, pulled by the engine
        tokens = _prompt(seed)
        if seed > 1:
            _produce(bed, bed.liar, tokens, _perturbed(_true_kv(bed, tokens), seed, relative=0.0, shift=0.5),
                     wait_until)
            lies.append(tokens)
        served += 1
        answer = _serve(bed, tokens)
        if answer.audit is not None and answer.audit.quarantined:
            caught = answer
            break
    assert caught is not None and caught.audit is not None, f"the liar was not caught in {served} served prefixes"
    assert caught.audit.quarantined == (liar_name,) and caught.audit.num_mismatched == NUM_BLOCKS
    wait_until(lambda: _quarantined(bed) == {n: [liar_name] for n in bed.clients}, "every node quarantines it")

    # The evidence every node keeps: the block, both digests, who checked.
    entries = ray.get(ray.get_actor(node_actor_name(bed.other), namespace="kvfabric").quarantine_entries.remote())
    (entry,) = [e for e in entries if e["producer"] == liar_name]
    evidence = entry["evidence"]
    assert evidence["checker"] == bed.names[bed.checker]
    assert evidence["engine_digest"] != evidence["signed_digest"]
    assert evidence["block"] in {bytes(h).hex() for t in lies for h in block_hashes(bed.ns, t)}

    # Mirrors included: no node holds or pulls a block the liar signed; the engine computes instead.
    for tokens in lies:
        for client in (liar, other, bed.clients[bed.checker]):
            assert client.load(bed.ns, tokens, pulls=False).num_blocks == 0
            assert client.load(bed.ns, tokens, deadline_s=math.inf).num_blocks == 0
    again = _serve(bed, first)
    assert again.num_reused_tokens == 0
    # A new lie after the quarantine reaches nobody either.
    late = _prompt(999)
    assert liar.store(bed.ns, late, _perturbed(_true_kv(bed, late), 999, relative=0.0, shift=0.5)).num_stored >= 0
    for client in (other, bed.clients[bed.checker]):
        assert client.load(bed.ns, late, deadline_s=math.inf).num_blocks == 0


def test_a_quarantine_survives_a_node_restart_ignores_forged_notices_and_the_operator_releases_it(
        bed: Bed, wait_until: Wait) -> None:
    liar_name = bed.names[bed.liar]
    assert _quarantined(bed)[bed.other] == [liar_name]   # the previous test's
    actor = ray.get_actor(node_actor_name(bed.other), namespace="kvfabric")
    before = ray.get(actor.ping.remote())["incarnation"]
    ray.kill(actor, no_restart=False)
    wait_until(lambda: _incarnation(bed.other) not in (None, before), "the node restarts")
    assert FabricClient.connect(node_id=bed.other).stats()["quarantined"] == [liar_name]

    # Nobody lifts it by pushing a release, nor quarantines an honest node with a forged entry.
    actor = ray.get_actor(node_actor_name(bed.other), namespace="kvfabric")
    (entry,) = [e for e in ray.get(actor.quarantine_entries.remote()) if e["producer"] == liar_name]
    assert not ray.get(actor.quarantine_notice.remote({"producer": liar_name, "state": "released", "at": 1e12}))
    forged = {**entry, "producer": bed.names[bed.checker], "at": entry["at"] + 1}
    assert not ray.get(actor.quarantine_notice.remote(forged))
    assert FabricClient.connect(node_id=bed.other).stats()["quarantined"] == [liar_name]

    released = bed.clients[bed.checker].release_producer(liar_name)
    assert released == {n: True for n in bed.clients}
    assert _quarantined(bed) == {n: [] for n in bed.clients}
    tokens = _prompt(2000)
    honest = _true_kv(bed, tokens)
    assert bed.clients[bed.liar].store(bed.ns, tokens, honest).num_stored == NUM_BLOCKS
    wait_until(lambda: bed.clients[bed.other].lookup(bed.ns, tokens).num_blocks == NUM_BLOCKS, "listed again")
    reply = FabricClient.connect(node_id=bed.other).load(bed.ns, tokens, deadline_s=math.inf)
    assert reply.num_blocks == NUM_BLOCKS and np.array_equal(reply.payloads, honest)
    # A node restarted after the release keeps it released (the latest word about a producer wins).
    before = _incarnation(bed.other)
    ray.kill(ray.get_actor(node_actor_name(bed.other), namespace="kvfabric"), no_restart=False)
    wait_until(lambda: _incarnation(bed.other) not in (None, before), "the node restarts")
    assert FabricClient.connect(node_id=bed.other).stats()["quarantined"] == []


def _incarnation(node_id: str) -> int | None:
    try:
        actor = ray.get_actor(node_actor_name(node_id), namespace="kvfabric")
        return int(ray.get(actor.ping.remote(), timeout=5)["incarnation"])
    except (ValueError, ray.exceptions.RayError):
        return None
