"""What every benchmark shares: the blocks a server serves, certificates and credentials, memory
readings, timing statistics, the table a run prints and the JSON object that is its last line.

- `MemorySource`: a dict-backed block source (what a transport server serves from) holding
  payloads with their BLAKE3 digests, and optionally their producers' records.
- `ensure_certs` / `credentials`: a cluster CA and node certificates in a folder, made when missing
  (transports/trust/certs.py, as `kvfabric certs` does), and a node's credentials from it.
- `rss_mib` / `rss_bytes`: resident memory of a process (Linux /proc).
- `percentile`, `median`, `print_table`, `emit_json`, `write_results`: the report.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import blake3
from rich.console import Console
from rich.table import Table

from fabric.keys import BlockAddress
from fabric.provenance import Provenance
from transports.trust.certs import CA_CERT, CredentialFiles, NodeCredentials, init_ca, issue_node

# -- blocks served ------------------------------------------------------------------------------------


class StoredBlock:
    """A served payload, its BLAKE3 digest (computed when not given) and its producer's record, if any."""

    __slots__ = ("digest", "payload", "provenance")

    def __init__(self, payload: bytes, digest: bytes | None = None, provenance: Provenance | None = None) -> None:
        self.payload = payload
        self.digest = blake3.blake3(payload).digest() if digest is None else digest
        self.provenance = provenance


class MemorySource:
    """A real block source for a transport server: a dict from address to `StoredBlock`."""

    def __init__(self, payloads: Mapping[BlockAddress, bytes] | Iterable[tuple[BlockAddress, bytes]] = ()) -> None:
        items = payloads.items() if isinstance(payloads, Mapping) else payloads
        self.blocks: dict[BlockAddress, StoredBlock] = {a: StoredBlock(p) for a, p in items}

    def put(self, address: BlockAddress, payload: bytes, digest: bytes | None = None,
            provenance: Provenance | None = None) -> None:
        self.blocks[address] = StoredBlock(payload, digest, provenance)

    def get_block(self, address: BlockAddress) -> StoredBlock | None:
        return self.blocks.get(address)


# -- certificates -------------------------------------------------------------------------------------


def ensure_certs(cert_dir: str | os.PathLike[str], nodes: Iterable[str], days: int = 30) -> Path:
    """A cluster CA in `cert_dir` and a certificate for each of `nodes`, each made only when missing."""
    d = Path(cert_dir)
    if not (d / CA_CERT).exists():
        init_ca(d)
    for node in nodes:
        if not (d / f"{node}.pem").exists():
            issue_node(d, node, days=days)
    return d


def credentials(cert_dir: str | os.PathLike[str], node: str) -> NodeCredentials:
    return NodeCredentials(CredentialFiles.for_node(cert_dir, node))


# -- memory -------------------------------------------------------------------------------------------


def rss_mib(pid: int | None = None) -> float | None:
    """Resident memory of process `pid` (default: this one) in MiB; None once it is gone."""
    try:
        for line in Path(f"/proc/{pid or 'self'}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def rss_bytes() -> int:
    """Resident memory of this process in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# -- the report ---------------------------------------------------------------------------------------


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
