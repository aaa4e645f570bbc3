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
    assert "restarted" in out.stdout and "store" in out.stdout
    assert any(tmp_path.joinpath("ssd").rglob("*.kvb"))  # the SSD tier really holds the blocks
