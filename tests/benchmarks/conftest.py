"""Fixtures shared by the benchmark smoke tests."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

import pytest


def _bed_leftovers(prefix: str) -> set[str]:
    names = set()
    for cmd in (["ip", "netns", "list"], ["ip", "-o", "link", "show"]):
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            # `ip netns list`: "NAME (id: N)"; `ip -o link show`: "N: NAME[@PEER]: <FLAGS> ..."
            name = line.split()[0] if cmd[1] == "netns" else line.split(":")[1].strip().split("@")[0]
            if name.startswith(prefix):
                names.add(name)
    return names


@pytest.fixture
def bed_leftovers() -> Callable[[str], set[str]]:
    """A function naming the namespaces and links on the machine whose names start with a bed's
    prefix (`kvb` + 4 hex digits, which a benchmark's JSON reports): what its teardown left behind.
    Only that bed's names count, so beds that other runs make meanwhile do not."""
    return _bed_leftovers
