"""Quarantined producers: who was caught signing wrong KV, with the evidence, kept by every node.

A node whose sampled recompute finds a producer's signed KV wrong (fabric/audit.py) writes an entry

    producer, state "quarantined", at (seconds since the epoch), evidence: namespace root, block
    hash, layer, both digests (the engine's block and the producer's signed one), how far apart,
    and the checker's node name

signs it with its own node key and sends it to every NodeActor. Each node verifies the checker's
signature against the cluster CA (a revoked or unknown checker's word counts for nothing), keeps
the entry in a JSON file beside its index (`<index dir>.quarantine.json`, written atomically),
purges the producer's blocks and refuses its records from then on. An operator's release is an
entry with state "released" and a later `at`, made by each node on the operator's call.

Nodes are the source of truth; the directory holds none of it, so a directory restart changes
nothing. A restarted node reads its file before it serves, then merges every peer's entries, so
one that was down during a quarantine or a release catches up. Entries merge by `at` (the latest
word about a producer wins), so a release is not undone by a node that slept through it.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from transports.trust.identity import IdentityError, NodeSigner, TrustAnchor

logger = logging.getLogger(__name__)

QUARANTINED = "quarantined"
RELEASED = "released"
_DOMAIN = b"kvfabric-quarantine-v1\0"
_EVIDENCE_KEYS = ("namespace", "block", "layer", "engine_digest", "signed_digest", "worst", "checker")


def notice_message(entry: Mapping[str, Any]) -> bytes:
    """The bytes a checker signs: the entry's producer, time and evidence, canonical JSON."""
    body = {"producer": entry["producer"], "at": entry["at"], "evidence": entry["evidence"]}
    return _DOMAIN + json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def signed_entry(signer: NodeSigner, producer: str, at: float, evidence: Mapping[str, Any]) -> dict[str, Any]:
    """A quarantine entry signed by this node (the checker named in `evidence`)."""
    missing = [k for k in _EVIDENCE_KEYS if k not in evidence]
    if missing:
        raise ValueError(f"quarantine evidence lacks {missing}")
    entry: dict[str, Any] = {"producer": producer, "state": QUARANTINED, "at": float(at), "evidence": dict(evidence)}
    entry["signature"] = signer.sign(notice_message(entry)).hex()
    entry["cert"] = signer.cert_der.hex()
    return entry


def released_entry(producer: str, at: float) -> dict[str, Any]:
    return {"producer": producer, "state": RELEASED, "at": float(at)}


def entry_problem(entry: Mapping[str, Any], trust: TrustAnchor) -> str | None:
    """Why a peer's entry is not believed (None: it is)."""
    try:
        producer, state, at = entry["producer"], entry["state"], entry["at"]
        if not isinstance(producer, str) or not producer or not isinstance(at, int | float):
            return "malformed entry"
        if state == RELEASED:
            return None   # a release is the word of a node that the operator called (see the module doc)
        if state != QUARANTINED:
            return f"unknown state {state!r}"
        ident = trust.identity(bytes.fromhex(entry["cert"]))
        if ident.node != entry["evidence"]["checker"]:
            return f"signed by {ident.node}, names {entry['evidence']['checker']} as checker"
        if not ident.verify(bytes.fromhex(entry["signature"]), notice_message(entry)):
            return "bad signature"
    except IdentityError as e:   # a certificate the anchor refuses (revoked, expired, another CA)
        return f"checker not trusted: {e}"
    except (KeyError, TypeError, ValueError) as e:
        return f"unreadable entry: {e!r}"
    return None


class QuarantineBook:
    """The entries one node knows, persisted in `path`. Not thread-safe: the node's event loop owns it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.entries: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            try:
                loaded = json.loads(self.path.read_text())
                self.entries = {e["producer"]: e for e in loaded["entries"]}
            except (OSError, ValueError, KeyError, TypeError) as e:
                # Fail closed would refuse nothing we could name; say so loudly, keep the file for the operator.
                logger.error("quarantine file %s unreadable (%s); peers' entries will be merged", self.path, e)

    def quarantined(self) -> frozenset[str]:
        return frozenset(p for p, e in self.entries.items() if e["state"] == QUARANTINED)

    def merge(self, entries: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Keep each entry newer than what is known of its producer; returns those kept (then saved)."""
        kept: list[dict[str, Any]] = []
        for entry in entries:
            known = self.entries.get(entry["producer"])
            if known is None or float(entry["at"]) > float(known["at"]):
                self.entries[entry["producer"]] = dict(entry)
                kept.append(dict(entry))
        if kept:
            self._save()
        return kept

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(prefix=f".{self.path.name}-", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"entries": sorted(self.entries.values(), key=lambda e: e["producer"])}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, self.path)
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise
