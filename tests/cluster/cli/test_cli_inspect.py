"""`kvfabric inspect` against a store we filled: summaries, --verify after corrupting a file, errors."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import blake3
import pytest

from cluster.cli import inspect as cli_inspect
from cluster.cli.main import CLIError
from fabric.config import KVConfig
from fabric.keys import BlockAddress, BlockHash
from fabric.store import Store

REPO = Path(__file__).resolve().parents[3]


def addr(i: int, layer: int = 0) -> BlockAddress:
    return BlockAddress(BlockHash(blake3.blake3(b"inspect-%d" % i).digest()), layer)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvfabric")
    cli_inspect.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


@pytest.fixture
def filled(tmp_path: Path) -> tuple[Path, KVConfig]:
    kv = KVConfig(ssd_dir=str(tmp_path / "ssd"), index_dir=str(tmp_path / "index"), write_through=True)
    with Store.open(kv, background=False, clock=lambda: 1_700_000_000.0) as store:
        for i in range(6):
            store.put(addr(i), os.urandom(10_000), model="llama")
    with Store.open(kv, background=False, clock=lambda: 1_700_000_500.0) as store:
        for i in range(3):
            store.put(addr(100 + i), os.urandom(20_000), model="qwen")
    config = tmp_path / "kvfabric.toml"
    config.write_text(f'[kv]\nssd_dir = "{kv.ssd_dir}"\nindex_dir = "{kv.index_dir}"\n')
    return config, kv


def test_summary_per_tier_and_model(filled: tuple[Path, KVConfig], capsys: pytest.CaptureFixture[str]) -> None:
    config, _ = filled
    args = parse(["inspect", "--config", str(config), "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tiers"] == {"ssd": {"blocks": 9, "bytes": 6 * 10_000 + 3 * 20_000}}
    models = {m["model"]: m for m in out["models"]}
    assert models["llama"]["blocks"] == 6 and models["qwen"]["bytes"] == 60_000
    assert out["oldest_created_unix"] == 1_700_000_000.0 and out["newest_created_unix"] == 1_700_000_500.0
    assert out["disk"]["files"] == 9 and out["disk"]["files_without_row"] == 0


def test_table_output_names_models_and_dates(filled: tuple[Path, KVConfig],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    _, kv = filled
    args = parse(["inspect", "--index", kv.index_dir, "--ssd", kv.ssd_dir])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "llama" in out and "qwen" in out and "2023-11-14" in out
    assert "9 block files" in out


def test_plain_inspect_reports_disagreements_without_repairing(filled: tuple[Path, KVConfig],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    _, kv = filled
    key = addr(0).storage_key
    stray = Path(kv.ssd_dir) / f"{key[0]:02x}" / f".{key.hex()[:16]}-0.1.2.tmp"
    stray.write_bytes(b"torn")
    args = parse(["inspect", "--index", kv.index_dir, "--ssd", kv.ssd_dir, "--json"])
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["disk"]["temp_files"] == 1
    assert stray.exists()


def test_verify_finds_reports_and_removes_a_corrupt_block(filled: tuple[Path, KVConfig],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    config, kv = filled
    key = addr(2).storage_key
    path = Path(kv.ssd_dir) / f"{key[0]:02x}" / f"{key.hex()[:16]}-0.kvb"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(raw)

    args = parse(["inspect", "--config", str(config), "--verify", "--json"])
    assert args.func(args) == 1                      # corrupt blocks found: non-zero exit
    out = json.loads(capsys.readouterr().out)
    assert out["verify"]["checked"] == 9
    assert out["verify"]["corrupt"] == [{"key": key.hex(), "reason": "payload digest mismatch"}]
    assert out["tiers"]["ssd"]["blocks"] == 8 and not path.exists()

    args = parse(["inspect", "--config", str(config), "--verify", "--json"])
    assert args.func(args) == 0                      # clean now
    assert json.loads(capsys.readouterr().out)["verify"]["corrupt"] == []


def test_verify_refuses_while_a_store_holds_the_index(filled: tuple[Path, KVConfig]) -> None:
    config, kv = filled
    with Store.open(kv, background=False):
        args = parse(["inspect", "--config", str(config), "--verify"])
        with pytest.raises(CLIError, match="needs it stopped"):
            args.func(args)


def test_user_errors_are_cli_errors(tmp_path: Path) -> None:
    with pytest.raises(CLIError, match="--config FILE, or both"):
        args = parse(["inspect", "--index", str(tmp_path)])
        args.func(args)
    with pytest.raises(CLIError, match="no index"):
        args = parse(["inspect", "--index", str(tmp_path / "none"), "--ssd", str(tmp_path)])
        args.func(args)
    bad = tmp_path / "bad.toml"
    bad.write_text("[kv]\nram_gibs = 1\n")
    with pytest.raises(CLIError, match="unknown key"):
        args = parse(["inspect", "--config", str(bad)])
        args.func(args)


def test_the_real_command_line(filled: tuple[Path, KVConfig]) -> None:
    config, _ = filled
    done = subprocess.run([sys.executable, "-m", "cluster.cli.main", "inspect", "--config", str(config), "--json"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tiers"]["ssd"]["blocks"] == 9
