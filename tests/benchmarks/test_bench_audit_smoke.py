"""Smoke test of benchmarks/bench_audit.py: `--quick` starts a 2-node cluster, serves a liar's
prefixes at rate 0 and then at 10 %, and ends with the JSON line.

Which served prefix is caught is a draw (seeded); what must hold whatever the draws are: at rate 0
the engine used the liar's bytes, and after every quarantine no node loads a block it signed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_prints_json_last_line() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_audit.py"), "--quick"],
                          cwd=ROOT, capture_output=True, text=True, timeout=280, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert any("caught within" in line for line in lines), "expected the table before the JSON line"
    result = json.loads(lines[-1])
    assert result["quick"] is True and result["prefixes_0.1"] == 30
    assert result["baseline_wrong_bytes"] > 0            # without sampling the liar's bytes were used
    assert result["wrong_blocks_after_quarantine"] == 0  # the bar
    for n in (10, 25, 50):
        measured = result[f"caught_within_{n}_0.1"]   # None: no catch and fewer than n prefixes since
        assert measured is None or 0 <= measured <= 1
        assert result[f"predicted_within_{n}_0.1"] == round(1 - 0.9 ** n, 4)
