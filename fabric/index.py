"""Persistent block index: RocksDB (rocksdict), column family `kv`, storage key -> msgpack meta.

    key   : the 32-byte storage key of a (block, layer)
    value : msgpack map {model, layer, bytes, digest, created_unix, last_seen_unix, tier, hash}

`hash` is the block hash of the (block, layer) (what the cluster directory is keyed by); a row
written before it existed decodes with `block_hash == b""` and is kept, but not advertised.

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

import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
from rocksdict import AccessType, Options, Rdict, WriteBatch, WriteOptions

from fabric.keys import HASH_SIZE, StorageKey
from fabric.tiers.base import DIGEST_SIZE, Tier
from fabric.tiers.ssd import HEADER_SIZE, SsdScan, SsdTier

logger = logging.getLogger(__name__)

COLUMN_FAMILY = "kv"
RECONCILE_ACTIONS = ("file_without_row", "row_without_file", "size_mismatch", "bad_row", "temp_file")


class IndexUnavailableError(Exception):
    """The index database could not be opened or written (locked, missing, I/O error)."""


class BadRowError(ValueError):
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

    def encode(self) -> bytes:
        return msgpack.packb({"model": self.model, "layer": self.layer, "bytes": self.num_bytes,
                              "digest": self.digest, "created_unix": self.created_unix,
                              "last_seen_unix": self.last_seen_unix, "tier": self.tier.value,
                              "hash": self.block_hash}, use_bin_type=True)

    @classmethod
    def decode(cls, raw: bytes) -> BlockMeta:
        try:
            d: Any = msgpack.unpackb(raw, raw=False)
            meta = cls(model=str(d["model"]), layer=int(d["layer"]), num_bytes=int(d["bytes"]),
                       digest=bytes(d["digest"]), created_unix=float(d["created_unix"]),
                       last_seen_unix=float(d["last_seen_unix"]), tier=Tier(d["tier"]),
                       block_hash=bytes(d.get("hash", b"")))
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
    """The RocksDB index of one store. Thread-safe (RocksDB is); `close()` releases the lock."""

    def __init__(self, path: str | os.PathLike[str], *, read_only: bool = False, sync: bool = True) -> None:
        self.path = Path(path)
        self.read_only = read_only
        if read_only and not (self.path / "CURRENT").exists():
            raise IndexUnavailableError(f"no index at {self.path}")
        opts = Options(raw_mode=True)
        opts.create_if_missing(not read_only)
        opts.create_missing_column_families(not read_only)
        access = AccessType.read_only() if read_only else AccessType.read_write()
        if not read_only:
            self.path.mkdir(parents=True, exist_ok=True)
        try:
            self._db = Rdict(str(self.path), options=opts,
                             column_families={COLUMN_FAMILY: Options(raw_mode=True)}, access_type=access)
        except Exception as e:  # rocksdict raises a bare Exception for every RocksDB status
            raise IndexUnavailableError(f"cannot open index {self.path}: {e}") from None
        self._cf = self._db.get_column_family(COLUMN_FAMILY)
        self._handle = self._db.get_column_family_handle(COLUMN_FAMILY)
        self._sync = WriteOptions()
        self._sync.sync = sync
        self._nosync = WriteOptions()
        self._nosync.sync = False
        self._closed = False

    def get(self, key: StorageKey) -> BlockMeta | None:
        """The meta of `key`, None if absent. Raises BadRowError for an undecodable row."""
        self._check_open()
        raw = self._cf.get(key)
        return None if raw is None else BlockMeta.decode(raw)

    def put(self, key: StorageKey, meta: BlockMeta, *, sync: bool = True) -> None:
        self.put_many([(key, meta)], sync=sync)

    def put_many(self, rows: Iterable[tuple[StorageKey, BlockMeta]], *, sync: bool = True) -> None:
        """Write rows atomically (one WriteBatch); `sync` waits for the WAL to reach the disk."""
        self._check_open()
        batch = WriteBatch(raw_mode=True)
        batch.set_default_column_family(self._handle)
        for key, meta in rows:
            batch.put(key, meta.encode())
        self._write(batch, sync)

    def delete_many(self, keys: Iterable[StorageKey], *, sync: bool = False) -> None:
        self._check_open()
        batch = WriteBatch(raw_mode=True)
        batch.set_default_column_family(self._handle)
        for key in keys:
            batch.delete(key)
        self._write(batch, sync)

    def rows(self) -> Iterator[tuple[StorageKey, BlockMeta | None]]:
        """Every row in key order; meta is None for a row that does not decode."""
        self._check_open()
        for raw_key, raw in self._cf.items():
            if not isinstance(raw_key, bytes) or not isinstance(raw, bytes):
                raise RuntimeError("index column family opened outside raw mode")
            key = StorageKey(raw_key)
            try:
                yield key, BlockMeta.decode(raw) if len(key) == HASH_SIZE else None
            except BadRowError:
                yield key, None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._cf.close()
            self._db.close()
            # RocksDB keeps its LOCK while any column-family object is alive: drop ours now.
            del self._cf, self._handle, self._db

    def __enter__(self) -> Index:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"index {self.path} is closed")

    def _write(self, batch: WriteBatch, sync: bool) -> None:
        if batch.is_empty():
            return
        if self.read_only:
            raise IndexUnavailableError(f"index {self.path} is open read-only")
        try:
            self._db.write(batch, self._sync if sync else self._nosync)
        except Exception as e:  # a bare Exception from rocksdict: disk full, I/O error
            raise IndexUnavailableError(f"index write failed: {e}") from None


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
