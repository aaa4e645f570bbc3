"""The Store's value types and its lifecycle (no I/O): put results, lookups, verify reports, a
payload on its way to the SSD, a payload hashed once; and OPEN -> CLOSING -> CLOSED:

    OPEN      every call is admitted; those that outlive the lock (file reads, puts, flushes,
              maintenance) count as in flight until they leave
    CLOSING   no call is admitted (StoreClosedError); `close()` waits up to its timeout for those
              in flight, then flushes and releases
    CLOSED    the CloseReport is kept: a second `close()` answers it, a concurrent one waits for it

`CallGate` is the one writer of the state, the count in flight and the report, under the store's
lock (shared, so a call is admitted and its state found in one critical section).
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

from fabric.errors import FabricError
from fabric.index import BlockMeta
from fabric.keys import BlockAddress, BlockHash, StorageKey
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


class StoreClosedError(FabricError, RuntimeError):
    """A call reached a store that is closing or closed (see `Store.close`)."""


class Lifecycle(enum.Enum):
    OPEN = "open"
    CLOSING = "closing"     # no new calls admitted; those in flight finish, then the flush
    CLOSED = "closed"


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


class CallGate:
    """Admission of a store's calls and the close handshake (module docstring)."""

    def __init__(self, lock: threading.Lock, name: str) -> None:
        self._lock = lock
        self._name = name
        self._state = Lifecycle.OPEN
        self._num_inflight = 0
        self._idle = threading.Condition(lock)
        self._report: CloseReport | None = None

    @property
    def state(self) -> Lifecycle:
        return self._state

    def check_open_locked(self) -> None:
        if self._state is not Lifecycle.OPEN:
            raise StoreClosedError(f"store over {self._name} is {self._state.value}")

    def admit_locked(self) -> None:
        """Admit a call that will outlive the lock (raises StoreClosedError unless OPEN); `leave` ends it."""
        self.check_open_locked()
        self._num_inflight += 1

    def enter(self) -> None:
        with self._lock:
            self.admit_locked()

    def leave(self) -> None:
        with self._lock:
            self._num_inflight -= 1
            if not self._num_inflight:
                self._idle.notify_all()

    def begin_close(self, timeout_s: float) -> CloseReport | int:
        """The report of a close already begun (waiting for it to end); else CLOSING from now on,
        and how many calls were still in flight after `timeout_s`."""
        with self._lock:
            if self._state is not Lifecycle.OPEN:
                self._idle.wait_for(lambda: self._state is Lifecycle.CLOSED)
                assert self._report is not None, "a CLOSED store keeps its close report"
                return self._report
            self._state = Lifecycle.CLOSING
            self._idle.wait_for(lambda: not self._num_inflight, timeout_s)
            return self._num_inflight

    def finish_close(self, report: CloseReport) -> None:
        with self._lock:
            self._report = report
            self._state = Lifecycle.CLOSED
            self._idle.notify_all()
