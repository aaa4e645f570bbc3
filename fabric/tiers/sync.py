"""Durability primitives for the SSD tier: folder fsync, and `syncfs` for group commits.

A group commit of n block files costs n fdatasync + one fsync per touched folder when each file is
synced on its own; on ext4 each of those forces a journal commit. `syncfs(2)` makes every dirty
page and entry of the filesystem durable in one call, at a fraction of the CPU (figures in
docs/benchmarks.md), so the tier uses it for batches:

    write every temp file ─► syncfs (their data) ─► rename each ─► syncfs (the new names)

which keeps the per-file order (a final name only ever points at durable bytes). `syncfs` reports
writeback errors only since Linux 5.8 (errseq); on older kernels, and off Linux, `syncfs_supported`
is False and the tier syncs file by file. Its cost grows with other writers' dirty data on the
same filesystem, which is why only batches use it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import re
from collections.abc import Callable
from pathlib import Path


def fsync_folder(folder: Path) -> None:
    """Make the folder's entries (renames, creations, unlinks) durable."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def try_fsync_folder(folder: Path) -> OSError | None:
    try:
        fsync_folder(folder)
    except OSError as e:
        return e
    return None


def _kernel_at_least(release: str, major: int, minor: int) -> bool:
    m = re.match(r"(\d+)\.(\d+)", release)
    return m is not None and (int(m[1]), int(m[2])) >= (major, minor)


def _load_syncfs() -> Callable[[int], int] | None:
    if platform.system() != "Linux" or not _kernel_at_least(platform.release(), 5, 8):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.syncfs
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_SYNCFS = _load_syncfs()


def syncfs_supported() -> bool:
    return _SYNCFS is not None


def syncfs(path: Path) -> None:
    """Make everything written on `path`'s filesystem durable; raises OSError with the writeback error."""
    if _SYNCFS is None:
        raise OSError("syncfs is not available here (needs Linux 5.8+)")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _SYNCFS(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs of {path}: {os.strerror(err)}")
    finally:
        os.close(fd)
