"""Smoke test of benchmarks/bench_vllm.py: `--quick` (a small random Llama, one sample per case and size)
starts its own 2-node cluster with four real vLLM engines and ends with the JSON line. Timing is not
asserted; that every cache really served its hit with the recompute's token is (`answers_identical`
requires a hit in every case)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.vllm


def test_quick_run_prints_json_last_line() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_vllm.py"), "--quick"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["answers_identical"] is True and result["pulled_bytes"] > 0
    for key in ("fabric_pull_over_recompute_4k", "fabric_local_over_vllm_prefix_cache_4k"):
        assert result[key] > 0
    # vLLM's CPU offload runs where vLLM can start it; where it cannot, the JSON says why.
    offload = result["fabric_local_over_vllm_offload_4k"]
    assert (offload is not None and offload > 0) or result["offload_error"]
