"""`kvfabric up / stats / down` as a user runs them: separate processes, a real local Ray cluster
(on 127.0.0.1, or with `--netns` one Ray node per network namespace of a test bed)."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.netbed.bed import missing_capability

ROOT = Path(__file__).resolve().parents[3]
KVFABRIC = [str(Path(sys.executable).parent / "kvfabric")]  # the installed entry point
_missing = missing_capability()


def run(args: list[str], home: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """The CLI in a process of its own; Ray's default temp directory (where `kvfabric up` notes its address
    for `ray.init(address="auto")`) is under `home`, not the machine's /tmp/ray."""
    env = {**os.environ, "KVFABRIC_HOME": str(home), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "RAY_TMPDIR": str(home / "ray-tmp")}
    return subprocess.run(KVFABRIC + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


def test_up_stats_down_round_trip(tmp_path: Path) -> None:
    home = tmp_path / "home"
    config = tmp_path / "team.toml"   # not the default namespace, directory name or shard count
    config.write_text('[cluster]\nnamespace = "team-a"\ndirectory_name = "team-a-dir"\ndirectory_shards = 2\n')
    up = run(["up", "--nodes", "2", "--root", str(tmp_path / "fabric"), "--config", str(config)], home)
    noted = home / "ray-tmp" / "ray" / "ray_current_cluster"   # where `ray.init(address="auto")` looks first
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        assert "kvfabric is up: 2 Ray nodes" in up.stdout
        state = json.loads((home / "local-cluster.json").read_text())
        assert state["address"].startswith("127.0.0.1:")
        assert noted.read_text() == state["address"]
        for args in (["stats", "--json"], ["stats", "--json", "--config", str(config)],
                     ["stats", "--json", "--config", str(config), "--address", "auto"]):   # as ray.init("auto")
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
    assert not noted.exists()
    assert not any(_alive(pid) for pid in state["pids"])
    assert not Path(state["ray_dir"]).exists(), "Ray's session files and sockets outlived `kvfabric down`"


def test_the_stats_table_shows_blocks_held_against_the_block_capacity() -> None:
    from cluster.cli.cluster import blocks_cell
    assert blocks_cell({"blocks": 36, "held_blocks": 12, "capacity_blocks": 0}) == "12"
    assert blocks_cell({"blocks": 36, "held_blocks": 12, "capacity_blocks": 1000}) == "12 / 1000"


def test_errors_a_user_can_fix_are_one_line(tmp_path: Path) -> None:
    down = run(["down"], tmp_path)
    assert down.returncode == 2 and "no local cluster" in down.stderr and "Traceback" not in down.stderr
    stats = run(["stats", "--address", "127.0.0.1:1"], tmp_path, timeout=120)
    assert stats.returncode == 2 and "Traceback" not in stats.stderr
    assert "no Ray cluster at '127.0.0.1:1'" in stats.stderr.strip().splitlines()[-1]



def _namespaces() -> set[str]:
    return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout.split())


def _links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=False).stdout


@pytest.mark.skipif(_missing is not None, reason=f"network test bed needs {_missing}")
def test_up_netns_puts_each_node_in_its_own_host_and_down_removes_the_bed(tmp_path: Path) -> None:
    home = tmp_path / "home"
    up = run(["up", "--nodes", "2", "--netns", "--link", "lan"], home)
    state = json.loads((home / "local-cluster.json").read_text()) if (home / "local-cluster.json").exists() else {}
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        bed = json.loads(Path(state["netbed"]).read_text())
        prefix = bed["prefix"]
        assert {f"{prefix}h0", f"{prefix}h1"} <= _namespaces()
        assert f"2 Ray nodes at {state['address']}" in up.stdout and "host 1 at" in up.stdout
        assert "delay not applied" in up.stdout
        # The README's next step: stats reaches the bed's cluster (its own Ray token, from inside a host).
        stats = run(["stats", "--json"], home)
        assert stats.returncode == 0, stats.stderr[-3000:]
        nodes = json.loads(stats.stdout.strip().splitlines()[-1])["nodes"]
        assert len(nodes) == 2 and all("error" not in n for n in nodes)
        hosts = {ipaddress.ip_address(n["address"].rsplit(":", 1)[0]) for n in nodes}
        assert len(hosts) == 2 and all(h in ipaddress.ip_network(bed["subnet"]) for h in hosts)
    finally:
        down = run(["down"], home)
    assert down.returncode == 0, down.stderr[-3000:]
    assert not any(name.startswith(prefix) for name in _namespaces())
    assert f"{prefix}br" not in _links() and f"{prefix}v0" not in _links()
    assert not any(_alive(pid) for pid in bed["pids"])
    assert not (home / "local-cluster.json").exists() and not Path(bed["root"]).exists()


def test_link_options_a_user_gets_wrong_are_one_line(tmp_path: Path) -> None:
    no_netns = run(["up", "--nodes", "2", "--link", "dc"], tmp_path)
    assert no_netns.returncode == 2 and "--link needs --netns" in no_netns.stderr
    bad = run(["up", "--nodes", "2", "--netns", "--link", "fast"], tmp_path)
    assert bad.returncode == 2 and "unknown link profile 'fast'" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "local-cluster.json").exists()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
