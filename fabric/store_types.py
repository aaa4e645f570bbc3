"""The Store's value types: results, reports, errors, lifecycle states, a payload hashed once, and
the store's own counters (no I/O).

`StoreCounters` is what `Store.stats()` reports: plain integers counted where things happen (under
the store's lock), so stats never read numbers back out of Prometheus. It feeds the Prometheus
metrics at the same points, for export only; it is the one writer of both.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from fabric.index import BlockMeta
from fabric.keys import BlockAddress, BlockHash, StorageKey
from fabric.metrics import StoreMetrics
from fabric.provenance import Provenance
from fabric.tiers.base import Payload, Tier, as_bytes_view, digest_of


class PutResult(enum.Enum):
    """The outcome of a put; every value but OK is a rejection and is counted by reason."""

    OK = "ok"
    FULL = "full"                        # no room can be made on the SSD: the payload is larger than
    #                                      what it may hold, or every file there is being written
    PINNED = "pinned"                    # write-behind: RAM is full of payloads not yet on SSD and
    #                                      the flush cannot proceed (a failing disk or index)
    NO_SPACE = "no_space"                # the filesystem refused the write (ENOSPC / EDQUOT / EFBIG),
    #                                      or write-behind RAM is full of pinned payloads while the disk is full
    DIGEST_MISMATCH = "digest_mismatch"  # the caller's digest is not the payload's BLAKE3
    CONFLICT = "conflict"                # the address already holds other bytes: the first payload stands
    IO_ERROR = "io_error"                # any other file or index error

    @property
    def ok(self) -> bool:
        return self is PutResult.OK


class StoreClosedError(RuntimeError):
    """A call reached a store that is closing or closed (see `Store.close`)."""


class Lifecycle(enum.Enum):
    OPEN = "open"
    CLOSING = "closing"     # no new calls admitted; those in flight finish, then the flush
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class LookupResult:
    """Where each address is (None: not on this node) and how many leading ones are present."""

    num_leading: int
    tiers: tuple[Tier | None, ...]


@dataclass(frozen=True, slots=True)
class VerifyReport:
    num_checked: int
    corrupt: tuple[tuple[StorageKey, str], ...]


@dataclass(frozen=True, slots=True)
class CloseReport:
    """What `close()` could not do. `unflushed`: acknowledged write-behind blocks that never reached
    the SSD (full disk, failing disk or index) and are gone with this process; `errors`: the steps
    that failed (the index lock and the thread pools are released regardless)."""

    unflushed: tuple[BlockAddress, ...] = ()
    errors: tuple[str, ...] = ()
    num_calls_abandoned: int = 0    # calls still in flight when the close timeout ran out

    @property
    def clean(self) -> bool:
        return not self.unflushed and not self.errors and not self.num_calls_abandoned


@dataclass(frozen=True, slots=True)
class Pending:
    """A payload on its way to the SSD (write-behind: pinned in RAM until committed)."""

    block_hash: BlockHash
    layer: int
    model: str
    digest: bytes
    payload: memoryview
    created_unix: float
    provenance: Provenance | None = None

    @property
    def address(self) -> BlockAddress:
        return BlockAddress(self.block_hash, self.layer)

    def meta(self, last_seen_unix: float) -> BlockMeta:
        """The index row of this block once committed to the SSD."""
        return BlockMeta(self.model, self.layer, self.payload.nbytes, self.digest, self.created_unix,
                         last_seen_unix, Tier.SSD, self.block_hash, self.provenance)


@dataclass(frozen=True, slots=True)
class Hashed:
    """A payload the store may keep as is, with its BLAKE3 taken over these very bytes (`hash_payload`).

    A put of a `Hashed` payload does not hash it again, so a producer that needs the digest first
    (to sign it) hashes each payload once and hands the same digest to its signer and to the store.
    """

    payload: memoryview
    digest: bytes


def hash_payload(payload: Payload | Hashed) -> Hashed:
    """Own the bytes, then hash them, so what is hashed is what is stored. A view of a whole bytes
    object is kept as is; a slice is copied, or RAM would keep the (maybe far larger) object alive
    while counting only the slice, and its owner could change the bytes after the hash."""
    if isinstance(payload, Hashed):
        return payload
    view = as_bytes_view(payload)
    whole = isinstance(view.obj, bytes) and len(view.obj) == view.nbytes
    owned = view if whole else memoryview(bytes(view))
    return Hashed(owned, digest_of(owned))


class StoreCounters:
    """Monotonic counts since open, and their Prometheus twins; call under the store's lock."""

    def __init__(self, metrics: StoreMetrics) -> None:
        self._metrics = metrics
        self._put_rejected = {r.value: 0 for r in PutResult if not r.ok}
        self._evictions = {Tier.RAM.value: 0, Tier.SSD.value: 0}
        self._corrupt_blocks = {Tier.RAM.value: 0, Tier.SSD.value: 0}
        self._reconciled: dict[str, int] = {}
        self._flush_failures = 0

    def rejected(self, result: PutResult) -> PutResult:
        """Count a refused put; returns `result`."""
        self._put_rejected[result.value] += 1
        self._metrics.put_rejected.labels(result.value).inc()
        return result

    def evicted(self, tier: Tier, n: int) -> None:
        if n:
            self._evictions[tier.value] += n
            self._metrics.evictions.labels(tier.value).inc(n)

    def corrupt(self, tier: Tier) -> None:
        """A block that failed verification was removed (the exported counter is fed by the read's
        own observation, `StoreMetrics.observe_corrupt`, or by `verify`)."""
        self._corrupt_blocks[tier.value] += 1

    def reconciled(self, action: str, n: int = 1, *, export: bool = True) -> None:
        self._reconciled[action] = self._reconciled.get(action, 0) + n
        if export:
            self._metrics.reconciled.labels(action).inc(n)

    def reconciled_counts(self) -> dict[str, int]:
        return dict(self._reconciled)

    def flush_failed(self) -> None:
        self._flush_failures += 1

    def snapshot(self) -> dict[str, object]:
        return {"reconciled": dict(self._reconciled), "corrupt_blocks": dict(self._corrupt_blocks),
                "evictions": dict(self._evictions), "put_rejected": dict(self._put_rejected),
                "flush_failures": self._flush_failures}
