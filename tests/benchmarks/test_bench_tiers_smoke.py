"""Smoke test of benchmarks/bench_tiers.py: `--quick` runs and ends with the JSON result line.

Timing is not asserted (benchmarks report figures, tests do not gate on them).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_prints_table_then_json_with_every_figure(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_tiers.py"), "--quick",
                           "--dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=240,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert any("SSD get 1 MiB" in line for line in lines[:-1]), "expected the table before the JSON line"
    result = json.loads(lines[-1])
    for key in ("ram_lookup_p99_us", "ssd_get_p99_ms_1mib", "ssd_put_mb_s", "dict_lookup_p99_us",
                "file_read_p99_ms_1mib", "ssd_single_put_mb_s", "dd_fsync_mb_s"):
        assert isinstance(result[key], float) and result[key] > 0, key
    assert result["quick"] is True
    assert list(tmp_path.iterdir()) == []       # the benchmark cleans up after itself
