"""Merkle trees over BLAKE3, pure: one root for a run of leaves, and for each leaf the path that proves
it belongs under that root.

The tree shape is RFC 9162's (Certificate Transparency): for n > 1 leaves the left subtree holds the
largest power of two below n, the right one the rest, so every size is a tree (no padding leaves)::

    leaf hash  = BLAKE3(0x00 ‖ leaf bytes)          inner node = BLAKE3(0x01 ‖ left ‖ right)

                      root                   n = 5: leaf 4's path is [root of 0..3];
                    /      \\                         leaf 1's path is [leaf 0, node(2, 3), leaf 4]
             node(0..3)     leaf 4
             /       \\
       node(0,1)   node(2,3)
       /    \\       /    \\
     leaf 0 leaf 1 leaf 2 leaf 3

The distinct prefixes keep a leaf from ever being read as an inner node. A path has at most
ceil(log2 n) hashes; `root_and_paths` builds the root and every path in O(n log n) hashes, and
`root_from_path` recomputes a root from one leaf in O(log n) (RFC 9162, 2.1.3.2).
"""

from __future__ import annotations

from collections.abc import Sequence

import blake3

HASH_SIZE = 32
MAX_DEPTH = 32          # a run of at most 2**32 leaves: more than any index a record can hold
_LEAF, _NODE = b"\x00", b"\x01"


def leaf_hash(data: bytes) -> bytes:
    return blake3.blake3(_LEAF + data).digest()


def _node(left: bytes, right: bytes) -> bytes:
    return blake3.blake3(_NODE + left + right).digest()


def root_and_paths(leaves: Sequence[bytes]) -> tuple[bytes, list[list[bytes]]]:
    """The root over `leaves` (leaf hashes, in order) and each leaf's inclusion path, leaf side first."""
    if not leaves:
        raise ValueError("a Merkle tree needs at least one leaf")
    if len(leaves) == 1:
        return leaves[0], [[]]
    split = 1 << ((len(leaves) - 1).bit_length() - 1)
    left, left_paths = root_and_paths(leaves[:split])
    right, right_paths = root_and_paths(leaves[split:])
    for path in left_paths:
        path.append(right)
    for path in right_paths:
        path.append(left)
    return _node(left, right), left_paths + right_paths


def root_from_path(leaf: bytes, index: int, size: int, path: Sequence[bytes]) -> bytes | None:
    """The root that `path` leads to from `leaf` at `index` of a tree of `size` leaves; None when the
    path cannot belong to that position (too short, too long, or the index is out of range)."""
    if not 0 <= index < size:
        return None
    fn, sn, root = index, size - 1, leaf
    for sibling in path:
        if sn == 0:
            return None
        if fn & 1 or fn == sn:
            root = _node(sibling, root)
            # a right edge of an unbalanced tree: climb past the levels where this node has no sibling
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            root = _node(root, sibling)
        fn >>= 1
        sn >>= 1
    return root if sn == 0 else None
