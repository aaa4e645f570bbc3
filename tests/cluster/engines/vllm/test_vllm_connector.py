"""vLLM with kvfabric as its KV connector on a real 3-node local Ray cluster.

Nodes: the head (the fabric only) and two workers, each with a real vLLM engine (CPU build) in a
Ray actor pinned to it:
    A  vLLM's engine core in the actor's process, prefix caching on, a small KV cache (40 pages:
       three requests of 13 pages each fill it, so their decoding preempts)
    B  vLLM's default multiprocess mode (engine core and worker are child processes that join the
       cluster themselves), prefix caching off
B with the fabric turned off for a request (`load=False, store=False`) is the recompute every
answer is compared with: greedy token ids, exactly. The model is a seeded random Llama saved by
`save_checkpoint`; engines pull whatever a peer holds (`deadline_s: inf`), since recomputing this
tiny model is faster than any pull and the node would otherwise rightly recompute. Loads are never
sampled for audit (`[audit] rate` 0) except where a test raises B's rate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
import urllib.request
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import ray
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import LlamaConfig, LlamaForCausalLM

from cluster.client import FabricClient
from cluster.engines.hf.engine import save_checkpoint
from cluster.engines.vllm.engine_actor import BatchRun, Completion, spawn_vllm_engines
from cluster.engines.vllm.namespace import engine_namespace, request_namespace, weights_fingerprint
from cluster.launch import LocalCluster, start_local_cluster
from fabric.config import AuditConfig, ClusterConfig, Config, KVConfig
from fabric.keys import Namespace
from fabric.layout import KVLayout

pytestmark = pytest.mark.vllm
BLOCK = 32
VOCAB = 512
MODEL_ID = "tiny-llama"
PAGES_A = 40


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


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout_s} s")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("vllm-cluster")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=2048))
    checkpoint = save_checkpoint(model, root / "checkpoint")
    config = Config(kv=KVConfig(ram_gib=0.25, ssd_gib=1.0), cluster=ClusterConfig(heartbeat_s=0.5, lease_s=5.0),
                    audit=AuditConfig(rate=0.0))
    local = start_local_cluster(3, root / "fabric", config)
    try:
        head = ray.get_runtime_context().get_node_id()
        a, b = sorted(n for n in local.node_ids() if n != head)
        extra = {"model_id": MODEL_ID, "deadline_s": "inf"}
        common = {"block_size": BLOCK, "extra": extra, "max_model_len": 1024}
        engines = {**spawn_vllm_engines([a], str(checkpoint), multiprocess=False, prefix_caching=True,
                                        num_blocks=PAGES_A, **common),
                   **spawn_vllm_engines([b], str(checkpoint), multiprocess=True, prefix_caching=False, **common)}
        ns = engine_namespace(MODEL_ID, weights_fingerprint(str(checkpoint)), KVLayout.mha(4, 2, 32, "f32"), BLOCK,
                              "cpu:default")
        yield Setup(local, a, b, engines, ns)
        for engine in engines.values():   # vLLM's child processes stop with their engine; a dead one has none
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(engine.shutdown.remote(), timeout=60)
    finally:
        local.shutdown()


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def test_node_b_pulls_the_prefix_node_a_computed_and_answers_as_a_recompute(setup: Setup) -> None:
    rng = random.Random(1)
    system = tokens(rng, 200)
    first, second = system + tokens(rng, 30), system + tokens(rng, 25)
    wrote = setup.answer(setup.a, first)
    assert wrote.num_cached_tokens == 0
    assert wrote.tokens == setup.recompute(first)
    wait_until(lambda: setup.cached_blocks(setup.b, first) == len(first) // BLOCK, 30, "A's blocks in the directory")

    got = setup.answer(setup.b, second)
    assert got.num_cached_tokens == len(system) // BLOCK * BLOCK      # a partial hit: the shared blocks
    assert got.tokens == setup.recompute(second)
    pulled = FabricClient.connect(node_id=setup.b).stats()["pulled_bytes"]
    assert pulled >= len(system) // BLOCK * setup.ns.layout.bytes_per_block(BLOCK)


def test_vllm_prefix_cache_and_the_fabric_combine_in_one_request(setup: Setup) -> None:
    """A holds the system prompt's blocks in its own prefix cache; the fabric holds more of the prompt,
    computed by B: A reads its own blocks, loads the next ones from B, and computes the rest."""
    rng = random.Random(2)
    system, document = tokens(rng, 160), tokens(rng, 128)
    setup.answer(setup.a, system + tokens(rng, 20))              # A's prefix cache: the system blocks
    longer = system + document + tokens(rng, 20)
    setup.answer(setup.b, longer)                                # the fabric: system + document blocks
    wait_until(lambda: setup.cached_blocks(setup.a, longer) == len(longer) // BLOCK, 30, "B's blocks in the directory")

    prompt = system + document + tokens(rng, 30)
    got = setup.answer(setup.a, prompt)
    assert got.num_cached_tokens == (len(system) + len(document)) // BLOCK * BLOCK
    assert got.tokens == setup.recompute(prompt)


def test_a_different_cache_salt_gets_no_hit(setup: Setup) -> None:
    rng = random.Random(3)
    prompt = tokens(rng, 150)
    setup.answer(setup.a, prompt, cache_salt="tenant-one")
    salted = request_namespace(setup.ns, cache_salt="tenant-one", lora_name=None)
    wait_until(lambda: setup.cached_blocks(setup.b, prompt, salted) == 4, 30, "A's salted blocks in the directory")
    assert setup.cached_blocks(setup.b, prompt) == 0      # the unsalted namespace holds nothing of it
    other = setup.answer(setup.b, prompt, cache_salt="tenant-two")
    assert other.num_cached_tokens == 0
    assert other.tokens == setup.recompute(prompt)
    same = setup.answer(setup.b, prompt[:140] + tokens(rng, 10), cache_salt="tenant-one")
    assert same.num_cached_tokens == 128            # the salt that stored it finds it


def test_a_different_model_or_block_size_finds_nothing(setup: Setup) -> None:
    rng = random.Random(4)
    prompt = tokens(rng, 200)
    setup.answer(setup.a, prompt)
    assert setup.cached_blocks(setup.a, prompt) == len(prompt) // BLOCK
    other_weights = dataclasses.replace(setup.ns, weights_fingerprint="0" * 64)
    other_model = dataclasses.replace(setup.ns, model_id="other-model|vllm:cpu:default")
    other_block = engine_namespace(MODEL_ID, setup.ns.weights_fingerprint, setup.ns.layout, 64, "cpu:default")
    for ns in (other_weights, other_model, other_block):
        assert setup.cached_blocks(setup.a, prompt, ns) == 0


def batch(setup: Setup, prompts: list[list[int]], **kwargs: object) -> BatchRun:
    run: BatchRun = ray.get(setup.engines[setup.a].generate_batch.remote(prompts, 16, **kwargs))
    return run


def test_requests_preempted_for_kv_pages_answer_as_a_recompute_and_release_everything(setup: Setup) -> None:
    """Three prompts whose first 12 blocks B computed: A pulls them, and their 13 pages each fill A's
    cache; decoding needs more pages, so vLLM preempts and later resumes (loading again)."""
    rng = random.Random(8)
    prompts = [tokens(rng, 13 * BLOCK - 4) for _ in range(3)]
    for prompt in prompts:
        setup.answer(setup.b, prompt)
    wait_until(lambda: all(setup.cached_blocks(setup.a, p) == 12 for p in prompts), 30, "B's blocks in the directory")
    expected = [setup.recompute(p) for p in prompts]
    run = batch(setup, prompts)
    assert run.max_preemptions >= 1
    assert [run.completions[i].tokens for i in range(3)] == expected
    assert (run.held_requests, run.connector_requests, run.free_blocks) == (0, 0, run.total_blocks)


def test_a_request_whose_prefix_is_pulled_loads_outside_the_batch(setup: Setup) -> None:
    """B's node sends slowly: A's request for B's prefix waits for its pull in the background while
    the request batched with it, which has nothing to load, is answered meanwhile."""
    rng = random.Random(10)
    prefix = tokens(rng, 8 * BLOCK)
    setup.answer(setup.b, prefix + tokens(rng, 10))
    slow, quick = prefix + tokens(rng, 20), tokens(rng, 40)
    wait_until(lambda: setup.cached_blocks(setup.a, slow) == 8, 30, "B's blocks in the directory")
    expected = [setup.recompute(slow), setup.recompute(quick)]
    owner = FabricClient.connect(node_id=setup.b).actor
    ray.get(owner.set_send_rate.remote(0.2))       # 200 kB/s: the 0.5 MB prefix takes ~3 s
    try:
        run = batch(setup, [slow, quick])
    finally:
        ray.get(owner.set_send_rate.remote(0.0))
    assert run.finished_at[1] < run.finished_at[0]
    assert [run.completions[0].tokens, run.completions[1].tokens] == expected
    assert run.completions[0].num_cached_tokens == 8 * BLOCK
    assert (run.held_requests, run.connector_requests, run.free_blocks) == (0, 0, run.total_blocks)


def test_an_aborted_request_releases_its_pages_and_the_others_answer_as_a_recompute(setup: Setup) -> None:
    """A request aborted after its first step (its fabric load done, its stores in flight) leaves no
    page held and nothing tracked; the request batched with it is unaffected."""
    rng = random.Random(9)
    system = tokens(rng, 6 * BLOCK)
    setup.answer(setup.b, system + tokens(rng, 10))
    aborted, kept = system + tokens(rng, 3 * BLOCK), system + tokens(rng, 40)
    wait_until(lambda: setup.cached_blocks(setup.a, aborted) == 6, 30, "B's blocks in the directory")
    expected = setup.recompute(kept)
    run = batch(setup, [aborted, kept], abort=[0], abort_after_steps=1)
    assert list(run.completions) == [1] and run.completions[1].tokens == expected
    assert (run.held_requests, run.connector_requests, run.free_blocks) == (0, 0, run.total_blocks)


@contextlib.contextmanager
def audit_rate(node: str, rate: float) -> Iterator[None]:
    actor = FabricClient.connect(node_id=node).actor
    ray.get(actor.set_audit_rate.remote(rate))
    try:
        yield
    finally:
        ray.get(actor.set_audit_rate.remote(0.0))


def audits(node: str) -> dict[str, float]:
    """Blocks the node's audits compared so far, by outcome (its /metrics)."""
    port = FabricClient.connect(node_id=node).stats()["metrics_port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {sample.labels["outcome"]: sample.value for family in text_string_to_metric_families(text)
            if family.name == "kvfabric_audits" for sample in family.samples if sample.name.endswith("_total")}


