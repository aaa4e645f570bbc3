"""`vllm_cluster`: one 3-node cluster with two vLLM engines (vllm_setup.py) for every test of this folder.

It starts with the first test that asks for it and stops after the last test of this folder, before
any other module starts a Ray cluster of its own (a process holds one Ray connection at a time). A
test that removes one of its nodes leaves it broken; the next test that asks gets a fresh one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_setup import Setup, vllm_cluster

_HERE = Path(__file__).resolve().parent


class _Shared:
    def __init__(self) -> None:
        self.stack: contextlib.ExitStack | None = None
        self.setup: Setup | None = None

    def get(self, root: Path) -> Setup:
        if self.setup is not None and not self.setup.whole():
            self.close()
        if self.setup is None:
            self.stack = contextlib.ExitStack()
            self.setup = self.stack.enter_context(vllm_cluster(root))
        return self.setup

    def close(self) -> None:
        stack, self.stack, self.setup = self.stack, None, None
        if stack is not None:
            stack.close()


_shared = _Shared()


@pytest.fixture(name="vllm_cluster")
def _vllm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    yield _shared.get(tmp_path_factory.mktemp("vllm-cluster"))


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if nextitem is None or _HERE not in Path(str(nextitem.fspath)).resolve().parents:
        _shared.close()
