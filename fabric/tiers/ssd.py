"""SSD tier: one file per (block, layer) with a self-describing, digest-checked header (the file
format, its names and the folder scan are `fabric.tiers.ssd_format`'s).

A write goes to a temp name in the block's folder, is fdatasync'ed, renamed over the final name,
and the folder is fsync'ed (`durable`), so a crash leaves either the old state or the whole new
file, plus at worst a stray temp file that `scan()` reports. A batch of GROUP_SYNC_MIN files or
more keeps that order with two `syncfs` calls instead (every temp file's bytes, then the renames;
fabric/tiers/sync.py), far less CPU than a sync per file on ext4. A read checks the header digest,
key, layer, file length and the payload digest and raises `CorruptBlockError` on any mismatch:
no byte of a block that does not verify is ever returned. Reads use O_DIRECT into page-aligned
anonymous memory when the filesystem allows it (probed at open; otherwise a log line and
buffered reads followed by posix_fadvise(DONTNEED)), so the SSD tier never doubles as a second,
unaccounted page-cache tier; writes drop their pages after the sync for the same reason.

The in-memory catalog is `fabric.tiers.ssd_catalog.SsdCatalog`, not thread-safe (the Store
serialises it under its lock); the file methods here are, and do no locking.
"""

from __future__ import annotations

import errno
import itertools
import logging
import mmap
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

import blake3

from fabric.keys import StorageKey
from fabric.tiers.base import CorruptBlockError, StoredBlock, Tier
from fabric.tiers.ssd_catalog import SsdCatalog
from fabric.tiers.ssd_format import (
    HEADER_SIZE,
    SsdScan,
    decode_header,
    encode_header,
    file_name,
    scan_folder,
)
from fabric.tiers.sync import fsync_folder, syncfs, syncfs_supported, try_fsync_folder

logger = logging.getLogger(__name__)

ALIGN = 4096
# Errors that mean "the filesystem has no room for this write" (EFBIG: RLIMIT_FSIZE or a file-size cap).
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
# A batch of at least this many files is made durable with two syncfs calls (fabric.tiers.sync).
GROUP_SYNC_MIN = 16


@dataclass(frozen=True, slots=True)
class WriteItem:
    key: StorageKey
    layer: int
    payload: memoryview
    digest: bytes
    created_unix: float


