"""A multi-user, multi-turn chat workload and the cache models a cluster's hit ratio is judged against.

    chat_trace(...)  ->  [TraceRequest(arrival_s, user, turn, tokens), ...]   (deterministic per seed)

Each conversation starts from one of `num_system_prompts` system prompts, picked with Zipf
popularity (a few are used by most users, as in a real deployment), and grows turn by turn: the
prompt of turn t is the system prompt, every earlier question and answer, and a new question. A
request picks one of the `num_users` live conversations at random; after `max_turns` turns that
user starts a new conversation. Arrivals are a Poisson process of `rate_per_s`.

Cache models, fed the same requests (block hashes, from `fabric.keys.block_hashes`):
- `PrefixLru`: an LRU of blocks with a capacity in blocks; a request hits the leading run of its
  blocks that is cached (the longest cached prefix, as an engine reuses it), then every block of
  the request is used (hits touched, the rest stored), evicting least recently used blocks;
- pooled: one `PrefixLru` with the whole cluster's capacity (the best a cluster could do if its
  nodes were one cache); isolated: one per node with that node's capacity, each request on the
  node the cluster's router chose (no sharing between nodes); max: unbounded capacity.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    user: int
    turn: int
    tokens: tuple[int, ...]


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (rank ** s) for rank in range(1, n + 1)]


def chat_trace(num_requests: int, *, num_users: int = 24, num_system_prompts: int = 12, zipf_s: float = 1.1,
               system_tokens: int = 1024, question_tokens: int = 48, answer_tokens: int = 96, max_turns: int = 6,
               rate_per_s: float = 20.0, vocab: int = 50_000, seed: int = 0) -> list[TraceRequest]:
    """`num_requests` chat requests (see the module docstring); the same arguments give the same trace."""
    if num_requests < 0 or num_users < 1 or num_system_prompts < 1 or max_turns < 1:
        raise ValueError("num_requests >= 0 and num_users, num_system_prompts, max_turns >= 1")
    rng = random.Random(seed)

    def words(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    systems = [words(system_tokens) for _ in range(num_system_prompts)]
    weights = _zipf_weights(num_system_prompts, zipf_s)
    history: list[list[int]] = [[] for _ in range(num_users)]
    turns = [0] * num_users

    def new_conversation(user: int) -> None:
        history[user] = list(rng.choices(systems, weights)[0])
        turns[user] = 0

    for user in range(num_users):
        new_conversation(user)
    out: list[TraceRequest] = []
    now = 0.0
    for _ in range(num_requests):
        now += rng.expovariate(rate_per_s)
        user = rng.randrange(num_users)
        if turns[user] >= max_turns:
            new_conversation(user)
        prompt = history[user] + words(question_tokens)
        out.append(TraceRequest(now, user, turns[user], tuple(prompt)))
        history[user] = prompt + words(answer_tokens)   # the answer becomes part of the next turn's prompt
        turns[user] += 1
    return out


class PrefixLru:
    """An LRU cache of blocks that serves the longest cached prefix of each request."""

    def __init__(self, capacity_blocks: int | None) -> None:
        if capacity_blocks is not None and capacity_blocks < 0:
            raise ValueError(f"capacity must be >= 0 blocks, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def serve(self, hashes: Sequence[bytes]) -> int:
        """Hit blocks of one request (its cached leading run); then holds the request's blocks."""
        hits = 0
        while hits < len(hashes) and hashes[hits] in self._blocks:
            hits += 1
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        if self.capacity is not None:
            while len(self._blocks) > self.capacity:
                self._blocks.popitem(last=False)
        return hits


def hit_ratio(cache: PrefixLru, requests: Iterable[Sequence[bytes]]) -> float:
    hits = total = 0
    for hashes in requests:
        hits += cache.serve(hashes)
        total += len(hashes)
    return hits / total if total else 0.0


def isolated_hit_ratio(capacity_blocks: int, requests: Sequence[Sequence[bytes]], nodes: Sequence[str]) -> float:
    """Per-node LRUs of `capacity_blocks` each, request i served on `nodes[i]` only."""
    if len(nodes) != len(requests):
        raise ValueError(f"{len(requests)} requests but {len(nodes)} node choices")
    caches: dict[str, PrefixLru] = {}
    hits = total = 0
    for hashes, node in zip(requests, nodes, strict=True):
        hits += caches.setdefault(node, PrefixLru(capacity_blocks)).serve(hashes)
        total += len(hashes)
    return hits / total if total else 0.0
