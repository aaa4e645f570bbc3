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
Ties (equal run length) go by rendezvous hashing: BLAKE3(block hash ‖ node id), lowest
first. So no node wins every tie by its name (a node called "0-…" would otherwise be asked first
for everything), and the same block is still asked of the same owner every time.
Complexity: O(blocks x owners per block).

Owners that hold another version of a block (different bytes at one address: two producers, or a
producer and a liar) are not mixed: `agreeing_owners` keeps, per block, the owners of the version
that more independent producers hold (and owners that reported none), treats a tie as a dispute
(a miss), and names the producers that disagree and those outvoted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import blake3

from fabric.provenance import VERSION_TAG_SIZE


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


def plan_pulls(owners: Sequence[Sequence[str]], start: int, *, hashes: Sequence[bytes] | None = None
               ) -> list[PullRun]:
    """Cover blocks `start..` with the fewest runs, stopping at the first block with no owner.

    `owners[i]` are the live owners of block i; blocks before `start` are held locally. At each step
    the owner with the longest run from the current block wins; ties go to the rendezvous hash of
    the run's first block (`hashes[i]`; its index when no hashes are given) with the node id.
    Alternates are ranked the same way.
    """
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    members = [frozenset(o) for o in owners]
    plan: list[PullRun] = []
    i = start
    while i < len(members) and members[i]:
        lengths = {node: _run_length(members, node, i) for node in members[i]}
        block = hashes[i] if hashes is not None else i.to_bytes(8, "little")
        ranked = sorted(lengths, key=lambda n: (-lengths[n], _rendezvous(block, n), n))
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


@dataclass(frozen=True, slots=True)
class Vote:
    """`agreeing_owners`' answer for a run of blocks."""

    kept: list[list[str]]                              # per block, the owners to pull it from
    disagreements: list[tuple[int, bytes, bytes]]      # (block, version taken, version passed over)
    disputed: list[int]                                # blocks whose leading versions tie: misses
    outvoted: list[tuple[int, bytes, bytes]]           # (block, winner, loser): >= 2 producers beat the loser


def agreeing_owners(owners: Sequence[Sequence[str]], versions: Sequence[Sequence[bytes]],
                    firsts: Sequence[bytes]) -> Vote:
    """Per block, the owners of the version that the most independent producers hold (mirrors carry
    their producer's version, so they do not count twice), with the owners whose version is unknown.
    A tie between the leading versions is a dispute: the block is nobody's (a miss) until one side
    is quarantined, purged or joined by another producer. Without versions (`firsts` empty) every
    owner is kept. `firsts` (the first-reported version) orders the groups only for the report."""
    if not firsts:
        return Vote([list(o) for o in owners], [], [], [])
    kept: list[list[str]] = []
    disagreements: list[tuple[int, bytes, bytes]] = []
    disputed: list[int] = []
    outvoted: list[tuple[int, bytes, bytes]] = []
    for b, per_block in enumerate(owners):
        per_owner = versions[b] if b < len(versions) else ()
        if len(per_owner) != len(per_block):
            kept.append(list(per_block))
            continue
        groups: dict[bytes, tuple[set[str], list[str], bytes]] = {}   # tag -> (producers, owners, a version)
        unknown: list[str] = []
        first = firsts[b] if b < len(firsts) else b""
        if first:
            groups[first[:VERSION_TAG_SIZE]] = (set(), [], first)
        for node, version in zip(per_block, per_owner, strict=True):
            if not version:
                unknown.append(node)
                continue
            producers, members, _ = groups.setdefault(version[:VERSION_TAG_SIZE], (set(), [], version))
            producers.add(version[VERSION_TAG_SIZE:].decode(errors="replace"))
            members.append(node)
        ranked = sorted((g for g in groups.values() if g[1]), key=lambda g: -len(g[0]))   # stable: first-reported first
        if len(ranked) <= 1:
            kept.append([*(ranked[0][1] if ranked else []), *unknown])
            continue
        top, runner_up = ranked[0], ranked[1]
        if len(top[0]) == len(runner_up[0]):
            kept.append([])
            disputed.append(b)
        else:
            kept.append([*top[1], *unknown])
        for other in ranked[1:]:
            disagreements.append((b, top[2], other[2]))
            if b not in disputed and len(top[0]) >= 2 and len(top[0]) > len(other[0]):
                outvoted.append((b, top[2], other[2]))
    return Vote(kept, disagreements, disputed, outvoted)
