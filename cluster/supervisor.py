"""Keeps one NodeActor on every alive Ray node, including nodes that join later.

`ensure_nodes(config)` is the whole policy: for each alive Ray node without a NodeActor, create
one (named after the node id, detached, pinned to that node, restarted by Ray if it dies) and ping
it so it opens its store and starts serving. `SupervisorActor` runs it every
`[cluster] heartbeat_s`; it also pings every NodeActor, which starts an actor that Ray restarted.

The supervisor issues no certificates (it holds no CA key): whoever adds a Ray node issues that node's
certificate (`kvfabric certs issue`, the chart's per-pod certificates, `LocalCluster.add_node`); until it
is there the node's actor refuses to start, and the next pass tries again.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.node.actor import NodeActor, node_actor_name
from fabric.config import Config

logger = logging.getLogger(__name__)

SUPERVISOR_NAME = "kvfabric-supervisor"


def alive_node_ids() -> list[str]:
    return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))


def node_actor(config: Config, node_id: str) -> ray.actor.ActorHandle:
    """The NodeActor of `node_id`, created if it does not exist."""
    return NodeActor.options(  # type: ignore[attr-defined]
        name=node_actor_name(node_id), namespace=config.cluster.namespace, lifetime="detached",
        get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(config, node_id)


def ensure_nodes(config: Config, timeout_s: float = 60.0) -> dict[str, dict[str, Any]]:
    """Start (or find) a NodeActor on every alive Ray node and wait until each serves; returns
    `{node_id: ping answer}` for the nodes that answered."""
    handles = {node_id: node_actor(config, node_id) for node_id in alive_node_ids()}
    refs = {node_id: h.ping.remote() for node_id, h in handles.items()}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    answers: dict[str, dict[str, Any]] = {}
    for node_id, ref in refs.items():
        if ref in ready:
            try:
                answers[node_id] = ray.get(ref)
            except ray.exceptions.RayError as e:
                logger.warning("NodeActor on %s failed to start: %s", node_id, e)
    return answers


@ray.remote(num_cpus=0, max_restarts=-1)
class SupervisorActor:
    def __init__(self, config: Config) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.config = config
        self._task: asyncio.Task[None] | None = None
        self.known: set[str] = set()

    async def run(self) -> None:
        """Start the watch loop (idempotent) and return."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            try:
                await asyncio.gather(*(self._ping(node_id) for node_id in alive_node_ids()))
            except ray.exceptions.RayError as e:
                logger.warning("supervisor pass failed: %s", e)
            await asyncio.sleep(self.config.cluster.heartbeat_s)


    async def _ping(self, node_id: str) -> None:
        handle = node_actor(self.config, node_id)
        if node_id not in self.known:
            logger.info("node %s has a NodeActor", node_id)
            self.known.add(node_id)
        try:
            await asyncio.wait_for(handle.ping.remote(), self.config.cluster.heartbeat_s * 5)
        except (ray.exceptions.RayError, TimeoutError) as e:
            logger.info("NodeActor on %s did not answer a ping (%s)", node_id, type(e).__name__)


def start_supervisor(config: Config) -> ray.actor.ActorHandle:
    handle = SupervisorActor.options(  # type: ignore[attr-defined]
        name=SUPERVISOR_NAME, namespace=config.cluster.namespace, lifetime="detached",
        get_if_exists=True).remote(config)
    ray.get(handle.run.remote())
    return handle
