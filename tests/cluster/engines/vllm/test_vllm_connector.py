"""vLLM with kvfabric as its KV connector on a real 3-node local Ray cluster: the folder's shared
`vllm_cluster` (vllm_setup.py says which engine runs where and what each answer is compared with).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import ray
from testkit import wait_until
from vllm_setup import BLOCK, MODEL_ID, VOCAB, Setup

from cluster.client import FabricClient
from cluster.engines.vllm.engine_actor import Completion
from cluster.engines.vllm.namespace import engine_namespace, request_namespace

pytestmark = pytest.mark.vllm


@pytest.fixture
def setup(vllm_cluster: Setup) -> Setup:
    return vllm_cluster


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def test_node_b_pulls_the_prefix_node_a_computed_and_answers_as_a_recompute(setup: Setup) -> None:
    rng = random.Random(1)
    system = tokens(rng, 200)
    first, second = system + tokens(rng, 30), system + tokens(rng, 25)
    wrote = setup.answer(setup.a, first)
    assert wrote.num_cached_tokens == 0
    assert wrote.tokens == setup.recompute(first)
    wait_until(lambda: setup.cached_blocks(setup.b, first) == len(first) // BLOCK, "A's blocks in the directory", 30)

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
    wait_until(lambda: setup.cached_blocks(setup.a, longer) == len(longer) // BLOCK, "B's blocks in the directory", 30)

    prompt = system + document + tokens(rng, 30)
    got = setup.answer(setup.a, prompt)
    assert got.num_cached_tokens == (len(system) + len(document)) // BLOCK * BLOCK
    assert got.tokens == setup.recompute(prompt)


def test_a_different_cache_salt_gets_no_hit(setup: Setup) -> None:
    rng = random.Random(3)
    prompt = tokens(rng, 150)
    setup.answer(setup.a, prompt, cache_salt="tenant-one")
    salted = request_namespace(setup.ns, cache_salt="tenant-one", lora_name=None)
    wait_until(lambda: setup.cached_blocks(setup.b, prompt, salted) == 4, "A's salted blocks in the directory", 30)
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


def test_a_peer_killed_mid_pull_still_gives_the_recompute_answer(setup: Setup) -> None:
    """A's node holds the prefix and sends slowly; it dies once B's request has asked for it (while B
    pulls, or just before). B recomputes what did not arrive. (Last: A's engine dies with its node.)"""
    rng = random.Random(5)
    system = tokens(rng, 480)
    first, second = system + tokens(rng, 20), system + tokens(rng, 20)
    expected = setup.recompute(second)
    setup.answer(setup.a, first)
    wait_until(lambda: setup.cached_blocks(setup.b, first) == len(first) // BLOCK, "A's blocks in the directory", 30)
    owner = FabricClient.connect(node_id=setup.a)
    ray.get(owner.actor.set_send_rate.remote(0.05))      # 50 kB/s: the 1 MB prefix takes ~20 s
    reader = FabricClient.connect(node_id=setup.b)
    requested = reader.stats()["requested_blocks"]
    pending = setup.engines[setup.b].generate.remote([second], 16)
    wait_until(lambda: reader.stats()["requested_blocks"] > requested, "B's load to start", 60)
    setup.local.remove_node(setup.a)
    got: Completion = ray.get(pending, timeout=120)[0]
    assert got.tokens == expected
