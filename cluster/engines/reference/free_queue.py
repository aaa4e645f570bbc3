"""Intrusive LRU queue of free block ids: O(1) push, pop and removal from the middle.

A block manager keeps its free blocks in least-recently-freed order: the head is reused first,
a freed block goes to the tail, and a free block that still holds a cached hash can be taken
back out of the middle when a request hits it. A `deque` makes that last step O(n) (it scans);
here the links live in two preallocated int lists indexed by block id, so every operation is a
handful of list stores and no Python object is created per operation.

    index:    0    1    2   ...  n-1 |  n (sentinel)
    _next:  [ .. , .. , .. , ..., .. | head ]      _next[sentinel] = head, _next[tail] = sentinel
    _prev:  [ .. , .. , .. , ..., .. | tail ]      _prev[sentinel] = tail, _prev[head] = sentinel

The list is circular through the sentinel slot `n`, so neither end needs a special case.

Invariants
    - a block id is in the queue  <=>  _next[id] != DETACHED (and then _prev[id] != DETACHED);
    - following _next from the sentinel visits exactly `len(self)` ids and returns to it;
    - _prev[_next[i]] == i for every linked i (sentinel included).

Complexity: append, appendleft, popleft, remove, __contains__, __len__ are O(1);
iteration is O(len). Memory: two lists of num_blocks + 1 ints, allocated once.
"""

from __future__ import annotations

from collections.abc import Iterator

DETACHED = -1
EMPTY = -1  # popleft() on an empty queue


class FreeBlockQueue:
    """Doubly linked queue over block ids 0..num_blocks-1; starts holding all of them in id order."""

    __slots__ = ("_len", "_next", "_num_blocks", "_prev", "_sentinel")

    def __init__(self, num_blocks: int, *, full: bool = True) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        s = num_blocks
        self._num_blocks = num_blocks
        self._sentinel = s
        if full:
            # 0 -> 1 -> ... -> n-1 -> sentinel -> 0
            self._next: list[int] = list(range(1, num_blocks + 1))
            self._next.append(0 if num_blocks else s)
            self._prev: list[int] = list(range(-1, num_blocks))
            self._prev[0] = s
            self._prev[s] = num_blocks - 1 if num_blocks else s
            self._len = num_blocks
        else:
            self._next = [DETACHED] * num_blocks + [s]
            self._prev = [DETACHED] * num_blocks + [s]
            self._len = 0

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block_id: int) -> bool:
        return 0 <= block_id < self._num_blocks and self._next[block_id] != DETACHED

    def __iter__(self) -> Iterator[int]:
        """Ids from head (reused next) to tail (freed last)."""
        nxt = self._next
        s = self._sentinel
        i = nxt[s]
        while i != s:
            yield i
            i = nxt[i]

    def peek(self) -> int:
        """The head id (the next popleft) or EMPTY."""
        head = self._next[self._sentinel]
        return EMPTY if head == self._sentinel else head

    def popleft(self) -> int:
        """Detach and return the head (least recently freed) id, or EMPTY when the queue is empty."""
        nxt = self._next
        s = self._sentinel
        head = nxt[s]
        if head == s:
            return EMPTY
        after = nxt[head]
        nxt[s] = after
        self._prev[after] = s
        nxt[head] = DETACHED
        self._prev[head] = DETACHED
        self._len -= 1
        return head

    def append(self, block_id: int) -> None:
        """Link a detached id at the tail (it will be reused last)."""
        nxt = self._next
        if nxt[block_id] != DETACHED or block_id == self._sentinel:
            raise RuntimeError(f"block {block_id} is already in the free queue")
        prev = self._prev
        s = self._sentinel
        tail = prev[s]
        nxt[tail] = block_id
        prev[block_id] = tail
        nxt[block_id] = s
        prev[s] = block_id
        self._len += 1

    def appendleft(self, block_id: int) -> None:
        """Link a detached id at the head (it will be reused first)."""
        nxt = self._next
        if nxt[block_id] != DETACHED or block_id == self._sentinel:
            raise RuntimeError(f"block {block_id} is already in the free queue")
        prev = self._prev
        s = self._sentinel
        head = nxt[s]
        prev[head] = block_id
        nxt[block_id] = head
        prev[block_id] = s
        nxt[s] = block_id
        self._len += 1

    def remove(self, block_id: int) -> None:
        """Unlink `block_id` from wherever it is in the queue."""
        nxt = self._next
        after = nxt[block_id]
        if after == DETACHED or block_id == self._sentinel:
            raise RuntimeError(f"block {block_id} is not in the free queue")
        prev = self._prev
        before = prev[block_id]
        nxt[before] = after
        prev[after] = before
        nxt[block_id] = DETACHED
        prev[block_id] = DETACHED
        self._len -= 1

    def check(self) -> None:
        """Walk the whole list and raise RuntimeError if an invariant is broken (O(n); for tests)."""
        nxt, prev, s = self._next, self._prev, self._sentinel
        seen = 0
        i = s
        while True:
            j = nxt[i]
            if j == DETACHED or prev[j] != i:
                raise RuntimeError(f"free queue link broken between {i} and {j}")
            if j == s:
                break
            seen += 1
            if seen > self._num_blocks:
                raise RuntimeError("free queue has a cycle that skips the sentinel")
            i = j
        if seen != self._len:
            raise RuntimeError(f"free queue holds {seen} ids but its length says {self._len}")
        linked = sum(1 for k in range(self._num_blocks) if nxt[k] != DETACHED)
        if linked != seen:
            raise RuntimeError(f"{linked} ids are marked linked but {seen} are reachable")
