"""`kvfabric purge --producer NODE` as a user runs it: a separate process, a real local Ray cluster."""

from __future__ import annotations

import json
from pathlib import Path

from test_cli_cluster import run


def test_purge_answers_per_node_and_bad_input_is_one_line(tmp_path: Path) -> None:
    home = tmp_path / "home"
    blank = run(["purge", "--producer", " "], home)
    assert blank.returncode == 2 and "--producer needs a node name" in blank.stderr
    assert "Traceback" not in blank.stderr
    up = run(["up", "--nodes", "2", "--root", str(tmp_path / "fabric")], home)
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        purge = run(["purge", "--producer", "node-gone", "--json"], home)
        assert purge.returncode == 0, purge.stderr[-3000:]
        report = json.loads(purge.stdout.strip().splitlines()[-1])
        assert report["producer"] == "node-gone"
        assert len(report["removed"]) == 2 and set(report["removed"].values()) == {0}
    finally:
        down = run(["down"], home)
    assert down.returncode == 0, down.stderr[-3000:]
