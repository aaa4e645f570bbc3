"""Smoke test of benchmarks/bench_ttft.py: `--quick` (256- and 512-token prompts) starts its own
3-node cluster, runs all four paths and ends with the JSON line (~65 s on 2 cores).

Timing is not asserted (benchmarks report figures, tests do not gate on them); that every path
really ran is: the benchmark itself fails when a pull did not come from a peer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_prints_json_last_line() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_ttft.py"), "--quick", "--reps", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=280, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert any("layer-wise pull" in line for line in lines), "expected the table before the JSON line"
    result = json.loads(lines[-1])
    assert result["quick"] is True
    for size in ("256", "512"):
        for path in ("recompute", "local", "remote", "remote_layerwise"):
            assert result[f"ttft_{path}_{size}_s"] > 0
        assert result[f"ratio_remote_{size}"] > 0 and result[f"remote_over_local_{size}"] > 0
        # The CPU of the six actors is read around every request; a recompute keeps an engine busy.
        assert result[f"cpu_remote_{size}_s"] > 0 and result[f"cpu_local_{size}_s"] > 0
        assert 0 <= result[f"overlap_layerwise_{size}_s"] <= result[f"ttft_remote_layerwise_{size}_s"]
        assert result[f"cpu_recompute_{size}_s"] >= result[f"ttft_recompute_{size}_s"] * 0.25
        # A sampled pull was audited (the bench fails otherwise) and its cost at the default rate reported.
        assert result[f"ttft_remote_sampled_{size}_s"] > 0 and f"audit_added_share_{size}" in result
    assert result["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4   # K and V, 30 layers, 3 KV heads, f32
    assert result["breakeven_mb_s"] > 0 and result["pull_mb_s"] > 0
