"""Persistent block index: RocksDB (rocksdict), column family `kv`, storage key -> msgpack meta.

    key   : the 32-byte storage key of a (block, layer)
    value : msgpack map {model, layer, bytes, digest, created_unix, last_seen_unix, tier, hash[, prov, cert]}

`hash` is the block hash of the (block, layer) (what the cluster directory is keyed by); a row
written before it existed decodes with `block_hash == b""` and is kept, but not advertised.
`prov` / `cert` are the block's provenance record and its producer's certificate
(fabric/provenance.py), the same in every layer's row; a row without them is an unsigned block,
never vouched for to peers. The SSD file header does not repeat them: the record covers all of a
block's layers, and the row is what makes a file count at all.

A row exists only for a block whose SSD file was committed first (see fabric/store.py for the
write order and the crash argument), so the files are what is stored and the rows say what is
acknowledged. `reconcile()` runs at open, with the database locked by this process, and makes the
two agree again after any crash:

    file without a row      the put did not finish        -> file removed   (file_without_row)
    row without a file      the file was removed/lost     -> row removed    (row_without_file)
    file of the wrong size  torn or truncated             -> both removed   (size_mismatch)
    row that does not parse                               -> row removed    (bad_row)
    temp file               a write cut short             -> file removed   (temp_file)

Costs: get / put / delete O(log n) in RocksDB (a few microseconds); reconcile O(rows + files),
one folder listing of the SSD tier and one pass over the rows, no file reads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
from rocksdict import AccessType, Options, Rdict, WriteBatch, WriteOptions

from fabric.errors import FabricError
from fabric.keys import HASH_SIZE, StorageKey
from fabric.provenance import Provenance
from fabric.tiers.base import DIGEST_SIZE, Tier
from fabric.tiers.ssd import SsdTier
from fabric.tiers.ssd_format import HEADER_SIZE, SsdScan

logger = logging.getLogger(__name__)

COLUMN_FAMILY = "kv"
RESERVE_FILE = "kvfabric.reserve"
RESERVE_BYTES = 1 << 20
RECONCILE_ACTIONS = ("file_without_row", "row_without_file", "size_mismatch", "bad_row", "temp_file")


class IndexUnavailableError(FabricError):
    """The index database could not be opened or written (locked, missing, I/O error)."""


class BadRowError(FabricError, ValueError):
    """A row whose value is not a valid meta record."""


@dataclass(frozen=True, slots=True)
class BlockMeta:
    model: str
    layer: int
    num_bytes: int
    digest: bytes
    created_unix: float
    last_seen_unix: float
    tier: Tier
    block_hash: bytes = b""     # b"" only in rows written before the hash was persisted
    provenance: Provenance | None = None

    def encode(self) -> bytes:
        row: dict[str, Any] = {"model": self.model, "layer": self.layer, "bytes": self.num_bytes,
                               "digest": self.digest, "created_unix": self.created_unix,
                               "last_seen_unix": self.last_seen_unix, "tier": self.tier.value,
                               "hash": self.block_hash}
        if self.provenance is not None:
            row |= {"prov": self.provenance.encode(), "cert": self.provenance.cert_der}
        return msgpack.packb(row, use_bin_type=True)

    @classmethod
    def decode(cls, raw: bytes) -> BlockMeta:
        try:
            d: Any = msgpack.unpackb(raw, raw=False)
            meta = cls(model=str(d["model"]), layer=int(d["layer"]), num_bytes=int(d["bytes"]),
                       digest=bytes(d["digest"]), created_unix=float(d["created_unix"]),
                       last_seen_unix=float(d["last_seen_unix"]), tier=Tier(d["tier"]),
                       block_hash=bytes(d.get("hash", b"")),
                       provenance=Provenance.decode(d["prov"], d.get("cert", b"")) if "prov" in d else None)
        except (ValueError, KeyError, TypeError, msgpack.UnpackException) as e:
            raise BadRowError(f"undecodable index row: {e}") from None
        if len(meta.digest) != DIGEST_SIZE or meta.num_bytes < 0 or meta.layer < 0:
            raise BadRowError("index row with a bad digest length, size or layer")
        if len(meta.block_hash) not in (0, HASH_SIZE):
            raise BadRowError(f"index row with a {len(meta.block_hash)}-byte block hash")
        return meta


@dataclass(slots=True)
class ReconcileReport:
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RECONCILE_ACTIONS, 0))
    kept: list[tuple[StorageKey, BlockMeta]] = field(default_factory=list)

    @property
    def num_repaired(self) -> int:
        return sum(self.counts.values())


class Index:
    """The RocksDB index of one store. Thread-safe (RocksDB is); `close()` releases the lock.

    Full disk. RocksDB refuses every write after an I/O error (its "background error") until the
    database is reopened, and it needs a little room to open at all (a new MANIFEST). So the index
    keeps a small reserve file beside it (RESERVE_FILE, RESERVE_BYTES): a failed write reopens the
    database once, giving the reserve back to the filesystem first, and retries; opening does the
    same. The reserve is re-created at the next open that has room. A reopen waits for the calls in
    flight (a condition-guarded count), so no thread ever uses a closed handle.
    """

    def __init__(self, path: str | os.PathLike[str], *, read_only: bool = False, sync: bool = True) -> None:
        self.path = Path(path)
        self.read_only = read_only
        if read_only and not (self.path / "CURRENT").exists():
            raise IndexUnavailableError(f"no index at {self.path}")
        if not read_only:
            self.path.mkdir(parents=True, exist_ok=True)
        self._sync = WriteOptions()
        self._sync.sync = sync
        self._nosync = WriteOptions()
        self._nosync.sync = False
        self._gate = threading.Condition()
        self._num_users = 0
        self._reopening = False
        self._closed = False
        self._generation = 0     # bumped by every reopen
        self._db: Rdict | None = None
        try:
            self._open()
        except IndexUnavailableError:
            if read_only or not self._release_reserve():
                raise
            self._open()
        if not read_only:
            self._make_reserve()

    def get(self, key: StorageKey) -> BlockMeta | None:
        """The meta of `key`, None if absent. Raises BadRowError for an undecodable row."""
        with self._use():
            raw = self._cf.get(key)
        return None if raw is None else BlockMeta.decode(raw)

    def put(self, key: StorageKey, meta: BlockMeta, *, sync: bool = True) -> None:
        self.put_many([(key, meta)], sync=sync)

    def put_many(self, rows: Iterable[tuple[StorageKey, BlockMeta]], *, sync: bool = True) -> None:
        """Write rows atomically (one WriteBatch); `sync` waits for the WAL to reach the disk."""
        self._write([(key, meta.encode()) for key, meta in rows], sync)

    def delete_many(self, keys: Iterable[StorageKey], *, sync: bool = False) -> None:
        self._write([(key, None) for key in keys], sync)

    def rows(self) -> Iterator[tuple[StorageKey, BlockMeta | None]]:
        """Every row in key order; meta is None for a row that does not decode."""
        with self._use():
            for raw_key, raw in self._cf.items():
                if not isinstance(raw_key, bytes) or not isinstance(raw, bytes):
                    raise RuntimeError("index column family opened outside raw mode")
                key = StorageKey(raw_key)
                try:
                    yield key, BlockMeta.decode(raw) if len(key) == HASH_SIZE else None
                except BadRowError:
                    yield key, None

    def close(self) -> None:
        """Release the database and its lock (always); raises IndexUnavailableError afterwards if
        RocksDB reported an error while closing (e.g. a WAL it could not write on a full disk)."""
        with self._gate:
            if self._closed:
                return
            self._closed = True
            while self._num_users:
                self._gate.wait()
            error = self._drop_handles()
        if error:
            raise IndexUnavailableError(f"index {self.path} closed with an error: {error}")

    def __enter__(self) -> Index:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals -------------------------------------------------------------------------------

    def _open(self) -> None:
        opts = Options(raw_mode=True)
        opts.create_if_missing(not self.read_only)
        opts.create_missing_column_families(not self.read_only)
        access = AccessType.read_only() if self.read_only else AccessType.read_write()
        try:
            self._db = Rdict(str(self.path), options=opts,
                             column_families={COLUMN_FAMILY: Options(raw_mode=True)}, access_type=access)
        except Exception as e:  # rocksdict raises a bare Exception for every RocksDB status
            raise IndexUnavailableError(f"cannot open index {self.path}: {e}") from None
        self._cf = self._db.get_column_family(COLUMN_FAMILY)
        self._handle = self._db.get_column_family_handle(COLUMN_FAMILY)

    def _drop_handles(self) -> str | None:
        """Close the database (caller holds the gate with no users); None or RocksDB's complaint."""
        if self._db is None:
            return None
        error = None
        try:
            self._cf.close()
            self._db.close()
        except Exception as e:  # RocksDB status; the handles are dropped below either way
            error = str(e)
        # RocksDB keeps its LOCK while any column-family object is alive: drop ours now.
        del self._cf, self._handle
        self._db = None
        return error

    @contextlib.contextmanager
    def _use(self) -> Iterator[Rdict]:
        with self._gate:
            while self._reopening:
                self._gate.wait()
            if self._closed:
                raise IndexUnavailableError(f"index {self.path} is closed")
            if self._db is None:
                raise IndexUnavailableError(f"index {self.path} could not be reopened after a write error")
            self._num_users += 1
            db = self._db
        try:
            yield db
        finally:
            with self._gate:
                self._num_users -= 1
                if not self._num_users:
                    self._gate.notify_all()

    def _write(self, ops: list[tuple[StorageKey, bytes | None]], sync: bool) -> None:
        if not ops:
            return
        if self.read_only:
            raise IndexUnavailableError(f"index {self.path} is open read-only")
        for attempt in (0, 1):
            with self._use() as db:
                generation = self._generation
                batch = WriteBatch(raw_mode=True)
                batch.set_default_column_family(self._handle)
                for key, value in ops:
                    if value is None:
                        batch.delete(key)
                    else:
                        batch.put(key, value)
                try:
                    db.write(batch, self._sync if sync else self._nosync)
                    return
                except Exception as e:  # a bare Exception from rocksdict: disk full, I/O error
                    error = str(e)
            del db   # our reference would keep RocksDB's LOCK through the reopen
            if attempt == 0:
                self._reopen(generation)
        raise IndexUnavailableError(f"index write failed: {error}")

    def _reopen(self, generation: int) -> None:
        """Reopen after a write error (RocksDB refuses writes until then), unless another thread did."""
        with self._gate:
            if self._generation != generation or self._closed:
                return
            self._generation += 1
            self._reopening = True
            try:
                while self._num_users:
                    self._gate.wait()
                error = self._drop_handles()
                logger.warning("index %s: reopening after a write error (%s)", self.path, error)
                self._release_reserve()
                try:
                    self._open()
                except IndexUnavailableError as e:
                    logger.error("%s", e)
            finally:
                self._reopening = False
                self._gate.notify_all()

    def _release_reserve(self) -> bool:
        try:
            (self.path / RESERVE_FILE).unlink()
        except FileNotFoundError:
            return False
        return True

    def _make_reserve(self) -> None:
        path = self.path / RESERVE_FILE
        if path.exists():
            return
        try:
            with open(path, "wb") as f:
                f.write(bytes(RESERVE_BYTES))
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:   # no room now: the next open tries again
            logger.warning("index %s: no room for its %d-byte reserve (%s)", self.path, RESERVE_BYTES, e)
            path.unlink(missing_ok=True)


