"""Smoke test of benchmarks/bench_cluster.py: `--quick` starts its own 3-node Ray cluster, runs the
shared-prefix workload (every load is compared byte for byte inside the benchmark) and ends with
the JSON line; one `--quick --events` run serves the plain and the events tests. Timing is not
asserted; the hit ratio is, since it does not depend on speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quick_events_run() -> subprocess.CompletedProcess[str]:
    """One `--quick --events` run: the plain workload and the events comparison on one cluster start
    (the events arms run after the plain measurement, on the same nodes)."""
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cluster.py"), "--quick", "--events"],
                          cwd=ROOT, capture_output=True, text=True, timeout=400, check=False)


def test_quick_run_hits_as_an_ideal_cache_would_and_beats_local_only(
        quick_events_run: subprocess.CompletedProcess[str]) -> None:
    proc = quick_events_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert any("ideal (every repeated block)" in line for line in lines[:-1])
    result = json.loads(lines[-1])
    for key in ("hit_ratio", "ideal_hit_ratio", "local_only_hit_ratio", "pull_mb_s", "load_p99_ms", "handoff_mb_s"):
        assert result[key] > 0, key
    assert result["hit_ratio"] >= 0.95 * result["ideal_hit_ratio"]
    assert result["hit_ratio"] > result["local_only_hit_ratio"]


def test_quick_run_with_events_serves_both_fabrics_alike_and_the_subscriber_sees_blocks(
        quick_events_run: subprocess.CompletedProcess[str]) -> None:
    proc = quick_events_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # Both fabrics served every request, each load compared byte for byte inside the benchmark. How
    # many hits pulls add depends on when owners advertise their blocks, so the two hit ratios are not
    # compared with each other; neither can pass the workload's ideal (every repeated block).
    for arm in ("off", "on"):
        assert 0 < result[f"events_{arm}_hit_ratio"] <= result["events_ideal_hit_ratio"], arm
    assert result["events_blocks_seen"] > 0
    assert result["events_load_p50_over_off"] > 0


def test_quick_trace_replay_reports_the_cluster_beside_its_baselines() -> None:
    """Both traces (8 system prompts; one shared by every request). The baselines are exact models of
    the same requests: pooled capacity cannot beat an unbounded cache, nor isolated caches of the same
    total capacity beat a pooled one. Every load the cluster answered was compared byte for byte
    inside the benchmark, and every request was served by one of the 3 nodes."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cluster.py"), "--trace", "--quick"],
                          cwd=ROOT, capture_output=True, text=True, timeout=400, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert sum("pooled LRU (" in line for line in lines[:-1]) == 2     # one table per trace
    assert any("requests per node" in line for line in lines[:-1])
    result = json.loads(lines[-1])
    for t in ("trace", "shared_trace"):
        assert result[f"{t}_requests"] == 60 and result[f"{t}_capacity_blocks"] > 0
        assert 0 < result[f"{t}_hit_ratio"] <= result[f"{t}_max_hit_ratio"]
        assert result[f"{t}_isolated_lru_hit_ratio"] <= result[f"{t}_pooled_lru_hit_ratio"] \
            <= result[f"{t}_max_hit_ratio"]
        assert result[f"{t}_hit_over_pooled_lru"] == pytest.approx(
            result[f"{t}_hit_ratio"] / result[f"{t}_pooled_lru_hit_ratio"], abs=1e-3)
        per_node = result[f"{t}_requests_per_node"]
        assert len(per_node) == 3 and sum(per_node) == 60
        assert result[f"{t}_busiest_over_mean"] == pytest.approx(max(per_node) / 20, abs=1e-3)
        assert sum(result[f"{t}_node_shares"]) == pytest.approx(1.0, abs=0.01)
