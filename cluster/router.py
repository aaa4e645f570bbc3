"""KV-aware routing: which node should serve a prompt. Pure: no I/O, no Ray, no clock.

The cost of sending a prompt of `num_blocks` blocks to a node is measured in blocks of prefill:

    cost = sum(tier_weight[where] for each block of the node's consecutive cached prefix)
         + (num_blocks - len(prefix))                 # blocks it must compute
         + queue_weight * queued_blocks                # prefill its engines have queued ahead of it
         + load_weight * requests                      # requests running or queued there
         + evict_weight * evicted                      # blocks storing the prompt pushes out of a full cache
         + fill_weight * stored * (fill - mean fill)   # a fuller node than the others pays, an emptier one earns

A block already in GPU memory costs nothing to reuse; one in RAM, on SSD, or on a peer costs a
fraction of a recompute (the copy, the disk read, the network pull). Prefill queued on a node delays
this prompt's by as much, block for block. Serving a prompt stores every block of it the node does
not hold yet (`stored`: computed, or pulled and mirrored); on a full node each pushes out one that a
later request may have reused. And the blocks go where the caches have room: a node fuller than the
mean of the nodes compared pays for each block it would store, one emptier earns for it, so a node
with an empty cache is where a new prefix grows, not a node to avoid. When every prompt starts with
the same system prompt, the first node to hold it stops taking every new conversation once it is
fuller than the rest; another pulls the prompt once, and from then on holds it too. When the nodes
are equally full, the term is zero.

The node with the lowest cost wins, except that a node whose queue is past `max_queued_blocks` loses
to every node within it. Ties are broken by rendezvous hashing of a key that differs per request
(the hash of the prompt's last full block, which chains over the whole prompt): the node whose
BLAKE3(key ‖ node id) is highest. Equal nodes then share distinct requests evenly, the same prompt
always goes to the same node, and no node id is favoured. A key common to many requests (such as
the first block, when every prompt starts with the same system prompt) would send every tie to one
node.

`choose` is O(nodes x prompt blocks); the router keeps only the cluster hit ratio it is told.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import blake3

from cluster.api import LookupReply

#: fraction of one block's prefill that reusing a cached block costs, by where it is (cluster.api.Where)
DEFAULT_TIER_WEIGHTS: Mapping[str, float] = MappingProxyType({"device": 0.0, "ram": 0.05, "ssd": 0.15, "peer": 0.3})
#: a queue this long (in the prompt's blocks; 8,192 tokens at 16 per block) loses to any shorter one
DEFAULT_MAX_QUEUED_BLOCKS = 512.0


@dataclass(frozen=True, slots=True)
class NodeView:
    """What the router knows of one node for one prompt."""

    node_id: str
    cached: Sequence[str]        # per leading cached block: "device" | "ram" | "ssd" | "peer"
    requests: int = 0            # requests running or queued on its engines
    queued_blocks: float = 0.0   # prefill tokens its engines accepted and have not computed, in blocks
    held_blocks: int = 0         # blocks its cache holds ...
    capacity_blocks: int = 0     # ... out of this many (0: not known, never counted as evicting)

    @classmethod
    def of(cls, node_id: str, reply: LookupReply) -> NodeView:
        """The view a node's lookup reply gives: its cached prefix, its engines' load, its cache's fill."""
        return cls(node_id, [loc.where.value for loc in reply.locations], reply.load.requests,
                   reply.load.queued_prefill_tokens / reply.block_size, reply.fill.held_blocks,
                   reply.fill.capacity_blocks)

    @property
    def num_local_blocks(self) -> int:
        """Leading cached blocks held by the node itself (before the first one it would pull)."""
        n = 0
        while n < len(self.cached) and self.cached[n] != "peer":
            n += 1
        return n


@dataclass(frozen=True, slots=True)
class RouteDecision:
    node_id: str
    cost: float
    reason: str   # "cost" | "queue bound" (the cheaper nodes were past the queue bound)


