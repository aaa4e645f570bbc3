"""examples/ray_job.py as a user runs it: `kvfabric up` starts a local 2-node fabric, the example
connects with RAY_ADDRESS, reuses shared prefixes across nodes and prints its hit ratio; then
`kvfabric down`. About 20-60 s on 2 cores, most of it starting the Ray nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KVFABRIC = str(Path(sys.executable).parent / "kvfabric")


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def test_ray_job_example_reuses_prefixes_on_a_local_fabric(tmp_path: Path) -> None:
    env = {**os.environ, "KVFABRIC_HOME": str(tmp_path / "home"), "RAY_TMPDIR": str(tmp_path / "ray-tmp")}
    up = _run([KVFABRIC, "up", "--nodes", "2", "--root", str(tmp_path / "local")], env, timeout=180)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        state = json.loads((tmp_path / "home" / "local-cluster.json").read_text())
        job = _run([sys.executable, "examples/ray_job.py", "--requests", "16", "--prompt-tokens", "512"],
                   {**env, "RAY_ADDRESS": state["address"]}, timeout=180)
    finally:
        down = _run([KVFABRIC, "down"], env, timeout=120)
    assert job.returncode == 0, job.stdout + job.stderr
    assert down.returncode == 0, down.stdout + down.stderr
    totals = json.loads(job.stdout.strip().splitlines()[-1])
    assert totals["requests"] == 16 and totals["num_nodes"] == 2
    assert totals["hit_ratio"] > 0
    assert "hit ratio" in job.stdout and "bytes pulled" in job.stdout
    # 4 system prompts of 32 blocks: at most the 12 repeats' whole prompts can hit (suffixes never
    # repeat); a pull that fails is a shorter hit, never more, so allow some shortfall but no excess.
    assert 12 * 32 // 2 <= totals["hit_blocks"] <= 12 * 32
    assert totals["pulled_bytes"] > 0, "some repeats ran on the other node and pulled the prefix"
    assert totals["wrong_loads"] == 0
    assert "requests:" in job.stderr, "the progress bar is shown"
