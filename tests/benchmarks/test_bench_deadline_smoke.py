"""Smoke test of benchmarks/bench_deadline.py: `--quick --reps 1` runs every link phase on a real 2-node
cluster with SmolLM2 and ends with its JSON line. Timing is not asserted; what is: each phase
produced answers, the fast link pulled the prefix, and the ratios are reported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_deadline_bench_reports_every_phase_and_json_last() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_deadline.py"), "--quick", "--reps", "1"],
                          cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert any("TTFT on node B" in line for line in lines[:-1]), "expected the table before the JSON line"
    result = json.loads(lines[-1])
    for key in ("ttft_uncapped_s", "ttft_fast_s", "ttft_fast_plain_s", "ttft_slow_s", "ttft_recompute_s",
                "ttft_slow_link_over_recompute", "ttft_fast_link_over_pull", "breakeven_mb_s"):
        assert isinstance(result[key], float) and result[key] > 0, key
