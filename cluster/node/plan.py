"""One load's plan: where each block comes from, and the buffers the local read and the pulls fill.

    Placement (reads.py: local tiers + directory + plan_pulls)  ── what is where; a lookup ends here
        └──► deadline cut, local read, audit ──► LoadPlan ──► pull_prefix (pulls.py) ──► LoadReply
                                                          └──► a layer stream waits on `progress`

A load is planned once, by the NodeLoader, into one `LoadPlan`: the blocks planned, their owners
(per block, the peers holding the version most producers hold), the first round of pull runs,
the reply buffer ([blocks, layers, bytes]) with each block's source, digests and provenance
record, and which (block, layer) slots are filled so far. The puller fills the plan's buffers;
only when an owner fails does it plan again, over the owners not seen failing (pulls.py). The
plan object is frozen: what changes during a load is the contents of its buffers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from cluster.planner import PullRun
from fabric.keys import BlockHash
from fabric.provenance import Provenance
from fabric.tiers.base import Tier
from transports.core.base import Peer
from transports.trust.provenance_check import ProvenanceVerifier


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a run of block hashes is: the leading run held here (its tiers), then, per block, the
    owners to pull it from and the pull runs over them (empty when pulls are off or all is local)."""

    hashes: Sequence[BlockHash]
    tiers: Sequence[Tier]                   # the leading run held by this node
    owners: Sequence[Sequence[str]]         # per block (empty for the local run), peers reachable here
    runs: Sequence[PullRun]                 # the rest, from `len(tiers)` on, as plan_pulls covers it
    peers: Mapping[str, Peer]               # node id -> how to reach it
    producers: frozenset[str]               # the producers the owners' versions name

    @property
    def num_local(self) -> int:
        return len(self.tiers)


@dataclass(slots=True)
class Provenances:
    """What a pull checks provenance against, and the record each pulled block keeps (for a mirror):
    `records[b]` is the one record its layers were accepted under (None: none yet)."""

    verifier: ProvenanceVerifier
    namespace: bytes
    records: list[Provenance | None]
    tenants: frozenset[str] | None = None   # whose namespace it is: producers must be authorised for them
    quarantined: frozenset[str] = frozenset()   # producers caught signing wrong KV: their records are refused
    _seen: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        self._seen = [False] * len(self.records)

    def accept(self, b: int, record: Provenance | None) -> bool:
        """Whether a layer of block b under `record` may join the block: its first record, or that one again."""
        if not self._seen[b]:
            self._seen[b] = True
            self.records[b] = record
            return True
        return record is self.records[b] or record == self.records[b]

    def forget(self, b: int) -> None:
        """Block b starts over (its layers are pulled again, whole, from another owner)."""
        self._seen[b] = False
        self.records[b] = None


@dataclass(slots=True)
class LayerProgress:
    """Which (block, layer) slots of a planned load are filled; lets a consumer wait per layer."""

    num_blocks: int
    num_layers: int
    done: np.ndarray = field(init=False)
    layer_ready: list[asyncio.Event] = field(init=False)
    _missing: list[int] = field(init=False)   # per layer, blocks not yet filled: O(1) per fill

    def __post_init__(self) -> None:
        self.done = np.zeros((self.num_blocks, self.num_layers), dtype=bool)
        self.layer_ready = [asyncio.Event() for _ in range(self.num_layers)]
        self._missing = [self.num_blocks] * self.num_layers
        if self.num_blocks == 0:   # nothing to wait for
            for ready in self.layer_ready:
                ready.set()

    def fill(self, block: int, layer: int) -> None:
        if self.done[block, layer]:
            return
        self.done[block, layer] = True
        self._missing[layer] -= 1
        if self._missing[layer] == 0:
            self.layer_ready[layer].set()

    def fill_blocks(self, num_blocks: int) -> None:
        """Blocks 0..num_blocks are filled in every layer (read from this node's store)."""
        for b in range(num_blocks):
            for layer in range(self.num_layers):
                self.fill(b, layer)

    def unfill_block(self, block: int) -> None:
        """Every layer of `block` is missing again (a block-major pull re-pulls it whole)."""
        for layer in range(self.num_layers):
            if self.done[block, layer]:
                self.done[block, layer] = False
                self._missing[layer] += 1
                self.layer_ready[layer].clear()

    def complete_blocks(self) -> int:
        """Length of the leading run of blocks filled in every layer."""
        full = self.done.all(axis=1)
        return self.num_blocks if full.all() else int(np.argmin(full))


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """One load, planned once: blocks `0..num_blocks` of `hashes`, the first `num_local` read here,
    the rest pulled by `runs` (an owner that fails hands its blocks to the next: pulls.py).

    `out[b]` (uint8 [layers, bytes]) receives block b; `sources[b]` says where it came from
    (a tier, or "peer:<node id>" once pulled); `digests[b][layer]` and `checks.records[b]` are a
    pulled block's digests and provenance record (what a mirror writes); `progress` says which
    slots are filled. `layer_major`: pull layer 0 of every block first (a layer stream reads it
    early); else block-major, received straight into `out`. `audit_blocks`: blocks the engine is
    to recompute instead (a sampled load pulls nothing). `pull_deadline_s`: how long the pulls may
    take before the engine could have computed their blocks (None: no deadline)."""

    hashes: Sequence[BlockHash]
    num_local: int
    owners: Sequence[Sequence[str]]
    runs: Sequence[PullRun]
    peers: Mapping[str, Peer]
    out: np.ndarray
    sources: list[str]
    digests: list[list[bytes]]
    checks: Provenances
    progress: LayerProgress
    layer_major: bool = True
    audit_blocks: int = 0
    pull_deadline_s: float | None = None

    @property
    def num_blocks(self) -> int:
        return self.progress.num_blocks

    @property
    def provenance(self) -> list[Provenance | None]:
        return self.checks.records


def new_plan(hashes: Sequence[BlockHash], owners: Sequence[Sequence[str]], runs: Sequence[PullRun],
             peers: Mapping[str, Peer], out: np.ndarray, *, num_blocks: int, num_local: int, sources: list[str],
             verifier: ProvenanceVerifier, namespace: bytes, tenants: frozenset[str] | None = None,
             quarantined: frozenset[str] = frozenset(), layer_major: bool = True, audit_blocks: int = 0,
             pull_deadline_s: float | None = None) -> LoadPlan:
    """The plan of a load of `num_blocks` blocks (`out` holds at least as many) whose first `num_local`
    are already in `out`: fresh digests, provenance records and progress (the local blocks counted filled)."""
    num_layers = out.shape[1]
    progress = LayerProgress(num_blocks, num_layers)
    progress.fill_blocks(min(num_local, num_blocks))
    records: list[Provenance | None] = [None] * num_blocks
    checks = Provenances(verifier, namespace, records, tenants, quarantined)
    return LoadPlan(hashes, num_local, owners, tuple(runs), peers, out, sources,
                    [[b""] * num_layers for _ in range(num_blocks)], checks, progress, layer_major, audit_blocks,
                    pull_deadline_s)
