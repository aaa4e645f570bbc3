"""KV-aware routing: which node should serve a prompt. Pure: no I/O, no Ray, no clock.

The cost of sending a prompt of `num_blocks` blocks to a node is measured in blocks of prefill:

    cost = sum(tier_weight[where] for each block of the node's consecutive cached prefix)
         + (num_blocks - len(prefix))          # blocks it must compute
         + load_weight * load                  # queued / in-flight requests ahead of it

A block already in GPU memory costs nothing to reuse; one in RAM, on SSD, or on a peer costs a
fraction of a recompute (the copy, the disk read, the network pull). The node with the lowest cost
wins. Ties are broken by rendezvous hashing of the prompt's first block over the tied nodes (the
node whose BLAKE3(prompt key ‖ node id) is highest): equal nodes share distinct prompts evenly, the
same prompt always goes to the same node, and no node id is favoured. Cache affinity alone would
pile every request of a popular system prompt onto one node, so when loads differ too much
(`max - min > imbalance_min` and `max > imbalance_ratio * min`) the least-loaded node is chosen
instead, as SGLang's cache-aware router does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import blake3

#: fraction of one block's prefill that reusing a cached block costs, by where it is (cluster.api.Where)
DEFAULT_TIER_WEIGHTS: Mapping[str, float] = MappingProxyType({"device": 0.0, "ram": 0.05, "ssd": 0.15, "peer": 0.3})


@dataclass(frozen=True, slots=True)
class NodeView:
    """What the router knows of one node for one prompt."""

    node_id: str
    cached: Sequence[str]   # per leading cached block: "device" | "ram" | "ssd" | "peer"
    load: float             # queued + in-flight requests


@dataclass(frozen=True, slots=True)
class RouteDecision:
    node_id: str
    cost: float
    reason: str   # "cost" | "imbalance"


class Router:
    """Chooses nodes by prefill cost with a load-imbalance override; keeps the cluster hit ratio."""

    def __init__(self, *, tier_weights: Mapping[str, float] | None = None, load_weight: float = 2.0,
                 imbalance_ratio: float = 2.0, imbalance_min: float = 8.0) -> None:
        weights = dict(DEFAULT_TIER_WEIGHTS if tier_weights is None else tier_weights)
        if any(not 0.0 <= w <= 1.0 for w in weights.values()):
            raise ValueError(f"tier weights are fractions of a recompute, in [0, 1]: {weights}")
        if load_weight < 0 or imbalance_ratio < 1 or imbalance_min < 0:
            raise ValueError("load_weight and imbalance_min must be >= 0 and imbalance_ratio >= 1")
        self.tier_weights = weights
        self.load_weight = load_weight
        self.imbalance_ratio = imbalance_ratio
        self.imbalance_min = imbalance_min
        self._num_blocks = 0
        self._num_hit_blocks = 0

    def cost(self, num_blocks: int, view: NodeView) -> float:
        """Blocks of prefill (tier-weighted for the cached prefix) plus the load term."""
        prefix = view.cached[:num_blocks]
        try:
            reuse = sum(self.tier_weights[where] for where in prefix)
        except KeyError as e:
            raise ValueError(f"node {view.node_id}: unknown tier {e.args[0]!r}; "
                             f"known: {sorted(self.tier_weights)}") from None
        return reuse + (num_blocks - len(prefix)) + self.load_weight * view.load

    def choose(self, num_blocks: int, views: Sequence[NodeView], prompt_key: bytes = b"") -> RouteDecision:
        """The node to serve a prompt of `num_blocks` full blocks; ValueError if there is none.
        `prompt_key` (the hash of the prompt's first block) breaks ties between equal nodes."""
        if not views:
            raise ValueError("no nodes to route to")
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        costs = {v.node_id: self.cost(num_blocks, v) for v in views}
        loads = [v.load for v in views]
        lo, hi = min(loads), max(loads)
        if hi - lo > self.imbalance_min and hi > self.imbalance_ratio * lo:
            least = [v for v in views if v.load == lo]
            best = min(least, key=lambda v: (costs[v.node_id], _rendezvous(prompt_key, v.node_id)))
            return RouteDecision(best.node_id, costs[best.node_id], "imbalance")
        best = min(views, key=lambda v: (costs[v.node_id], _rendezvous(prompt_key, v.node_id)))
        return RouteDecision(best.node_id, costs[best.node_id], "cost")

    def record(self, num_blocks: int, num_hit_blocks: int) -> None:
        """Count one served request: how many of its blocks were reused instead of computed."""
        if not 0 <= num_hit_blocks <= num_blocks:
            raise ValueError(f"hit blocks {num_hit_blocks} not in 0..{num_blocks}")
        self._num_blocks += num_blocks
        self._num_hit_blocks += num_hit_blocks

    @property
    def hit_ratio(self) -> float:
        """Reused blocks / requested blocks over every recorded request (0.0 before any)."""
        return self._num_hit_blocks / self._num_blocks if self._num_blocks else 0.0


def _rendezvous(prompt_key: bytes, node_id: str) -> bytes:
    """Sort key of a node for one prompt: the node with the highest BLAKE3(key ‖ node) sorts first."""
    digest = blake3.blake3(prompt_key + b"\x00" + node_id.encode()).digest()
    return bytes(255 - b for b in digest[:8])
