"""Smoke test of benchmarks/bench_cluster.py: `--quick` starts its own 3-node Ray cluster, runs the
shared-prefix workload (every load is compared byte for byte inside the benchmark) and ends with
the JSON line. Timing is not asserted; the hit ratio is, since it does not depend on speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_hits_as_an_ideal_cache_would_and_beats_local_only() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cluster.py"), "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert any("ideal (every repeated block)" in line for line in lines[:-1])
    result = json.loads(lines[-1])
    for key in ("hit_ratio", "ideal_hit_ratio", "local_only_hit_ratio", "pull_mb_s", "load_p99_ms", "handoff_mb_s"):
        assert result[key] > 0, key
    assert result["hit_ratio"] >= 0.95 * result["ideal_hit_ratio"]
    assert result["hit_ratio"] > result["local_only_hit_ratio"]


def test_quick_run_with_events_serves_both_fabrics_alike_and_the_subscriber_sees_blocks() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cluster.py"), "--quick", "--events"],
                          cwd=ROOT, capture_output=True, text=True, timeout=400, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["events_on_hit_ratio"] == result["events_off_hit_ratio"] > 0
    assert result["events_blocks_seen"] > 0
    assert result["events_load_p50_over_off"] > 0


def test_quick_trace_replay_reports_the_cluster_beside_its_baselines() -> None:
    """The trace bench's baselines are exact models of the same requests: pooled capacity cannot beat
    an unbounded cache, nor isolated caches of the same total capacity beat a pooled one. Every
    load the cluster answered was compared byte for byte inside the benchmark."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cluster.py"), "--trace", "--quick"],
                          cwd=ROOT, capture_output=True, text=True, timeout=400, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert any("pooled LRU" in line for line in lines[:-1])
    result = json.loads(lines[-1])
    assert result["trace_requests"] == 60 and result["trace_capacity_blocks"] > 0
    assert 0 < result["trace_hit_ratio"] <= result["trace_max_hit_ratio"]
    assert result["trace_isolated_lru_hit_ratio"] <= result["trace_pooled_lru_hit_ratio"] \
        <= result["trace_max_hit_ratio"]
    assert sum(result["trace_node_shares"]) == pytest.approx(1.0, abs=0.01)
