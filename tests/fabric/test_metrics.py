"""Store metrics: names and labels, one registry per store, exposition over HTTP."""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path

import blake3
from prometheus_client.parser import text_string_to_metric_families

from fabric.config import KVConfig
from fabric.keys import BlockAddress, BlockHash
from fabric.metrics import StoreMetrics
from fabric.store import PutResult, Store
from fabric.tiers.base import Tier


def addr(i: int) -> BlockAddress:
    return BlockAddress(BlockHash(blake3.blake3(b"metrics-%d" % i).digest()), 0)


def kv(root: Path, **overrides: object) -> KVConfig:
    cfg = KVConfig(ssd_dir=str(root / "ssd"), index_dir=str(root / "index"), write_through=True)
    for name, value in overrides.items():
        setattr(cfg, name, value)
    return cfg


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_exposition_names_every_metric_with_its_labels(tmp_path: Path) -> None:
    with Store.open(kv(tmp_path), background=False) as store:
        payload = os.urandom(10_000)
        store.put(addr(1), payload)
        store.get(addr(1))
        store.get(addr(2))
        store.put(addr(3), b"x", digest=b"\0" * 32)
        got = samples(store.metrics.render())
    assert got[("kvfabric_blocks", (("tier", "ram"),))] == 1
    assert got[("kvfabric_blocks", (("tier", "ssd"),))] == 1
    assert got[("kvfabric_bytes", (("tier", "ram"),))] == 10_000
    assert got[("kvfabric_bytes", (("tier", "ssd"),))] == 4096 + 10_000
    assert got[("kvfabric_lookup_seconds_count", (("outcome", "hit"), ("tier", "ram")))] == 1
    assert got[("kvfabric_lookup_seconds_count", (("outcome", "miss"), ("tier", "none")))] == 1
    assert got[("kvfabric_put_rejected_total", (("reason", "digest_mismatch"),))] == 1
    assert ("kvfabric_index_reconciled_total", (("action", "temp_file"),)) in got
    families = {f.name for f in text_string_to_metric_families(store.metrics.render().decode())}
    assert {"kvfabric_blocks", "kvfabric_bytes", "kvfabric_lookup_seconds", "kvfabric_evictions",
            "kvfabric_corrupt_blocks", "kvfabric_index_reconciled", "kvfabric_put_rejected"} <= families


def test_two_stores_in_one_process_keep_separate_counts(tmp_path: Path) -> None:
    with Store.open(kv(tmp_path / "a"), background=False) as a, \
            Store.open(kv(tmp_path / "b"), background=False) as b:
        for i in range(3):
            assert a.put(addr(i), b"payload %d" % i) is PutResult.OK
        assert b.put(addr(9), b"other") is PutResult.OK
        assert a.metrics.registry is not b.metrics.registry
        assert a.metrics.value("kvfabric_blocks", tier="ssd") == 3
        assert b.metrics.value("kvfabric_blocks", tier="ssd") == 1


def test_eviction_and_device_gauges_follow_the_store(tmp_path: Path) -> None:
    with Store.open(kv(tmp_path, ssd_ttl_s=10.0), background=False, clock=lambda: 1000.0) as store:
        store.put(addr(1), b"short-lived")
        store.run_maintenance(now=1011.0)
        assert store.metrics.value("kvfabric_evictions_total", tier="ssd") == 1

        class BlockStored:
            block_hashes = (addr(5).hash, addr(6).hash)

        store.apply_events([BlockStored()])
        assert store.metrics.value("kvfabric_blocks", tier=Tier.DEVICE.value) == 2


def test_registry_is_served_over_http(tmp_path: Path) -> None:
    metrics = StoreMetrics()
    metrics.put_rejected.labels("full").inc(4)
    server, thread = metrics.serve(0)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            body = response.read()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    assert b'kvfabric_put_rejected_total{reason="full"} 4.0' in body
