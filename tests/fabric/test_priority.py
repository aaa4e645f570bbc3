"""Background work (write-behind flush, eviction) runs at a lower CPU priority than the engine."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from fabric.config import KVConfig
from fabric.priority import lower_thread_priority
from fabric.store import Store

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux-only")


def nice_of(tid: int) -> int:
    fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[16])   # field 19 of stat(5); [0] here is field 3


@pytest.mark.parametrize("nice", [10, 0])
def test_store_background_thread_runs_nicer_than_its_caller(tmp_path: Path, nice: int) -> None:
    kv = KVConfig(ssd_dir=str(tmp_path / "ssd"), index_dir=str(tmp_path / "index"), ram_gib=0.01, ssd_gib=0.05,
                  background_nice=nice)
    base = nice_of(threading.get_native_id())
    with Store.open(kv):
        deadline = time.monotonic() + 5
        while not (found := [t for t in threading.enumerate() if t.name == "kvfabric-store"]):
            assert time.monotonic() < deadline, "no store background thread"
            time.sleep(0.01)
        thread = found[0]
        assert thread.native_id is not None
        time.sleep(0.05)   # it lowers itself first thing
        assert nice_of(thread.native_id) == min(19, base + nice)
    assert nice_of(threading.get_native_id()) == base   # the caller's own priority is untouched


def test_lower_thread_priority_affects_only_the_calling_thread() -> None:
    seen: dict[str, int] = {}

    def body() -> None:
        seen["applied"] = int(lower_thread_priority(5))
        seen["nice"] = nice_of(threading.get_native_id())

    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == {"applied": 1, "nice": min(19, base + 5)}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base
