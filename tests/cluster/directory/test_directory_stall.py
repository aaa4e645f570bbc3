"""A directory that stops answering costs a lookup nothing after the first timeout, and a NodeActor
that stops answering costs its engine at most the client's timeout. Real Ray cluster of 2 nodes;
the directory shard and a NodeActor are frozen with SIGSTOP (and always resumed with SIGCONT)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest
import ray
from testkit import wait_until

from cluster.api import Where, payload_shape
from cluster.client import FabricClient, FabricTimeoutError
from cluster.directory.actor import shard_actor_name
from cluster.directory.breaker import BreakerState, CircuitBreaker
from cluster.launch import LocalCluster, start_local_cluster
from fabric.config import ClusterConfig, Config, KVConfig
from fabric.keys import Namespace
from fabric.layout import KVLayout

LAYOUT = KVLayout.mha(2, 2, 64, "f16")
NS = Namespace("stall-model", LAYOUT, block_size=16, weights_fingerprint="stall")
LOOKUP_TIMEOUT_S = 2.0   # long, so that "did not wait for it" is plain even on a loaded machine


@pytest.fixture(scope="module")
def fabric(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    config = Config(kv=KVConfig(ram_gib=0.1, ssd_gib=0.5, o_direct=False),
                    cluster=ClusterConfig(heartbeat_s=0.5, lease_s=30.0, directory_lookup_timeout_s=LOOKUP_TIMEOUT_S,
                                          directory_probe_s=0.2))
    local = start_local_cluster(2, tmp_path_factory.mktemp("stall"), config)
    try:
        yield local
    finally:
        local.shutdown()


def _pid_and_node(actor: ray.actor.ActorHandle) -> tuple[int, str]:
    return ray.get(actor.__ray_call__.remote(lambda _self: (os.getpid(), ray.get_runtime_context().get_node_id())))


def test_the_breaker_opens_on_a_failure_and_closes_only_after_a_probe_answers() -> None:
    b = CircuitBreaker(probe_s=1.0)
    assert b.allow() and not b.take_probe(0.0)
    b.failure(10.0)
    assert not b.allow() and b.num_opened == 1
    assert not b.take_probe(10.5)            # too early
    assert b.take_probe(11.0) and b.state is BreakerState.PROBING
    assert not b.take_probe(11.1)            # one probe at a time
    b.failure(11.2)                          # the probe failed: wait again
    assert b.num_opened == 1 and not b.take_probe(11.5) and b.take_probe(12.2)
    b.success()
    assert b.allow()


def test_the_directory_runs_on_the_head_node(fabric: LocalCluster) -> None:
    shard = ray.get_actor(shard_actor_name(fabric.config.cluster, 0), namespace=fabric.config.cluster.namespace)
    head = ray.get_runtime_context().get_node_id()   # this driver runs on the head node
    assert _pid_and_node(shard)[1] == head


def test_a_frozen_directory_answers_local_only_at_once_and_full_answers_return(fabric: LocalCluster) -> None:
    head = ray.get_runtime_context().get_node_id()
    other = next(n for n in fabric.node_ids() if n != head)
    owner, reader = FabricClient.connect(node_id=head), FabricClient.connect(node_id=other)
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, 50_000, 8 * 16)]
    data = np.random.default_rng(2).integers(0, 256, payload_shape(NS, 8), dtype=np.uint8)
    assert owner.store(NS, tokens, data).num_stored == 8
    wait_until(lambda: reader.lookup(NS, tokens).num_blocks >= 8, "the directory listing the owner's blocks", 10)

    shard = ray.get_actor(shard_actor_name(fabric.config.cluster, 0), namespace=fabric.config.cluster.namespace)
    pid, _ = _pid_and_node(shard)
    os.kill(pid, signal.SIGSTOP)
    try:
        first = reader.lookup(NS, tokens)               # waits the lookup timeout once
        assert first.num_blocks == 0
        took = []
        for _ in range(5):
            t0 = time.monotonic()
            reply = reader.lookup(NS, tokens)
            took.append(time.monotonic() - t0)
            assert reply.num_blocks == 0
        # None of them waited for the frozen shard (each would take LOOKUP_TIMEOUT_S).
        assert max(took) < LOOKUP_TIMEOUT_S / 2, took
        directory = reader.stats()["directory"]
        assert directory["breaker_states"] != ["closed"] and directory["lookups_answered_local_only"] >= 5
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(lambda: reader.lookup(NS, tokens).num_blocks == 8, "full answers after the directory resumed", 15)
    found = reader.lookup(NS, tokens)
    assert {loc.where for loc in found.locations} == {Where.PEER}
    assert reader.stats()["directory"]["breaker_states"] == ["closed"]


def test_a_frozen_node_actor_costs_its_engine_at_most_the_client_timeout(fabric: LocalCluster) -> None:
    head = ray.get_runtime_context().get_node_id()
    client = FabricClient.connect(node_id=head, call_timeout_s=1.0)
    pid = client.stats()["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(FabricTimeoutError, match="did not answer lookup within 1 s"):
            client.lookup(NS, [1] * 32)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert client.lookup(NS, [1] * 32).num_blocks == 0


def test_asyncio_callers_get_the_same_answers_and_the_same_timeout(fabric: LocalCluster) -> None:
    head = ray.get_runtime_context().get_node_id()
    client = FabricClient.connect(node_id=head, call_timeout_s=1.0)
    tokens = [int(t) for t in np.random.default_rng(3).integers(0, 50_000, 4 * 16)]
    data = np.random.default_rng(4).integers(0, 256, payload_shape(NS, 4), dtype=np.uint8)

    async def round_trip() -> None:
        assert (await client.astore(NS, tokens, data)).num_stored == 4
        assert (await client.alookup(NS, tokens)).num_blocks == 4
        reply = await client.aload(NS, tokens)
        assert reply.num_blocks == 4 and np.array_equal(reply.payloads, data)

    asyncio.run(round_trip())
    pid = client.stats()["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(FabricTimeoutError, match="did not answer load"):
            asyncio.run(client.aload(NS, tokens))
    finally:
        os.kill(pid, signal.SIGCONT)
