"""`kvfabric demo` as a user runs it: a real subprocess that starts three Ray nodes with the fabric,
runs SmolLM2 on each and compares every answer with a recompute (~1.5-2 min on 2 cores)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_demo_reuses_and_pulls_the_system_prompt_with_identical_answers(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cluster.cli.main", "demo", "--questions", "4", "--max-new-tokens", "6",
         "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=290,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(summary) == {"hit_ratio", "ttft_p50_fabric_s", "ttft_p50_recompute_s", "max_abs_logit_diff",
                            "answers_identical"}
    assert summary["answers_identical"] is True and summary["max_abs_logit_diff"] <= 1e-3
    # Request 1 computes the system prompt; of the wave of 3 after it, one reuses it locally and
    # two pull it from that node, so 3 of 4 prompts reuse ~1,088 of their ~1,106 tokens.
    assert summary["hit_ratio"] > 0.7
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in out.stdout.splitlines() if "│" in line]
    assert len(rows) == 4 and all(r[-1] == "✓" for r in rows)
    assert sum(int(r[4]) > 1000 for r in rows) == 2      # pulled from a peer
    assert sum(int(r[3]) > 1000 for r in rows) == 1      # reused from the node's own RAM
    assert "tls-tcp" in out.stdout and any(tmp_path.joinpath("fabric").rglob("*.kvb"))
