"""Helpers shared by the benchmarks: timing statistics, table printing, the JSON last line."""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank; samples need not be sorted."""
    ordered = sorted(samples)
    if not ordered:
        raise ValueError("no samples")
    rank = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[rank]


def median(samples: Sequence[float]) -> float:
    return statistics.median(samples)


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right" if c != columns[0] else "left")
    for r in rows:
        table.add_row(*(f"{v:.3f}" if isinstance(v, float) else str(v) for v in r))
    Console(file=sys.stdout, width=140).print(table)


def emit_json(result: dict[str, object]) -> None:
    """The benchmark's machine-readable result: always the very last line of stdout."""
    sys.stdout.flush()
    print(json.dumps(result, sort_keys=True), flush=True)


def write_results(result: dict[str, object], path: Path) -> None:
    """The JSON a default run keeps under benchmarks/results/, readable and stable to diff."""
    path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
