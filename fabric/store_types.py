"""The Store's value types: results, reports, errors, lifecycle states and its own counters (no I/O).

`StoreCounters` is what `Store.stats()` reports: plain integers the store increments where things
happen (under its lock), so stats never read numbers back out of Prometheus. The Prometheus
metrics are fed at the same points, for export only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from fabric.errors import FabricError
from fabric.index import BlockMeta
from fabric.keys import BlockAddress, BlockHash, StorageKey
from fabric.provenance import Provenance
from fabric.tiers.base import Tier


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


class StoreClosedError(FabricError, RuntimeError):
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


@dataclass(slots=True)
class StoreCounters:
    """Monotonic counts since open (the store increments them under its lock)."""

    put_rejected: dict[str, int] = field(default_factory=lambda: {r.value: 0 for r in PutResult if not r.ok})
    evictions: dict[str, int] = field(default_factory=lambda: {Tier.RAM.value: 0, Tier.SSD.value: 0})
    corrupt_blocks: dict[str, int] = field(default_factory=lambda: {Tier.RAM.value: 0, Tier.SSD.value: 0})
    reconciled: dict[str, int] = field(default_factory=dict)
    flush_failures: int = 0
