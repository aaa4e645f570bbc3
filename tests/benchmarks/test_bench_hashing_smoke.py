"""Smoke test of benchmarks/bench_hashing.py: `--quick` runs and ends with the JSON result line (no timing asserts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_prints_json_last_line() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_hashing.py"), "--quick",
                           "--tokens", "8192"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) > 1, "expected a table before the JSON line"
    result = json.loads(lines[-1])
    for key in ("ns_per_token_bs16", "ns_per_token_bs256", "sha256_ns_per_token_bs16", "ratio_bs16"):
        assert isinstance(result[key], float) and result[key] > 0
