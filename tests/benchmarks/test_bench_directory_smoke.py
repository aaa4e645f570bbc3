"""Smoke test of benchmarks/bench_directory.py: `--quick` runs and ends with the JSON result line.

Timing is not asserted (benchmarks report figures, tests do not gate on them); the benchmark itself
asserts that our shard and the plain baseline give the same locate answers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_prints_json_last_line() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_directory.py"), "--quick", "--rounds", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) > 1, "expected a table before the JSON line"
    result = json.loads(lines[-1])
    assert result["quick"] is True
    assert set(result["locate_us_per_hash"]) == {"1e4", "1e5"}
    assert all(isinstance(v, float) and v > 0 for v in result["locate_us_per_hash"].values())
    for key in ("apply_us_per_entry", "bytes_per_entry", "traced_bytes_per_entry", "estimate_bytes_per_entry",
                "locate_growth", "plain_bytes_per_entry"):
        assert isinstance(result[key], float) and result[key] > 0, key
    assert result["directory_lookups_per_s"] > 0
    assert result["locate_growth_1e5_to_1e7"] is None   # not measured in a quick run
