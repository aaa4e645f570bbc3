"""Smoke test of benchmarks/soak_hostile.py: `--quick` runs every hostile case against a node while a
good client pulls, and ends with the JSON result line.

Timing is not asserted (benchmarks report figures, tests do not gate on them); what is asserted is
what the soak must show whatever the machine: every case ran, the node kept answering the good
client, and it stopped cleanly on SIGTERM afterwards.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_soak_keeps_the_node_answering_and_prints_json_last_line() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak_hostile.py"), "--quick"],
                          cwd=ROOT, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert any("Good client pulling" in line for line in lines[:-1]), "expected the table before the JSON line"
    result = json.loads(lines[-1])
    assert result["quick"] is True
    for key in ("good_p50_idle_ms", "good_p99_idle_ms", "good_p50_under_attack_ms", "good_p99_under_attack_ms",
                "good_p99_under_attack_over_idle", "server_rss_idle_mib", "server_rss_under_attack_mib",
                "loop_lag_idle_max_ms", "loop_lag_under_attack_max_ms"):
        assert isinstance(result[key], float) and result[key] > 0, key
    assert result["good_failed_pulls_under_attack"] == 0
    assert result["server_answered_after_attack"] is True
    assert result["server_stopped_cleanly"] is True
    attack = result["attack"]
    assert not [k for k in attack if k.startswith("failed_")], attack
    for case in ("ended_streams", "half_open_answered", "connections_refused_overloaded", "oversize_too_large",
                 "tls_flood_overloaded", "quic_flood_pulls"):
        assert attack.get(case, 0) > 0, case