def reconcile(index: Index, ssd: SsdTier, scan: SsdScan | None = None) -> ReconcileReport:
    """Make rows and files agree (see the module docstring); returns counts and surviving rows."""
    scan = ssd.scan() if scan is None else scan
    report = ReconcileReport()
    doomed_rows: list[StorageKey] = []
    matched: set[tuple[str, int]] = set()
    mismatched: set[tuple[str, int]] = set()
    for key, meta in index.rows():
        if meta is None:
            doomed_rows.append(key)
            report.counts["bad_row"] += 1
            continue
        name = (key.hex()[:16], meta.layer)
        found = scan.files.get(name)
        if found is None:
            doomed_rows.append(key)
            report.counts["row_without_file"] += 1
        elif found.size != HEADER_SIZE + meta.num_bytes:
            doomed_rows.append(key)
            mismatched.add(name)
            report.counts["size_mismatch"] += 1
        else:
            matched.add(name)
            report.kept.append((key, meta))
    # Rows go first: a crash between the two steps leaves files without rows, removed next time.
    index.delete_many(doomed_rows, sync=True)
    for name, found in scan.files.items():
        if name in matched:
            continue
        found.path.unlink(missing_ok=True)
        if name not in mismatched:
            report.counts["file_without_row"] += 1
    for path in scan.temp_files:
        path.unlink(missing_ok=True)
        report.counts["temp_file"] += 1
    for path in scan.foreign_files:
        logger.warning("ignoring a file that is not a block under the SSD tier: %s", path)
    if report.num_repaired:
        logger.info("index reconciled with %s: %s", ssd.root,
                    ", ".join(f"{n} {a}" for a, n in report.counts.items() if n))
    return report
