"""Merkle trees over a run's leaves: every leaf's path leads to the root, nothing else does."""

from __future__ import annotations

import blake3
import pytest

from fabric.merkle import MAX_DEPTH, leaf_hash, root_and_paths, root_from_path


def _leaves(n: int) -> list[bytes]:
    return [leaf_hash(b"leaf %d" % i) for i in range(n)]


def _reference_root(leaves: list[bytes]) -> bytes:
    """The tree hash written out as defined (largest power of two on the left), for comparison."""
    if len(leaves) == 1:
        return leaves[0]
    k = 1 << ((len(leaves) - 1).bit_length() - 1)
    return blake3.blake3(b"\x01" + _reference_root(leaves[:k]) + _reference_root(leaves[k:])).digest()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 16, 31, 33, 100])
def test_every_leafs_path_leads_to_the_root(n: int) -> None:
    leaves = _leaves(n)
    root, paths = root_and_paths(leaves)
    assert root == _reference_root(leaves)
    assert len(paths) == n
    for i, (leaf, path) in enumerate(zip(leaves, paths, strict=True)):
        assert len(path) <= MAX_DEPTH
        assert root_from_path(leaf, i, n, path) == root


def test_a_path_proves_only_its_own_leaf_position_and_tree_size() -> None:
    leaves = _leaves(11)
    root, paths = root_and_paths(leaves)
    assert root_from_path(leaves[3], 4, 11, paths[3]) != root         # another position
    assert root_from_path(leaves[4], 3, 11, paths[3]) != root         # another leaf
    # the size shapes the right edge (a signed run root is signed with its size, so no path crosses sizes)
    assert root_from_path(leaves[10], 10, 12, paths[10]) != root
    assert root_from_path(leaves[3], 3, 11, paths[3][:-1]) is None     # a path too short
    assert root_from_path(leaves[3], 3, 11, [*paths[3], root]) is None  # a path too long
    assert root_from_path(leaves[3], 11, 11, paths[3]) is None          # a position past the end
    flipped = [bytes([paths[3][0][0] ^ 1]) + paths[3][0][1:], *paths[3][1:]]
    assert root_from_path(leaves[3], 3, 11, flipped) != root


def test_leaves_and_inner_nodes_never_collide() -> None:
    a, b = _leaves(2)
    root, _ = root_and_paths([a, b])
    # an inner node presented as a leaf hashes differently from the leaf of its bytes
    assert leaf_hash(a + b) != root
