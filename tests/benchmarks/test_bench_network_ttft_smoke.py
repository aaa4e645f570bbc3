"""Smoke test of benchmarks/bench_network_ttft.py: `--quick --profiles lan` builds a bed of two hosts
with Ray, the fabric and a SmolLM2 engine per host, measures a 256-token prefix over `lan` (a shaped
link: its rate and loss applied), removes the bed and ends with the JSON line.

Timing is not asserted (benchmarks report figures, tests do not gate on them). What is asserted: the
plain pull moved the whole prefix from host A to host B under every profile, every path produced a
TTFT and the ratios the JSON promises are there, the output says the delay was not applied, the
results file holds the same JSON, and nothing of the bed is left behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from cluster.netbed.bed import missing_capability

ROOT = Path(__file__).resolve().parents[2]
_missing = missing_capability()
pytestmark = pytest.mark.skipif(_missing is not None, reason=f"network test bed needs {_missing}")


def test_quick_run_pulls_the_prefix_over_each_profile_and_reports_ratios(
        tmp_path: Path, bed_leftovers: Callable[[str], set[str]]) -> None:
    results = tmp_path / "bench_network_ttft.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_network_ttft.py"), "--quick",
                           "--profiles", "lan", "--results", str(results)],
                          cwd=ROOT, capture_output=True, text=True, timeout=280, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert any("TTFT on host B" in line for line in lines[:-1]), "expected the table before the JSON line"
    assert any("no delay" in line for line in lines[:-1]), "the table must say the delay was not applied"
    result = json.loads(lines[-1])
    assert json.loads(results.read_text()) == result
    assert result["quick"] is True and result["tokens"] == 256
    assert result["applied"] == {"rate": True, "loss": True, "delay": False, "partition": True}
    assert set(result["profiles"]) == {"lan"}
    assert result["wall_s"] > 0
    for p in ("lan",):
        assert result[f"pulled_tokens_plain_{p}"] == 256, p   # the whole prefix crossed the link
        assert 0 <= result[f"pulled_tokens_decided_{p}"] <= 256, p
        assert result[f"pull_mb_s_{p}"] > 0, p
        for path in ("plain", "decided", "recompute"):
            assert result[f"ttft_{path}_s_{p}"] > 0, (path, p)
        for key in ("ttft_remote_over_recompute", "ttft_decided_over_recompute"):
            assert result[f"{key}_{p}"] > 0, (key, p)
    assert result["bed"].startswith("kvb")
    assert not bed_leftovers(result["bed"]), "the benchmark left namespaces or links behind"
