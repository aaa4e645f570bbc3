"""Quarantine entries with real certificates: who may accuse, what a file keeps, which word wins."""

from __future__ import annotations

import json
from pathlib import Path

from testkit import Pki, PkiFactory

from cluster.node.quarantine import QUARANTINED, QuarantineBook, entry_problem, released_entry, signed_entry
from transports.trust.identity import NodeSigner, TrustAnchor

EVIDENCE = {"namespace": "00" * 32, "block": "11" * 32, "layer": 2, "engine_digest": "aa" * 32,
            "signed_digest": "bb" * 32, "worst": 4.5}


def _signer(pki: Pki, name: str) -> NodeSigner:
    return NodeSigner(*pki.node(name))


def test_a_checkers_signed_entry_is_believed_and_anything_altered_or_untrusted_is_not(
        tmp_path: Path, pki: Pki, make_pki: PkiFactory) -> None:
    checker = _signer(pki, "node-checker")
    trust = TrustAnchor.from_files(pki.ca)
    entry = signed_entry(checker, "node-liar", 100.0, {**EVIDENCE, "checker": "node-checker"})
    assert entry["state"] == QUARANTINED and entry_problem(entry, trust) is None
    assert entry_problem({**entry, "producer": "node-honest"}, trust) == "bad signature"
    assert entry_problem({**entry, "evidence": {**EVIDENCE, "checker": "node-other"}}, trust) is not None
    outsider = signed_entry(_signer(make_pki(tmp_path / "other"), "node-checker"), "node-liar", 100.0,
                            {**EVIDENCE, "checker": "node-checker"})
    assert "not trusted" in str(entry_problem(outsider, trust))
    revoked = TrustAnchor.from_files(pki.ca, pki.revoke("node-checker"))
    assert "revoked" in str(entry_problem(entry, revoked))
    assert "malformed" in str(entry_problem({"producer": "", "state": QUARANTINED, "at": 1.0}, trust))


def test_the_book_keeps_the_latest_word_per_producer_across_a_restart(tmp_path: Path, pki: Pki) -> None:
    checker = _signer(pki, "node-checker")
    path = tmp_path / "index.quarantine.json"
    book = QuarantineBook(path)
    entry = signed_entry(checker, "node-liar", 100.0, {**EVIDENCE, "checker": "node-checker"})
    assert book.merge([entry]) == [entry] and book.quarantined() == {"node-liar"}
    assert book.merge([entry]) == []                                  # the same word again changes nothing
    again = QuarantineBook(path)                                      # a restarted node reads its file
    assert again.quarantined() == {"node-liar"} and again.entries["node-liar"]["evidence"]["block"] == "11" * 32
    assert again.merge([released_entry("node-liar", 50.0)]) == []     # older than the quarantine: ignored
    assert again.merge([released_entry("node-liar", 200.0)]) != []    # the operator's later release wins
    assert QuarantineBook(path).quarantined() == frozenset()
    assert QuarantineBook(path).merge([entry]) == []                  # a node that slept through it cannot undo it
    path.write_text("not json")
    assert QuarantineBook(path).quarantined() == frozenset()          # unreadable: logged, peers' entries merge
    assert json.loads(json.dumps(entry)) == entry                     # entries cross Ray and files as plain JSON