def quarantined(node: str) -> list[str]:
    return list(FabricClient.connect(node_id=node).stats()["quarantined"])


def test_a_sampled_load_is_recomputed_and_an_honest_producer_passes_its_audit(setup: Setup) -> None:
    rng = random.Random(6)
    prompt = tokens(rng, 4 * BLOCK + 10)
    setup.answer(setup.a, prompt)                  # A's vLLM computes the prompt and stores its 4 blocks
    wait_until(lambda: setup.cached_blocks(setup.b, prompt) == 4, 30, "A's blocks in the directory")
    expected = setup.recompute(prompt)
    before = audits(setup.b)
    with audit_rate(setup.b, 1.0):
        got = setup.answer(setup.b, prompt)
        wait_until(lambda: sum(audits(setup.b).values()) >= sum(before.values()) + 4, 60, "B's audit")
    assert got.tokens == expected
    after = audits(setup.b)
    assert after.get("mismatch", 0) == before.get("mismatch", 0)
    assert after.get("equal", 0) + after.get("within", 0) == before.get("equal", 0) + before.get("within", 0) + 4
    assert quarantined(setup.a) == [] and quarantined(setup.b) == []


def test_a_producer_that_signs_wrong_kv_is_caught_by_a_sampled_vllm_load_and_quarantined(setup: Setup) -> None:
    """A's node stores (and signs, as their producer) KV that vLLM would never compute for the prompt;
    B's vLLM loads it with every load sampled: it computes the blocks instead, the audit finds the
    lie, and every node quarantines A. (A is released afterwards for the tests that follow.)"""
    rng = random.Random(7)
    prompt = tokens(rng, 4 * BLOCK + 10)
    layout = setup.ns.layout
    shape = (4, layout.num_layers, layout.bytes_per_block_layer(BLOCK) // 4)
    lie = np.random.default_rng(7).normal(0.0, 1.0, shape).astype(np.float32).view(np.uint8)
    liar = FabricClient.connect(node_id=setup.a)
    liar_name = str(liar.stats()["node_name"])
    assert liar.store(setup.ns, prompt, lie).num_stored == 4
    wait_until(lambda: setup.cached_blocks(setup.b, prompt) == 4, 30, "the liar's blocks in the directory")
    expected = setup.recompute(prompt)
    try:
        with audit_rate(setup.b, 1.0):
            got = setup.answer(setup.b, prompt)
            wait_until(lambda: quarantined(setup.b) == [liar_name], 60, "B's audit to quarantine the liar")
        assert got.tokens == expected
        assert audits(setup.b).get("mismatch", 0) >= 1
        wait_until(lambda: quarantined(setup.a) == [liar_name], 30, "the quarantine to reach every node")
        assert setup.cached_blocks(setup.b, prompt) == 0        # its blocks are gone, and refused
        again = setup.answer(setup.b, prompt)
        assert again.num_cached_tokens == 0 and again.tokens == expected
    finally:
        liar.release_producer(liar_name)


def test_a_peer_killed_mid_pull_still_gives_the_recompute_answer(setup: Setup) -> None:
    """A's node holds the prefix and sends slowly; it dies once B's request has asked for it (while B
    pulls, or just before). B recomputes what did not arrive. (Last: A's engine dies with its node.)"""
    rng = random.Random(5)
    system = tokens(rng, 480)
    first, second = system + tokens(rng, 20), system + tokens(rng, 20)
    expected = setup.recompute(second)
    setup.answer(setup.a, first)
    wait_until(lambda: setup.cached_blocks(setup.b, first) == len(first) // BLOCK, 30, "A's blocks in the directory")
    owner = FabricClient.connect(node_id=setup.a)
    ray.get(owner.actor.set_send_rate.remote(0.05))      # 50 kB/s: the 1 MB prefix takes ~20 s
    reader = FabricClient.connect(node_id=setup.b)
    requested = reader.stats()["requested_blocks"]
    pending = setup.engines[setup.b].generate.remote([second], 16)
    wait_until(lambda: reader.stats()["requested_blocks"] > requested, 60, "B's load to start")
    setup.local.remove_node(setup.a)
    got: Completion = ray.get(pending, timeout=120)[0]
    assert got.tokens == expected
