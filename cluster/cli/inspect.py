"""`kvfabric inspect`: what a node's tiered store holds, read from its index and SSD folder.

    kvfabric inspect --config kvfabric.toml            # paths from [kv].index_dir / [kv].ssd_dir
    kvfabric inspect --index DIR --ssd DIR [--json]
    kvfabric inspect --config kvfabric.toml --verify   # re-read every SSD block, remove corrupt ones

Without --verify nothing is modified: the index is opened read-only (so this also works beside a
running store) and disagreements between rows and files are reported, not repaired. --verify
opens the store itself (which needs the store stopped), which repairs them as every open does,
re-reads and digest-checks every block with a progress bar on stderr, removes the corrupt ones
and exits 1 if it found any. The tier column is the tier each block was in when the store last
recorded it (RAM residency does not survive a restart; every block here is on SSD).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from cluster.cli.main import CLIError
from fabric.config import Config, ConfigError, KVConfig
from fabric.index import BlockMeta, Index, IndexUnavailableError
from fabric.store import Store, VerifyReport
from fabric.tiers.ssd_format import HEADER_SIZE, scan_folder


def register(sub: Any) -> None:
    p = sub.add_parser("inspect", help="blocks and bytes per tier and model; --verify re-reads every SSD block",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="TOML config file ([kv].index_dir and [kv].ssd_dir)")
    p.add_argument("--index", help="index folder (overrides the config)")
    p.add_argument("--ssd", help="SSD tier folder (overrides the config)")
    p.add_argument("--verify", action="store_true",
                   help="re-read and digest-check every SSD block; remove corrupt ones (store must be stopped)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=run)


@dataclass(slots=True)
class _Group:
    blocks: int = 0
    bytes: int = 0
    oldest: float = float("inf")
    newest: float = float("-inf")

    def add(self, meta: BlockMeta) -> None:
        self.blocks += 1
        self.bytes += meta.num_bytes
        self.oldest = min(self.oldest, meta.created_unix)
        self.newest = max(self.newest, meta.created_unix)


@dataclass(slots=True)
class Summary:
    groups: dict[tuple[str, str], _Group] = field(default_factory=dict)
    disk: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        tiers: dict[str, dict[str, int]] = {}
        for (tier, _), g in self.groups.items():
            t = tiers.setdefault(tier, {"blocks": 0, "bytes": 0})
            t["blocks"] += g.blocks
            t["bytes"] += g.bytes
        everything = list(self.groups.values())
        return {
            "tiers": tiers,
            "models": [{"tier": tier, "model": model, "blocks": g.blocks, "bytes": g.bytes,
                        "oldest_created_unix": g.oldest, "newest_created_unix": g.newest}
                       for (tier, model), g in sorted(self.groups.items())],
            "oldest_created_unix": min((g.oldest for g in everything), default=None),
            "newest_created_unix": max((g.newest for g in everything), default=None),
            "disk": self.disk,
        }


def run(args: argparse.Namespace) -> int:
    kv = _paths(args)
    verify: tuple[VerifyReport, dict[str, int]] | None = None
    if args.verify:
        verify = _verify(kv, quiet=args.json)
    summary = summarize(Path(kv.index_dir), Path(kv.ssd_dir))
    if args.json:
        out = {"index": kv.index_dir, "ssd": kv.ssd_dir, **summary.to_json()}
        if verify is not None:
            report, reconciled = verify
            out["verify"] = {"checked": report.num_checked, "reconciled": reconciled,
                             "corrupt": [{"key": k.hex(), "reason": r} for k, r in report.corrupt]}
        print(json.dumps(out, indent=2))
    else:
        _print(summary, kv, verify)
    return 1 if verify is not None and verify[0].corrupt else 0


def summarize(index_dir: Path, ssd_dir: Path) -> Summary:
    """Group the index rows by (tier, model) and compare them with the files, changing nothing."""
    try:
        index = Index(index_dir, read_only=True)
    except IndexUnavailableError as e:
        raise CLIError(str(e)) from None
    summary = Summary()
    names: dict[tuple[str, int], int] = {}
    bad_rows = 0
    with index:
        for key, meta in index.rows():
            if meta is None:
                bad_rows += 1
                continue
            summary.groups.setdefault((meta.tier.value, meta.model or "-"), _Group()).add(meta)
            names[(key.hex()[:16], meta.layer)] = HEADER_SIZE + meta.num_bytes
    scan = scan_folder(ssd_dir) if ssd_dir.is_dir() else None
    files = scan.files if scan is not None else {}
    summary.disk = {
        "files": len(files),
        "bytes": sum(f.size for f in files.values()),
        "temp_files": len(scan.temp_files) if scan is not None else 0,
        "files_without_row": sum(1 for n in files if n not in names),
        "rows_without_file": sum(1 for n in names if n not in files),
        "size_mismatch": sum(1 for n, f in files.items() if n in names and names[n] != f.size),
        "bad_rows": bad_rows,
    }
    return summary


def _paths(args: argparse.Namespace) -> KVConfig:
    kv = KVConfig()
    if args.config:
        try:
            kv = Config.load(args.config).kv
        except ConfigError as e:
            raise CLIError(str(e)) from None
    elif not (args.index and args.ssd):
        raise CLIError("give --config FILE, or both --index DIR and --ssd DIR")
    if args.index:
        kv.index_dir = args.index
    if args.ssd:
        kv.ssd_dir = args.ssd
    if not Path(kv.index_dir).is_dir():
        raise CLIError(f"no index at {kv.index_dir}")
    return kv


def _verify(kv: KVConfig, quiet: bool) -> tuple[VerifyReport, dict[str, int]]:
    try:
        store = Store.open(kv, background=False)
    except IndexUnavailableError as e:
        raise CLIError(f"{e} (is a store running on it? --verify needs it stopped)") from None
    with store, tqdm(total=store.stats()["ssd"]["blocks"], desc="verify", unit="block", file=sys.stderr,
                     disable=quiet and not sys.stderr.isatty()) as bar:
        report = store.verify(progress=bar.update)
        return report, dict(store.reconciled)


def _when(unix: float) -> str:
    return dt.datetime.fromtimestamp(unix, dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


def _print(summary: Summary, kv: KVConfig, verify: tuple[VerifyReport, dict[str, int]] | None) -> None:
    # Piped output gets room for long model names instead of rich's 80-column default.
    console = Console() if sys.stdout.isatty() else Console(width=160)
    table = Table(title=f"kvfabric store: index {kv.index_dir}, SSD {kv.ssd_dir}")
    # Every indexed block is on SSD; the tier column says where the store last saw it served from
    # ("ram": also cached in RAM then; RAM does not survive a restart).
    for column in ("last tier", "model", "blocks", "bytes", "oldest", "newest"):
        table.add_column(column, justify="right" if column in ("blocks", "bytes") else "left")
    for (tier, model), g in sorted(summary.groups.items()):
        table.add_row(tier, model, f"{g.blocks:,}", _size(g.bytes), _when(g.oldest), _when(g.newest))
    total = summary.to_json()
    if summary.groups:
        table.add_row("all", "", f"{sum(g.blocks for g in summary.groups.values()):,}",
                      _size(sum(g.bytes for g in summary.groups.values())),
                      _when(total["oldest_created_unix"]), _when(total["newest_created_unix"]), style="bold")
    console.print(table)
    console.print("every indexed block is on SSD; 'last tier' = ram: it was also cached in RAM when last recorded")
    d = summary.disk
    console.print(f"SSD folder: {d['files']:,} block files, {_size(d['bytes'])}; "
                  f"{d['temp_files']} temp files, {d['files_without_row']} files without a row, "
                  f"{d['rows_without_file']} rows without a file, {d['size_mismatch']} size mismatches, "
                  f"{d['bad_rows']} bad rows" + (" (repaired at the next open)" if any(
                      d[k] for k in d if k not in ("files", "bytes")) else ""))
    if verify is not None:
        report, reconciled = verify
        repaired = ", ".join(f"{n} {a}" for a, n in reconciled.items() if n) or "nothing"
        console.print(f"verify: {report.num_checked:,} blocks re-read, {len(report.corrupt)} corrupt "
                      f"(removed); repaired on open: {repaired}")
        for key, reason in report.corrupt:
            console.print(f"  corrupt {key.hex()[:16]}: {reason}")
