"""Smoke test of benchmarks/bench_blocks.py: `--quick` runs and ends with the JSON result line.

Timing is not asserted (benchmarks report figures, tests do not gate on them).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_prints_json_last_line() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_blocks.py"), "--quick"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) > 1, "expected a table before the JSON line"
    result = json.loads(lines[-1])
    sizes = {"10k", "100k", "1m"}
    for key in ("us_per_op", "baseline_us_per_op"):
        assert set(result[key]) == sizes
        assert all(isinstance(v, float) and v > 0 for v in result[key].values())
    for key in ("ratio_10k", "ratio_1m", "growth_10k_to_1m"):
        assert isinstance(result[key], float) and result[key] > 0
    assert result["quick"] is True
    assert 0 < result["hit_ratio"] < 1  # the shared prompts were actually hit
