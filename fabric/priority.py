"""Background work yields the CPU to foreground work: a lower scheduling priority per thread.

The store's write-behind flusher and eviction pass, and the NodeActor's mirroring of pulled
blocks, are work nobody waits for; on a node where the engine computes on the CPU (or feeds a GPU
from it) they should never slow a prefill. On Linux a thread is a task with its own nice value,
so `lower_thread_priority` raises the calling thread's nice by `delta` (RocksDB lowers its
compaction threads the same way). Raising nice needs no privilege; elsewhere, or where it is
refused, this logs once and the thread keeps its priority.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

logger = logging.getLogger(__name__)

BACKGROUND_NICE = 10
_warned = False


def lower_thread_priority(delta: int = BACKGROUND_NICE) -> bool:
    """Raise the calling thread's nice value by `delta` (capped at 19); True when it took effect."""
    global _warned
    if delta <= 0:
        return False
    if not sys.platform.startswith("linux"):
        return False   # elsewhere PRIO_PROCESS with a thread id would renice the whole process
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + delta))
    except OSError as e:
        if not _warned:
            _warned = True
            logger.info("background threads keep their priority: setpriority refused (%s)", e)
        return False
    return True
