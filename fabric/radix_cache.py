"""Radix tree from token prefixes to KV slot indices, one subtree per namespace (SGLang style).

For engines that manage KV per token: every cached token owns one slot of the engine's
`TokenToKVPool`; the tree remembers which slots hold the KV of which token prefix, so a new
request reuses the longest cached prefix and computes only the rest.

    roots[ns_a] ─┬─ [1 2 3] ─┬─ [4 5]        node = (key tokens, slots of the same length)
                 │           └─ [9]
                 └─ [7 7]
    roots[ns_b] ─── [1 2 3 4]               same tokens, other namespace: never shared

Invariants
  * Every non-root node has a non-empty key and `len(slots) == len(key)`; the children of a
    node start with distinct tokens (the child map is keyed by the first token).
  * Namespaces are separate subtrees; a lookup only walks the subtree of its own namespace.
  * `lock_ref(node) > 0` for every node on the path of a locked node; a node with
    `lock_ref > 0` is never evicted. `protected_size()` counts tokens of nodes with
    `lock_ref > 0`, `evictable_size()` the others, and their sum is every cached token.
  * Only leaves are evicted, least recently used first; evicting one may make its parent
    a leaf, which then competes in the same LRU order. A slot is returned by `evict` once.
  * A partial match inside a node splits it, so `MatchResult.last_node` ends exactly where
    the match ends and `lock(last_node)` protects exactly the matched tokens. The deeper
    part keeps its identity, so a node handed out earlier stays valid across splits.

Time is a logical clock, incremented on every `match_prefix` / `insert`, so LRU order is
deterministic under test and needs no wall clock.

Complexity (L = tokens in the query, d = depth of the path, k = nodes evicted, n = nodes)
  * `match_prefix` / `insert`: O(L + d) (token comparison is vectorised per node).
  * `lock` / `unlock`: O(d).
  * `evict`: O(k log n) amortised. Candidate leaves sit in a binary heap with lazy
    invalidation: an entry is pushed whenever a node may have become an unlocked leaf or
    its access time changed, and is checked when popped. The heap is rebuilt from the
    live leaves when stale entries outnumber nodes, which costs O(n) after at least n pushes.

Not thread-safe: the engine's scheduler owns one instance.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

_INDEX = np.int64
_EMPTY = np.zeros(0, dtype=_INDEX)


class RadixNode:
    """One edge of the tree: a run of tokens and their slots. Opaque to callers except for lock/unlock."""

    __slots__ = ("alive", "children", "key", "last_access", "lock_ref", "namespace", "parent", "slots")

    def __init__(self, key: np.ndarray, slots: np.ndarray, parent: RadixNode | None,
                 last_access: int, namespace: bytes = b"") -> None:
        self.namespace = namespace  # set on roots only
        self.key = key
        self.slots = slots
        self.parent = parent
        self.children: dict[int, RadixNode] = {}
        self.lock_ref = 0
        self.last_access = last_access
        self.alive = True

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def __repr__(self) -> str:
        return f"RadixNode(tokens={len(self.key)}, lock_ref={self.lock_ref}, alive={self.alive})"


@dataclass(frozen=True, slots=True)
class MatchResult:
    """Slots of the longest cached prefix (int64, one per token) and the node where it ends.

    `slots` is a fresh array the caller may keep; `torch.from_numpy(slots)` shares its memory.
    """

    slots: np.ndarray
    last_node: RadixNode

    @property
    def num_tokens(self) -> int:
        return len(self.slots)


def _as_index_array(values: Sequence[int] | np.ndarray, what: str) -> np.ndarray:
    """A fresh 1-D int64 copy; accepts lists, numpy arrays and CPU torch tensors."""
    arr = np.array(values, dtype=_INDEX, copy=True)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be one-dimensional, got shape {arr.shape}")
    return arr


def _common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    mismatch = np.flatnonzero(a[:n] != b[:n])
    return int(mismatch[0]) if mismatch.size else n


class RadixCache:
    """Token prefix → KV slots, with lock refs and LRU leaf eviction. See the module docstring."""

    def __init__(self) -> None:
        self._roots: dict[bytes, RadixNode] = {}
        # Handed out when a namespace has no tree yet; lock/unlock on a root is a no-op.
        self._null_root = RadixNode(_EMPTY, _EMPTY, None, 0)
        self._clock = 0
        self._heap: list[tuple[int, int, RadixNode]] = []
        self._heap_seq = 0
        self._num_nodes = 0
        self._evictable = 0
        self._protected = 0

    # ---------------------------------------------------------------- queries
    def match_prefix(self, namespace_key: bytes, tokens: Sequence[int] | np.ndarray) -> MatchResult:
        """Longest cached prefix of `tokens` in this namespace; marks its path as recently used."""
        key = _as_index_array(tokens, "tokens")
        root = self._roots.get(bytes(namespace_key))
        if root is None or len(key) == 0:
            return MatchResult(_EMPTY.copy(), root if root is not None else self._null_root)
        now = self._tick()
        node, _, pieces = self._walk(root, key, now)
        return MatchResult(np.concatenate(pieces) if pieces else _EMPTY.copy(), node)

    def evictable_size(self) -> int:
        """Cached tokens that `evict` may free (on no locked path)."""
        return self._evictable

    def protected_size(self) -> int:
        """Cached tokens on a locked path."""
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def num_namespaces(self) -> int:
        return len(self._roots)

    # ---------------------------------------------------------------- updates
    def insert(self, namespace_key: bytes, tokens: Sequence[int] | np.ndarray,
               slots: Sequence[int] | np.ndarray) -> int:
        """Cache `slots[i]` as the KV of `tokens[:i + 1]`; returns how many leading tokens were there before.

        The cache keeps its own slots for that already-cached prefix: the caller's
        `slots[:returned]` are not referenced by the tree and are the caller's to free.
        """
        key = _as_index_array(tokens, "tokens")
        values = _as_index_array(slots, "slots")
        if len(key) != len(values):
            raise ValueError(f"insert needs one slot per token: {len(key)} tokens, {len(values)} slots")
        if len(key) == 0:
            return 0
        ns = bytes(namespace_key)
        root = self._roots.get(ns)
        if root is None:
            root = self._roots[ns] = RadixNode(_EMPTY, _EMPTY, None, 0, ns)
        now = self._tick()
        node, pos, _ = self._walk(root, key, now)
        if pos < len(key):
            leaf = RadixNode(key[pos:], values[pos:], node, now)
            node.children[int(key[pos])] = leaf
            self._num_nodes += 1
            self._evictable += len(leaf.key)
            self._push(leaf)
        return pos

    def lock(self, node: RadixNode) -> None:
        """Protect `node` and every node above it from eviction (nestable)."""
        self._check_alive(node, "lock")
        current: RadixNode | None = node
        while current is not None and not current.is_root:
            if current.lock_ref == 0:
                self._evictable -= len(current.key)
                self._protected += len(current.key)
            current.lock_ref += 1
            current = current.parent

    def unlock(self, node: RadixNode) -> None:
        """Undo one `lock(node)`; raises RuntimeError if the path is not locked."""
        self._check_alive(node, "unlock")
        if not node.is_root and node.lock_ref <= 0:
            raise RuntimeError("unlock without a matching lock: the node's lock_ref is already 0")
        current: RadixNode | None = node
        while current is not None and not current.is_root:
            if current.lock_ref <= 0:
                raise RuntimeError("lock_ref invariant broken: an ancestor of a locked node is unlocked")
            current.lock_ref -= 1
            if current.lock_ref == 0:
                self._protected -= len(current.key)
                self._evictable += len(current.key)
                if not current.children:
                    self._push(current)
            current = current.parent

    def evict(self, num_tokens: int) -> list[int]:
        """Free least recently used unlocked leaves until `num_tokens` slots are freed or none is left.

        Whole leaves are freed, so the result may exceed `num_tokens`. Returns the freed slots
        (the caller returns them to its pool).
        """
        freed: list[np.ndarray] = []
        num_freed = 0
        while num_freed < num_tokens and self._heap:
            access, _, node = heapq.heappop(self._heap)
            if not self._is_candidate(node) or node.last_access != access:
                continue
            freed.append(node.slots)
            num_freed += len(node.slots)
            parent = self._remove_leaf(node)
            if not parent.is_root and not parent.children and parent.lock_ref == 0:
                self._push(parent)
        return np.concatenate(freed).tolist() if freed else []

    def clear(self) -> list[int]:
        """Drop every unlocked entry: shorthand for evicting everything evictable."""
        return self.evict(self._evictable)

    # ---------------------------------------------------------------- internals
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _walk(self, root: RadixNode, key: np.ndarray, now: int) -> tuple[RadixNode, int, list[np.ndarray]]:
        """Follow `key` from `root`, splitting the last node on a partial match.

        Returns the deepest node whose path is a prefix of `key`, how many tokens it covers,
        and the slot runs along the way.
        """
        node, pos = root, 0
        pieces: list[np.ndarray] = []
        while pos < len(key):
            child = node.children.get(int(key[pos]))
            if child is None:
                break
            n = _common_prefix_len(child.key, key[pos:])
            if n < len(child.key):
                child = self._split(child, n)
            self._touch(child, now)
            pieces.append(child.slots)
            node, pos = child, pos + n
        return node, pos, pieces

    def _split(self, child: RadixNode, n: int) -> RadixNode:
        """Cut `child` after `n` tokens; the new upper node takes the prefix, `child` keeps the rest."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key), "split must fall inside a non-root node"
        upper = RadixNode(child.key[:n], child.slots[:n], parent, child.last_access)
        upper.lock_ref = child.lock_ref  # same path, same locks
        upper.children[int(child.key[n])] = child
        parent.children[int(child.key[0])] = upper
        child.key = child.key[n:]
        child.slots = child.slots[n:]
        child.parent = upper
        self._num_nodes += 1
        return upper

    def _touch(self, node: RadixNode, now: int) -> None:
        node.last_access = now
        if not node.children and node.lock_ref == 0:
            self._push(node)

    def _push(self, node: RadixNode) -> None:
        self._heap_seq += 1
        heapq.heappush(self._heap, (node.last_access, self._heap_seq, node))
        if len(self._heap) > 2 * self._num_nodes + 64:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        self._heap = []
        for node in self._iter_nodes():
            if self._is_candidate(node):
                self._heap_seq += 1
                self._heap.append((node.last_access, self._heap_seq, node))
        heapq.heapify(self._heap)

    def _iter_nodes(self) -> Iterator[RadixNode]:
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    @staticmethod
    def _is_candidate(node: RadixNode) -> bool:
        return node.alive and not node.is_root and not node.children and node.lock_ref == 0

    def _remove_leaf(self, node: RadixNode) -> RadixNode:
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0, "only unlocked leaves go"
        del parent.children[int(node.key[0])]
        node.alive = False
        self._num_nodes -= 1
        self._evictable -= len(node.key)
        if parent.is_root and not parent.children:
            # An empty namespace keeps no root; a later insert makes a fresh one.
            del self._roots[parent.namespace]
        return parent

    @staticmethod
    def _check_alive(node: RadixNode, action: str) -> None:
        if not node.alive:
            raise RuntimeError(f"cannot {action} an evicted node: match the prefix again first")