class SsdTier(SsdCatalog):
    """Block files under `root` plus their in-memory catalog. See the module docstring."""

    tier = Tier.SSD

    def __init__(self, root: str | os.PathLike[str], *, capacity_bytes: int, durable: bool = True,
                 o_direct: bool = True, capacity_blocks: int = 0) -> None:
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self.capacity_blocks = capacity_blocks     # distinct block hashes at most (0: bytes only)
        self.durable = durable
        self._init_catalog()
        self._temp_ids = itertools.count()
        self._make_folders()
        self.o_direct = o_direct and self._probe_o_direct()

    # ---- protocol conveniences (catalog + file; single-threaded users such as tests and the CLI) ----

    def get(self, key: StorageKey) -> StoredBlock | None:
        """Read and verify a catalogued block; None if unknown. Raises CorruptBlockError."""
        entry = self._catalog.get(key)
        return None if entry is None else self.read_file(key, entry.layer, entry.digest)

    def remove(self, key: StorageKey) -> bool:
        entry = self.discard(key)
        if entry is None:
            return False
        self.unlink(key, entry.layer)
        return True

    # ---- files (thread-safe, no locks) -----------------------------------------------------------

    def folder_for(self, key: bytes) -> Path:
        return self.root / f"{key[0]:02x}"

    def path_for(self, key: bytes, layer: int) -> Path:
        return self.folder_for(key) / file_name(key, layer)

    def write_file(self, item: WriteItem, *, sync_folder: bool = True) -> Path:
        """Write one block file atomically; returns its folder. Raises OSError (temp file removed)."""
        temp, final = self._write_temp(item, sync=self.durable)
        try:
            os.replace(temp, final)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        if sync_folder and self.durable:
            fsync_folder(final.parent)
        return final.parent

    def _write_temp(self, item: WriteItem, *, sync: bool) -> tuple[Path, Path]:
        """The block's bytes under a temp name (fdatasync'ed and dropped from the page cache when
        `sync`); returns (temp, final). Raises OSError with the temp file removed."""
        final = self.folder_for(item.key) / file_name(item.key, item.layer)
        temp = final.parent / f".{final.stem}.{os.getpid()}.{next(self._temp_ids)}.tmp"
        header = encode_header(item.key, item.layer, item.payload.nbytes, item.digest, item.created_unix)
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            try:
                _write_all(fd, [header, item.payload])
                if sync:
                    os.fdatasync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        return temp, final

    def write_files(self, items: Sequence[WriteItem], pool: Executor) -> list[OSError | None]:
        """Group commit; returns one entry per item: None when the file is committed (durable if
        `durable`), or the OSError that stopped it (its file is then removed).

        Batches of GROUP_SYNC_MIN files or more, where the kernel reports writeback errors to
        `syncfs`, are written in this thread and synced with two `syncfs` calls (data, then names);
        smaller ones are written and fdatasync'ed in parallel on `pool`, then each folder fsync'ed.
        """
        if self.durable and len(items) >= GROUP_SYNC_MIN and syncfs_supported():
            return self._write_files_syncfs(items)
        futures = [pool.submit(self.write_file, item, sync_folder=False) for item in items]
        results: list[OSError | None] = []
        folders: dict[Path, list[int]] = {}
        for i, fut in enumerate(futures):
            try:
                folders.setdefault(fut.result(), []).append(i)
                results.append(None)
            except OSError as e:
                results.append(e)
        if self.durable:
            synced = list(pool.map(try_fsync_folder, folders))
            for (_folder, indices), err in zip(folders.items(), synced, strict=True):
                for i in indices if err is not None else ():
                    results[i] = err
                    self.unlink(items[i].key, items[i].layer)
        return results

    def _write_files_syncfs(self, items: Sequence[WriteItem]) -> list[OSError | None]:
        # Unsynced writes only reach the page cache, which is fast: one thread, no hand-offs.
        results: list[OSError | None] = []
        written: list[tuple[int, Path, Path]] = []
        for i, item in enumerate(items):
            try:
                temp, final = self._write_temp(item, sync=False)
                written.append((i, temp, final))
                results.append(None)
            except OSError as e:
                results.append(e)
        if not written:
            return results
        try:
            syncfs(self.root)                     # 1. every temp file's bytes are durable
        except OSError as e:
            for i, temp, _final in written:
                results[i] = e
                temp.unlink(missing_ok=True)
            return results
        renamed: list[tuple[int, Path]] = []
        for i, temp, final in written:
            try:
                _drop_cached(temp)                # clean pages now: keep the tier out of the page cache
                os.replace(temp, final)           # 2. the final name points at durable bytes
                renamed.append((i, final))
            except OSError as e:
                results[i] = e
                temp.unlink(missing_ok=True)
        try:
            syncfs(self.root)                     # 3. the new names are durable
        except OSError as e:
            for i, final in renamed:
                results[i] = e
                final.unlink(missing_ok=True)
        return results

    def read_file(self, key: StorageKey, layer: int, expected_digest: bytes | None = None) -> StoredBlock:
        """Read and verify one block file. Raises FileNotFoundError or CorruptBlockError."""
        fd = self._open_for_read(self.path_for(key, layer))
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_SIZE:
                raise CorruptBlockError(key, f"truncated: {size} bytes, header alone is {HEADER_SIZE}")
            buf = self._read_all(fd, key, size)
        finally:
            os.close(fd)
        header = decode_header(memoryview(buf)[:HEADER_SIZE], key)
        if header.key != key or header.layer != layer:
            raise CorruptBlockError(key, f"file holds another block ({header.key.hex()[:16]}/{header.layer})")
        if size != HEADER_SIZE + header.length:
            raise CorruptBlockError(key, f"length mismatch: file has {size - HEADER_SIZE} payload bytes, "
                                         f"header says {header.length}")
        if expected_digest is not None and header.digest != expected_digest:
            raise CorruptBlockError(key, "header digest differs from the index")
        payload = memoryview(buf)[HEADER_SIZE:size]
        if blake3.blake3(payload).digest() != header.digest:
            raise CorruptBlockError(key, "payload digest mismatch")
        return StoredBlock(payload.toreadonly(), header.digest, Tier.SSD)

    def unlink(self, key: bytes, layer: int) -> bool:
        try:
            os.unlink(self.path_for(key, layer))
        except FileNotFoundError:
            return False
        return True

    def scan(self) -> SsdScan:
        """List every file under the root (no reads beyond the folder entries)."""
        return scan_folder(self.root)

    # ---- internals -------------------------------------------------------------------------------

    def _folders(self) -> Iterator[Path]:
        for i in range(256):
            yield self.root / f"{i:02x}"

    def _make_folders(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        created = False
        for folder in self._folders():
            if not folder.is_dir():
                folder.mkdir(exist_ok=True)
                created = True
        if created and self.durable:
            fsync_folder(self.root)

    def _probe_o_direct(self) -> bool:
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            logger.info("O_DIRECT is not available on this platform; SSD reads are buffered + fadvise")
            return False
        probe = self.root / f".o_direct_probe.{os.getpid()}"
        try:
            probe.write_bytes(b"\0" * ALIGN)
            fd = os.open(probe, os.O_RDONLY | flag)
            try:
                os.preadv(fd, [mmap.mmap(-1, ALIGN)], 0)
            finally:
                os.close(fd)
        except OSError as e:
            logger.info("O_DIRECT reads refused under %s (%s); falling back to buffered reads with "
                        "posix_fadvise(DONTNEED)", self.root, e.strerror)
            return False
        finally:
            probe.unlink(missing_ok=True)
        return True

    def _open_for_read(self, path: Path) -> int:
        if self.o_direct:
            try:
                return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                logger.warning("O_DIRECT open refused for %s; falling back to buffered reads", path)
                self.o_direct = False
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def _read_all(self, fd: int, key: StorageKey, size: int) -> mmap.mmap | bytearray:
        buf: mmap.mmap | bytearray
        if self.o_direct:
            # O_DIRECT wants an aligned buffer, offset and length: anonymous mmap memory is page-aligned,
            # and a read that stops short of the end stops on a block boundary, so it can go on from there
            # (a short read is not corruption: the file is re-read until its end).
            buf = mmap.mmap(-1, -(-size // ALIGN) * ALIGN)
            view = memoryview(buf)
            got = 0
            while got < size and (n := os.preadv(fd, [view[got:]], got)) > 0:
                got += n
                if got % ALIGN:
                    break  # an O_DIRECT read ends off a block boundary only at the end of the file
            view.release()
        else:
            buf = bytearray(size)
            view = memoryview(buf)
            got = 0
            while got < size and (n := os.preadv(fd, [view[got:]], got)) > 0:
                got += n
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if got != size:
            raise CorruptBlockError(key, f"short read: {got} of {size} bytes (file shrank while read)")
        return buf


def _write_all(fd: int, buffers: list[bytes | memoryview]) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        n = os.writev(fd, views)
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _drop_cached(path: Path) -> None:
    """Drop a synced file's pages from the page cache; a hint, so a failure is only logged."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    except OSError as e:
        logger.debug("could not drop %s from the page cache: %s", path, e)
