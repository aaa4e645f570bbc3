"""`kvfabric demo` as a user runs it: a real subprocess, exit code and the verdict line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_demo_runs_and_reuses_prefix(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "demo", "--system-tokens", "64", "--requests", "2",
         "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=240,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "OK: every reused prefix gave the same logits" in out.stdout
    # After the restart the first request's prefix can only have come from the store (SSD).
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in out.stdout.splitlines() if "│" in line]
    restarted_first = next(r for r in rows if r[:2] == ["restarted", "0"])
    assert restarted_first[4] == "store" and int(restarted_first[3]) == 64
    assert any(tmp_path.joinpath("ssd").rglob("*.kvb"))  # the SSD tier really holds the blocks
