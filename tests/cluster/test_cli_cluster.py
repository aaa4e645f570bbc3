"""`kvfabric up / stats / down` as a user runs them: separate processes, a real local Ray cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KVFABRIC = [str(Path(sys.executable).parent / "kvfabric")]  # the installed entry point


def run(args: list[str], home: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVFABRIC_HOME": str(home), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    return subprocess.run(KVFABRIC + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


def test_up_stats_down_round_trip(tmp_path: Path) -> None:
    home = tmp_path / "home"
    config = tmp_path / "team.toml"   # not the default namespace, directory name or shard count
    config.write_text('[cluster]\nnamespace = "team-a"\ndirectory_name = "team-a-dir"\ndirectory_shards = 2\n')
    up = run(["up", "--nodes", "2", "--root", str(tmp_path / "fabric"), "--config", str(config)], home)
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        assert "kvfabric is up: 2 Ray nodes" in up.stdout
        state = json.loads((home / "local-cluster.json").read_text())
        assert state["address"].startswith("127.0.0.1:")
        for args in (["stats", "--json"], ["stats", "--json", "--config", str(config)]):
            stats = run(args, home)
            assert stats.returncode == 0, stats.stderr[-3000:]
            report = json.loads(stats.stdout.strip().splitlines()[-1])
            assert len(report["nodes"]) == 2 and all("error" not in n for n in report["nodes"])
            assert all(n["address"].startswith("127.0.0.1:") for n in report["nodes"])
            assert [s["shard"] for s in report["directory"]] == [0, 1]
            assert all(n["store"][tier]["held_blocks"] == 0 for n in report["nodes"] for tier in ("ram", "ssd"))
        table = run(["stats"], home)
        assert table.returncode == 0, table.stderr[-3000:]
        assert "RAM blocks" in table.stdout and "refused puts" in table.stdout
        again = run(["up", "--nodes", "2"], home)
        assert again.returncode == 2 and "already up" in again.stderr and "Traceback" not in again.stderr
    finally:
        down = run(["down"], home)
    assert down.returncode == 0, down.stderr[-3000:]
    assert not (home / "local-cluster.json").exists()
    assert not any(_alive(pid) for pid in state["pids"])


def test_the_stats_table_shows_blocks_held_against_the_block_capacity() -> None:
    from cluster.cli_cluster import blocks_cell
    assert blocks_cell({"blocks": 36, "held_blocks": 12, "capacity_blocks": 0}) == "12"
    assert blocks_cell({"blocks": 36, "held_blocks": 12, "capacity_blocks": 1000}) == "12 / 1000"


def test_errors_a_user_can_fix_are_one_line(tmp_path: Path) -> None:
    down = run(["down"], tmp_path)
    assert down.returncode == 2 and "no local cluster" in down.stderr and "Traceback" not in down.stderr
    stats = run(["stats", "--address", "127.0.0.1:1"], tmp_path, timeout=120)
    assert stats.returncode == 2 and "Traceback" not in stats.stderr
    assert "no Ray cluster at '127.0.0.1:1'" in stats.stderr.strip().splitlines()[-1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
