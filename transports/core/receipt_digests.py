"""BLAKE3 of a payload's parts, taken while the payload is still arriving: `ReceiptDigests`.

A puller must hash every payload it receives against the digest its frame announces. Hashing
once the last byte is in puts that hash after the transfer, on the latency of every get; hashed
as they land, the bytes are hashed while the sender is still encrypting the rest, and only the
last step is left when the frame completes:

    payload buffer:  [ hashed ........ | landed, not yet hashed | not yet received ]
                                       ^ hashed_to              ^ filled

The decoder calls `advance(view, filled)` whenever more of the payload has landed. Bytes are
hashed in steps of at least HASH_STEP (small steps would cost a call each and lose BLAKE3's
SIMD lanes) and at each part's end. Each byte is hashed exactly once, and only after it landed:
the digest of a part is of the bytes the receiver holds, whatever the peer sent later. The
digests are this side's own, never read from the peer; `digests()` returns them concatenated,
DIGEST_SIZE bytes per part, once every byte has been advanced over.
"""

from __future__ import annotations

from itertools import accumulate

import blake3

__all__ = ["HASH_STEP", "ReceiptDigests"]

HASH_STEP = 64 * 1024   # landed bytes hashed at a time, at least (except at a part's end)


class ReceiptDigests:
    """The digests of the parts (`sizes`, in order, back to back) of one payload being received."""

    __slots__ = ("_digests", "_end", "_ends", "_hasher", "_part", "hashed_to")

    def __init__(self, sizes: tuple[int, ...] | list[int]) -> None:
        self._ends = list(accumulate(sizes))
        self._part = 0
        self._end = self._ends[0] if self._ends else -1   # where the part being hashed ends (-1: none left)
        self._hasher = blake3.blake3()
        self._digests = bytearray()
        self.hashed_to = 0

    def advance(self, view: memoryview, filled: int) -> None:
        """The payload (`view`, all of it) now holds its bytes up to `filled`: hash what is due."""
        at = self.hashed_to
        if filled < self._end:   # inside the part being hashed: a step, if one is due
            if filled - at >= HASH_STEP:
                self._hasher.update(view[at:filled])
                self.hashed_to = filled
            return
        ends, part = self._ends, self._part
        while part < len(ends):
            end = ends[part]
            stop = end if end <= filled else filled
            if stop < end and stop - at < HASH_STEP:
                break
            if stop > at:
                self._hasher.update(view[at:stop])
                at = stop
            if stop < end:
                break
            self._digests += self._hasher.digest()
            self._hasher = blake3.blake3()
            part += 1
        self._part, self.hashed_to = part, at
        self._end = ends[part] if part < len(ends) else -1

    def digests(self) -> bytes:
        """Every part's digest, concatenated; b"" unless every byte has been advanced over."""
        return bytes(self._digests) if self._part == len(self._ends) else b""
