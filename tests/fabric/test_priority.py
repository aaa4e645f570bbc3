"""Background work (write-behind flush, eviction) runs at a lower CPU priority than the engine."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
from testkit import wait_until

from fabric.config import KVConfig
from fabric.priority import lower_thread_priority
from fabric.store import Store

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux-only")


def nice_of(tid: int) -> int:
    fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[16])   # field 19 of stat(5); [0] here is field 3


def test_store_background_thread_runs_nicer_than_its_caller(tmp_path: Path) -> None:
    kv = KVConfig(ssd_dir=str(tmp_path / "ssd"), index_dir=str(tmp_path / "index"), ram_gib=0.01, ssd_gib=0.05,
                  background_nice=10)
    base = nice_of(threading.get_native_id())
    want = min(19, base + 10)
    with Store.open(kv):
        def lowered() -> bool:   # the thread lowers itself first thing once it runs
            found = [t.native_id for t in threading.enumerate() if t.name == "kvfabric-store" and t.native_id]
            return bool(found) and nice_of(found[0]) == want
        wait_until(lowered, f"the store thread at nice {want}", 5, poll_s=0.01)
    assert nice_of(threading.get_native_id()) == base   # the caller's own priority is untouched


@pytest.mark.parametrize("delta", [5, 0])
def test_lower_thread_priority_affects_only_the_calling_thread(delta: int) -> None:
    """`background_nice = 0` turns it off: the thread keeps its caller's priority."""
    seen: dict[str, int] = {}

    def body() -> None:
        seen["applied"] = int(lower_thread_priority(delta))
        seen["nice"] = nice_of(threading.get_native_id())

    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == {"applied": int(delta > 0), "nice": min(19, base + delta)}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base
