"""Pull plans: which peer sends which blocks of a prompt's missing prefix. Pure: no I/O, no Ray.

Input is the directory's answer per block (live owners, a hint); output is a list of runs, each a
contiguous range of blocks fetched from one owner in one request, with the other owners of the
whole range as fallbacks:

    blocks:   0 1 2 | 3 4 5 6 7 8 | 9 10
    local:    x x x |             |           start = 3
    owners:         | A A A A . . |           A owns 3..6, B owns 3..8, C owns 6..10
                    | B B B B B B |
                    |       C C C | C  C
    plan:           B[3,9) alts ()  then C[9,11) alts ()

Greedy longest run first is optimal for the number of requests: the run that reaches furthest from
the current block can never be beaten by one that stops earlier (the classic interval-cover argument).
Only a leading prefix is useful to an engine, so the plan stops at the first block nobody owns.
Ties (equal run length and load) go by rendezvous hashing: BLAKE3(block hash ‖ node id), lowest
first. So no node wins every tie by its name (a node called "0-…" would otherwise be asked first
for everything), and the same block is still asked of the same owner every time.
Complexity: O(blocks x owners per block).

Owners that hold another version of a block (different bytes at one address: two producers, or a
producer and a liar) are not mixed: `agreeing_owners` keeps, per block, the owners of the version
the directory learned first (and owners that reported none) and names the producers that disagree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import blake3

from fabric.provenance import VERSION_TAG_SIZE

_NO_LOAD: Mapping[str, float] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class PullRun:
    """Blocks [start, end) from `node_id`; every alternate owns all of [start, end) too, best first."""

    node_id: str
    start: int
    end: int
    alternates: tuple[str, ...]

    @property
    def num_blocks(self) -> int:
        return self.end - self.start


def plan_pulls(owners: Sequence[Sequence[str]], start: int, *, load: Mapping[str, float] = _NO_LOAD,
               hashes: Sequence[bytes] | None = None) -> list[PullRun]:
    """Cover blocks `start..` with the fewest runs, stopping at the first block with no owner.

    `owners[i]` are the live owners of block i; blocks before `start` are held locally. At each step
    the owner with the longest run from the current block wins; ties go to the lower `load`, then to
    the rendezvous hash of the run's first block (`hashes[i]`; its index when no hashes are given)
    with the node id. Alternates are ranked the same way.
    """
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    members = [frozenset(o) for o in owners]
    plan: list[PullRun] = []
    i = start
    while i < len(members) and members[i]:
        lengths = {node: _run_length(members, node, i) for node in members[i]}
        block = hashes[i] if hashes is not None else i.to_bytes(8, "little")
        ranked = sorted(lengths, key=lambda n: (-lengths[n], load.get(n, 0.0), _rendezvous(block, n), n))
        best = ranked[0]
        end = i + lengths[best]
        alternates = tuple(n for n in ranked[1:] if i + lengths[n] >= end)
        plan.append(PullRun(best, i, end, alternates))
        i = end
    return plan


def _rendezvous(block: bytes, node: str) -> bytes:
    """The rendezvous weight of `node` for `block` (lowest first): BLAKE3, the same in every process."""
    return blake3.blake3(block + node.encode()).digest()


def _run_length(members: Sequence[frozenset[str]], node: str, i: int) -> int:
    j = i
    while j < len(members) and node in members[j]:
        j += 1
    return j - i


def agreeing_owners(owners: Sequence[Sequence[str]], versions: Sequence[Sequence[bytes]], firsts: Sequence[bytes]
                    ) -> tuple[list[list[str]], list[tuple[int, bytes, bytes]]]:
    """Per block, the owners of its first-reported version (by content tag) and those whose version
    is unknown; and each disagreement as (block, first version, other version). Without versions
    (`firsts` empty) every owner is kept."""
    if not firsts:
        return [list(o) for o in owners], []
    kept: list[list[str]] = []
    disagreements: list[tuple[int, bytes, bytes]] = []
    for b, per_block in enumerate(owners):
        first = firsts[b] if b < len(firsts) else b""
        per_owner = versions[b] if b < len(versions) else ()
        if not first or len(per_owner) != len(per_block):
            kept.append(list(per_block))
            continue
        tag = first[:VERSION_TAG_SIZE]
        keep: list[str] = []
        others: dict[bytes, bytes] = {}
        for node, version in zip(per_block, per_owner, strict=True):
            if not version or version[:VERSION_TAG_SIZE] == tag:
                keep.append(node)
            else:
                others.setdefault(version, version)
        kept.append(keep)
        disagreements.extend((b, first, other) for other in others)
    return kept, disagreements
