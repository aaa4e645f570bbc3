"""The owner map of one directory shard: block hash -> the indexes of the nodes that hold it, with
their block versions. Pure and passive: `DirectoryShard` (directory/shard.py) decides who owns what
and when a node is dead; this keeps the map compact and answers it.

Layout (per (hash, node) entry: the 32-byte key object, owner tuples and the dict itself;
`benchmarks/bench_directory.py` measures the bytes, docs/benchmarks.md lists them):

    owners  : dict[bytes, int | tuple[int, ...]]   hash -> owner index, or >= 2 indexes sorted by node id
    versions: dict[bytes, dict[int, bytes]]        hash -> owner index -> block version, grouped by content

A single owner is stored as a bare int (the same int object as the node's index, so it costs nothing
beyond the dict slot); only shared blocks pay for a tuple. Block versions (a tag of the bytes and the
producer's name, fabric.provenance.block_version) are kept only for hashes whose owners reported one:
`locate` answers each owner's version and the oldest version (by when its content was first reported)
an owner still holds (the one pullers take: docs/provenance.md), so owners holding different bytes at
one address are told apart.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence

from cluster.directory.types import NodeId
from fabric.provenance import VERSION_TAG_SIZE

MAX_VERSION_BYTES = VERSION_TAG_SIZE + 255   # a block version: its tag and a producer name (fabric.provenance)


class OwnerMap:
    """Hash -> owner node indexes (and their block versions); `ids` names each index (the shard's list,
    shared, only ever appended to), and owners are kept sorted by it."""

    def __init__(self, ids: list[NodeId]) -> None:
        self._ids = ids
        self._owners: dict[bytes, int | tuple[int, ...]] = {}
        self._versions: dict[bytes, dict[int, bytes]] = {}
        self.num_entries = 0
        self._num_single = 0     # hashes with exactly one owner (stored as a bare int)

    @property
    def num_hashes(self) -> int:
        return len(self._owners)

    def owners(self, hashes: Sequence[bytes], dead: frozenset[int]) -> list[tuple[NodeId, ...]]:
        """Per hash, the ids of its owners not in `dead`, sorted by node id."""
        ids = self._ids
        get = self._owners.get
        owners: list[tuple[NodeId, ...]] = []
        append = owners.append
        for h in hashes:
            v = get(h)
            if v is None:
                append(())
            elif isinstance(v, int):
                append(() if v in dead else (ids[v],))
            else:
                append(tuple([ids[n] for n in v if n not in dead]))
        return owners

    def versions(self, hashes: Sequence[bytes], owners: Sequence[tuple[NodeId, ...]], dead: frozenset[int],
                 index: Mapping[str, int]) -> tuple[tuple[tuple[bytes, ...], ...], tuple[bytes, ...]]:
        """Per hash, each listed owner's block version and the first-reported version of a live owner
        (both empty when no owner of any hash reported one)."""
        if not self._versions:
            return (), ()
        get = self._versions.get
        versions: list[tuple[bytes, ...]] = []
        firsts: list[bytes] = []
        for h, listed in zip(hashes, owners, strict=True):
            known = get(h)
            if not known:
                versions.append(())
                firsts.append(b"")
                continue
            versions.append(tuple(known.get(index[n], b"") for n in listed))
            firsts.append(next((v for idx, v in known.items() if idx not in dead), b""))
        return tuple(versions), tuple(firsts)

    def add(self, h: bytes, idx: int) -> None:
        """Node `idx` owns `h` now (it did not before)."""
        self.num_entries += 1
        v = self._owners.get(h)
        if v is None:
            self._owners[h] = idx
            self._num_single += 1
            return
        if isinstance(v, int):
            self._num_single -= 1
            v = (v,)
        assert idx not in v, f"node {self._ids[idx]} already owns {h.hex()}"
        self._owners[h] = tuple(sorted((*v, idx), key=self._ids.__getitem__))

    def set_version(self, h: bytes, idx: int, claim: object) -> None:
        """Record the owner's block version of `h`. A node's claim, checked here (locate answers only
        bytes): anything but bytes of at most MAX_VERSION_BYTES counts as b"", unknown, and clears it."""
        version = claim if type(claim) is bytes and len(claim) <= MAX_VERSION_BYTES else b""
        known = self._versions.get(h)
        if not version:
            if known is not None:
                known.pop(idx, None)
            return
        if known is None:
            self._versions[h] = {idx: version}
        elif known.get(idx) != version:
            # Owners stay grouped by content tag, groups in the order their tag was first reported,
            # so the first entry is the oldest version any owner still holds (O(owners of h)).
            known.pop(idx, None)
            tag = version[:VERSION_TAG_SIZE]
            entries = list(known.items())
            at = max((i + 1 for i, (_, v) in enumerate(entries) if v[:VERSION_TAG_SIZE] == tag), default=len(entries))
            entries.insert(at, (idx, version))
            self._versions[h] = dict(entries)

    def remove(self, h: bytes, idx: int) -> None:
        """Node `idx` owns `h` no more (it did before), nor its block version."""
        known = self._versions.get(h)
        if known is not None:
            known.pop(idx, None)
            if not known:
                del self._versions[h]
        self.num_entries -= 1
        v = self._owners[h]
        if isinstance(v, int):
            assert v == idx, f"node {self._ids[idx]} does not own {h.hex()}"
            del self._owners[h]
            self._num_single -= 1
            return
        rest = tuple([n for n in v if n != idx])
        assert len(rest) == len(v) - 1, f"node {self._ids[idx]} does not own {h.hex()}"
        if len(rest) == 1:
            self._owners[h] = rest[0]
            self._num_single += 1
        else:
            self._owners[h] = rest

    def bytes_per_entry(self, node_sets: Iterable[set[bytes]]) -> float:
        """Estimate from object sizes: dict + key bytes + owner tuples + the per-node hash sets."""
        if self.num_entries == 0:
            return 0.0
        num_hashes = len(self._owners)
        key_size = sys.getsizeof(next(iter(self._owners))) if num_hashes else 0
        num_multi = num_hashes - self._num_single
        tuples = num_multi * sys.getsizeof(()) + 8 * (self.num_entries - self._num_single)
        sets = sum(sys.getsizeof(entries) for entries in node_sets)
        # a hash owned by k nodes is one dict key plus up to k - 1 more equal bytes objects in other nodes' sets
        keys = key_size * self.num_entries
        total = sys.getsizeof(self._owners) + keys + tuples + sets
        return total / self.num_entries
