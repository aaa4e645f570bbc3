"""Reply arrays that outlive one load, so that the next load does not pay for fresh pages.

A long prompt's load fills a large array. A fresh `np.empty` of that size is a new mapping whose
pages the kernel zeroes as they are first written: perf on the pulling node shows that page clearing
as a clear share of its CPU per pull (docs/benchmarks.md), work a load only needs once.
The pool keeps arrays up to `max_bytes` in all and hands one out again only when
nothing else references it: the reply that carried it has been copied into Ray's object store and
dropped, a mirror that copies from it has finished. An array still referenced anywhere is never
handed out twice; when none is free, a new one is made (and kept if the pool has room).
"""

from __future__ import annotations

import sys

import numpy as np

# References to a free pooled array while `_free` looks at it: the pool's list and getrefcount's
# own argument. Anything else (a reply view, a mirror's slice, a pending serialization) adds one.
_FREE_REFS = 2


class ReplyBuffers:
    """Not thread-safe: used from the NodeActor's event loop only."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._arrays: list[np.ndarray] = []
        self.num_reused = 0
        self.num_made = 0

    @property
    def pooled_bytes(self) -> int:
        return sum(a.nbytes for a in self._arrays)

    def take(self, shape: tuple[int, ...]) -> np.ndarray:
        """An uninitialised uint8 array of `shape`, reusing a pooled one that nobody references."""
        nbytes = int(np.prod(shape, dtype=np.int64))
        fits = [i for i in self._free() if self._arrays[i].nbytes >= nbytes]
        if fits:
            self.num_reused += 1
            best = min(fits, key=lambda i: self._arrays[i].nbytes)
            return self._arrays[best][:nbytes].reshape(shape)
        self.num_made += 1
        made = np.empty(nbytes, dtype=np.uint8)
        self._keep(made)
        return made.reshape(shape)

    def _keep(self, made: np.ndarray) -> None:
        if made.nbytes > self.max_bytes:
            return
        while self.pooled_bytes + made.nbytes > self.max_bytes:
            free = self._free()
            if not free:
                return   # every pooled array is in use: this one is not kept
            del self._arrays[min(free, key=lambda i: self._arrays[i].nbytes)]
        self._arrays.append(made)

    def _free(self) -> list[int]:
        """Indices of the pooled arrays nothing but the pool references."""
        return [i for i in range(len(self._arrays)) if sys.getrefcount(self._arrays[i]) <= _FREE_REFS]
