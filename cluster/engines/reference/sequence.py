"""One sequence as the engine's block manager sees it: its token ids (32-bit, in an array), its
block table and the prefix found cached, and the little-endian u32 bytes of its tokens that
`fabric.keys` hashes. The block allocator over it is `cluster.engines.reference.block_manager`.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable

from cluster.engines.reference.block_pool import RequestId
from fabric.keys import Namespace

__all__ = ["SeqState", "le_bytes"]

if array("I").itemsize != 4:  # pragma: no cover - every supported platform has a 32-bit C int
    raise ImportError("cluster.engines.reference.sequence needs array('I') to hold 32-bit token ids")
_LITTLE_ENDIAN = sys.byteorder == "little"


def le_bytes(tokens: array[int]) -> bytes:
    """Token ids as little-endian u32 bytes, the encoding fabric.keys hashes."""
    if _LITTLE_ENDIAN:
        return tokens.tobytes()
    swapped = array("I", tokens)  # pragma: no cover - big-endian hosts
    swapped.byteswap()  # pragma: no cover
    return swapped.tobytes()  # pragma: no cover


class SeqState:
    """One sequence as the block manager sees it.

    `token_ids` holds every token whose KV the sequence needs (prompt and generated so far);
    append the next token, then call `may_append`. `block_table[i]` is the device block of
    tokens [i*block_size, (i+1)*block_size). `num_cached_tokens` is the prefix `allocate`
    found cached: the engine can skip prefill for those (never the last token). `request_id` ties
    the sequence to a reservation; `namespace` overrides the manager's (e.g. another tenant salt,
    same KV shape).
    """

    __slots__ = ("block_table", "namespace", "num_cached_tokens", "request_id", "seq_id", "token_ids")

    def __init__(self, seq_id: int, token_ids: Iterable[int], *, request_id: RequestId | None = None,
                 namespace: Namespace | None = None) -> None:
        try:
            tokens = array("I", token_ids)
        except OverflowError:
            raise ValueError("token ids must lie in [0, 2**32)") from None
        self.seq_id = seq_id
        self.token_ids: array[int] = tokens
        self.block_table: list[int] = []
        self.num_cached_tokens = 0
        self.request_id = request_id
        self.namespace = namespace

    def __len__(self) -> int:
        return len(self.token_ids)

    def append_token(self, token_id: int) -> None:
        try:
            self.token_ids.append(token_id)
        except OverflowError:
            raise ValueError(f"token id {token_id} does not fit in a u32") from None
