"""Payload buffers: how a receiving process allocates them (glibc only, opt-in where process-wide).

Every received payload is a fresh buffer handed to the caller, so two costs of a plain `bytearray`
show up per pulled byte: zero-filling memory that decryption overwrites anyway, and page faults
when glibc returns freed buffers to the kernel and maps new ones for the next payload.
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # glibc mallopt parameters
_allocator_tuned = False


def tune_allocator(mmap_threshold: int = 32 << 20, trim_threshold: int = 256 << 20) -> bool:
    """Keep freed buffers in the heap instead of handing them back to the kernel.

    Every received payload is a fresh buffer. With glibc's defaults, buffers of 128 KiB and more
    come from mmap or from a heap top that is trimmed as soon as 2 MiB are free, so each new
    buffer page-faults and is zeroed by the kernel, a large share of the client's CPU per pulled
    byte (perf on 1 MiB pulls; docs/benchmarks.md). Raising both thresholds (process-wide,
    glibc only, once) lets freed buffers be reused; the heap keeps up to `trim_threshold` spare
    bytes. An engine's process has the same pattern with its KV cache: every request allocates
    and frees one (`HFEngineActor` tunes it). The first call wins; returns True when the
    allocator was tuned (now or before)."""
    global _allocator_tuned
    if _allocator_tuned:
        return True
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc: nothing to tune
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    if mallopt(_M_MMAP_THRESHOLD, mmap_threshold) != 1 or mallopt(_M_TRIM_THRESHOLD, trim_threshold) != 1:
        logger.warning("mallopt refused the buffer thresholds; large buffers will page-fault more")
        return False
    _allocator_tuned = True
    logger.debug("glibc mmap threshold %d, trim threshold %d bytes", mmap_threshold, trim_threshold)
    return True


_bytearray_resize = ctypes.pythonapi.PyByteArray_Resize
_bytearray_resize.argtypes = (ctypes.py_object, ctypes.c_ssize_t)
_bytearray_resize.restype = ctypes.c_int


def uninitialised_bytearray(size: int) -> bytearray:
    """A bytearray of `size` bytes whose contents are whatever malloc returned.

    `bytearray(size)` zero-fills, and for payloads that decryption overwrites entirely that memset
    shows in perf as a share of the client's CPU per pulled byte. Growing an empty bytearray
    with the C API's PyByteArray_Resize (a realloc) skips it. For `FrameDecoder(payload_allocator=)`
    only: the decoder returns a payload once every byte of it has been received."""
    buf = bytearray()
    if size:
        _bytearray_resize(buf, size)  # pythonapi raises the MemoryError the C API sets on failure
    return buf
