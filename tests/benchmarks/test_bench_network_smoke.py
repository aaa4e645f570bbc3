"""Smoke test of benchmarks/bench_network.py: `--quick` builds a bed of two hosts, measures every
method over `lan` and `lossy`, removes the bed and ends with the JSON line.

Timing is not asserted (benchmarks report figures, tests do not gate on them). What is asserted: every
method moved bytes between the two hosts, the ratios the JSON promises are there, the output says
which parts of a profile were applied, and nothing of the bed is left behind.
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


def test_quick_run_measures_every_method_between_two_hosts(
        tmp_path: Path, bed_leftovers: Callable[[str], set[str]]) -> None:
    results = tmp_path / "bench_network.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_network.py"), "--quick", "--quic-stock",
                           "--results", str(results)], cwd=ROOT, capture_output=True, text=True, timeout=280,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert any("kvfabric QUIC" in line for line in lines[:-1]), "expected the table before the JSON line"
    assert any("no delay" in line for line in lines[:-1]), "the table must say the delay was not applied"
    result = json.loads(lines[-1])
    assert json.loads(results.read_text()) == result
    assert result["quick"] is True
    assert result["quic_backend"] in ("qh3", "aioquic")
    assert result["applied"] == {"rate": True, "loss": True, "delay": False, "partition": True}
    for p in ("lan", "lossy"):
        for name in ("tcp_socket", "tls_socket", "tls_tcp", "quic", "quic_stock"):
            assert result[f"{name}_mb_s_{p}"] > 0 and result[f"{name}_mb_s_64k_{p}"] > 0, (name, p)
        for key in ("tls_tcp_vs_tls_socket", "quic_vs_tls_tcp", "quic_vs_quic_stock", "get_1m_p50_over_tls_round",
                    "tls_tcp_vs_tls_socket_64k", "quic_vs_tls_tcp_64k"):
            assert result[f"{key}_{p}"] > 0, (key, p)
        for name in ("tls_tcp_get_1m", "quic_get_1m", "tls_round_1m", "tls_tcp_get_64k", "quic_get_64k"):
            assert 0 < result[f"{name}_p50_ms_{p}"] <= result[f"{name}_p99_ms_{p}"], (name, p)
        assert f"ttft_remote_over_recompute_{p}" not in result   # measured by bench_network_ttft.py
    assert (ROOT / result["ttft_figures"]).is_file()
    assert result["quic_p99_over_tls_tcp_p99_lossy"] > 0   # the loaded gets ran beside 4 pulls
    assert result["quic_loaded_pulls_mb_s_lossy"] > 0 and result["tls_tcp_loaded_pulls_mb_s_lossy"] > 0
    assert "quic_p99_over_tls_tcp_p99_lan" not in result   # no loss on lan: no loaded phase
    assert result["bed"].startswith("kvb")
    assert not bed_leftovers(result["bed"]), "the benchmark left namespaces or links behind"