class Router:
    """Chooses nodes by prefill cost, queued work, evictions and fill; keeps the cluster hit ratio."""

    def __init__(self, *, tier_weights: Mapping[str, float] | None = None, load_weight: float = 2.0,
                 queue_weight: float = 1.0, evict_weight: float = 1.0, fill_weight: float = 1.0,
                 max_queued_blocks: float = DEFAULT_MAX_QUEUED_BLOCKS) -> None:
        weights = dict(DEFAULT_TIER_WEIGHTS if tier_weights is None else tier_weights)
        if any(not 0.0 <= w <= 1.0 for w in weights.values()):
            raise ValueError(f"tier weights are fractions of a recompute, in [0, 1]: {weights}")
        if min(load_weight, queue_weight, evict_weight, fill_weight) < 0 or max_queued_blocks <= 0:
            raise ValueError("load, queue, evict and fill weights must be >= 0 and max_queued_blocks > 0")
        self.tier_weights = weights
        self.load_weight = load_weight
        self.queue_weight = queue_weight
        self.evict_weight = evict_weight
        self.fill_weight = fill_weight
        self.max_queued_blocks = max_queued_blocks
        self._num_blocks = 0
        self._num_hit_blocks = 0

    def cost(self, num_blocks: int, view: NodeView, mean_fill: float | None = None) -> float:
        """Blocks of prefill (tier-weighted for the cached prefix), plus queued work and evictions; with
        `mean_fill` (of the nodes it is compared with), plus what it stores times how much fuller than
        them it is (less, when it is emptier)."""
        prefix = view.cached[:num_blocks]
        try:
            reuse = sum(self.tier_weights[where] for where in prefix)
        except KeyError as e:
            raise ValueError(f"node {view.node_id}: unknown tier {e.args[0]!r}; "
                             f"known: {sorted(self.tier_weights)}") from None
        grow = 0.0
        if mean_fill is not None and view.capacity_blocks:
            grow = self.fill_weight * num_stored(num_blocks, view) * (view.held_blocks / view.capacity_blocks
                                                                      - mean_fill)
        return (reuse + (num_blocks - len(prefix)) + self.queue_weight * view.queued_blocks
                + self.load_weight * view.requests + self.evict_weight * num_evicted(num_blocks, view) + grow)

    def choose(self, hashes: Sequence[bytes], views: Sequence[NodeView]) -> RouteDecision:
        """The node to serve a prompt whose full blocks have these hashes (`fabric.keys.block_hashes`);
        ValueError if there is none. Ties between equal nodes go by the last hash, which chains over
        the whole prompt: it differs between requests that share only their first blocks."""
        if not views:
            raise ValueError("no nodes to route to")
        num_blocks = len(hashes)
        request_key = bytes(hashes[-1]) if hashes else b""
        fills = [v.held_blocks / v.capacity_blocks for v in views if v.capacity_blocks]
        mean_fill = sum(fills) / len(fills) if fills else 0.0
        costs = {v.node_id: self.cost(num_blocks, v, mean_fill) for v in views}
        within = [v for v in views if v.queued_blocks <= self.max_queued_blocks]
        candidates = within or list(views)
        best = min(candidates, key=lambda v: (costs[v.node_id], _rendezvous(request_key, v.node_id)))
        cheapest = min(costs.values())
        reason = "cost" if costs[best.node_id] == cheapest else "queue bound"
        return RouteDecision(best.node_id, costs[best.node_id], reason)

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


def num_stored(num_blocks: int, view: NodeView) -> int:
    """Blocks the node would store for this prompt: every block past its local prefix (computed, or
    pulled and mirrored)."""
    return max(0, num_blocks - view.num_local_blocks)


def num_evicted(num_blocks: int, view: NodeView) -> int:
    """Blocks the node would evict to store this prompt: what does not fit in its free room pushes an
    older block out."""
    if not view.capacity_blocks:
        return 0
    return max(0, num_stored(num_blocks, view) - max(0, view.capacity_blocks - view.held_blocks))


def _rendezvous(request_key: bytes, node_id: str) -> bytes:
    """Sort key of a node for one request: the node with the highest BLAKE3(key ‖ node) sorts first."""
    digest = blake3.blake3(request_key + b"\x00" + node_id.encode()).digest()
    return bytes(255 - b for b in digest[:8])
