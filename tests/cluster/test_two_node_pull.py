"""The cross-node read path end to end (without Ray): node B reuses node A's prefix over mTLS."""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.two_node_pull import run


@pytest.mark.parametrize("kind", ["tls-tcp", "quic"])
def test_node_b_reuses_node_a_prefix(kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(kind, tmp_path, system_tokens=64) == 0
    out = capsys.readouterr().out
    assert "OK: node B reused 64 tokens pulled from node A" in out
    # The pulled blocks were mirrored into node B's SSD tier: real files, one per (block, layer).
    assert len(list((tmp_path / "node-b" / "ssd").rglob("*.kvb"))) >= 4 * 4
