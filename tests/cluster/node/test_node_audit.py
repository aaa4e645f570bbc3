"""A node's audit without Ray, over test_node_loader.py's pair: node A produced a prompt's blocks
and serves them over real TLS, node B holds the first two itself and audits the rest.

What B does with an engine's KV: compares it with what A signed (pulled and verified), quarantines
A on a mismatch with the evidence, and from then on refuses A's records in pulls (`quarantined`);
honest KV leaves A trusted; where the model is compared bitwise, a producer outvoted by two others
on enough blocks is quarantined too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
from test_node_loader import HASHES, NS, NUM_BLOCKS, NUM_LOCAL, TRUTH, Pair, _run, _signer, cert_dir

from cluster.node.audit import AuditRefusedError, NodeAuditor
from fabric.config import AuditConfig, Config
from transports.trust.identity import TrustAnchor

__all__ = ["cert_dir"]   # the pair's certificates (a module-scoped fixture of test_node_loader.py)


def _auditor(p: Pair, certs: Path, tmp_path: Path, audit: AuditConfig) -> NodeAuditor:
    trust = TrustAnchor.from_files(certs / "ca.pem")
    return NodeAuditor(dataclasses.replace(Config(), audit=audit), node_id="b" * 32, node_name="node-b",
                       ray_namespace="kvfabric", signer=_signer(certs, "node-b"), trust=lambda: trust,
                       loader=p.loader, local=p.b_local, store=p.b_local.local_store, metrics=p.loader.metrics,
                       book_path=str(tmp_path / "b.quarantine.json"),
                       spawn=lambda coro: p.tasks.append(asyncio.get_running_loop().create_task(coro)))


async def _sampled(p: Pair) -> None:
    """An engine's load that the node samples (rate 1): nothing is pulled, a ticket is left for its audit."""
    reply = await p.loader.load(NS, HASHES, True, deadline_s=math.inf, sample=True)
    assert reply.audit_blocks == NUM_BLOCKS and reply.num_blocks == NUM_LOCAL and reply.pulled_bytes == 0


def test_kv_that_differs_from_the_signed_kv_quarantines_its_producer_and_its_records_are_refused(
        cert_dir: Path, tmp_path: Path) -> None:
    async def body(p: Pair) -> None:
        auditor = _auditor(p, cert_dir, tmp_path, AuditConfig(rate=1.0, bitwise_models=[NS.model_id]))
        with pytest.raises(AuditRefusedError, match="sampled"):   # nobody picks whom to accuse
            await auditor.audit(NS, HASHES, np.zeros_like(TRUTH))
        await _sampled(p)
        honest = await auditor.audit(NS, HASHES, TRUTH.copy())
        assert (honest.num_checked, honest.num_mismatched, honest.producers) == (NUM_BLOCKS - NUM_LOCAL, 0, ("node-a",))
        assert auditor.book.quarantined() == frozenset()
        wrong = TRUTH.copy()
        wrong[NUM_LOCAL + 1, 2, 7] ^= 0x40                  # one bit of one block B pulls from A
        await _sampled(p)
        report = await auditor.audit(NS, HASHES, wrong)
        assert report.num_mismatched == 1 and report.quarantined == ("node-a",)
        evidence = auditor.book.entries["node-a"]["evidence"]
        assert evidence["block"] == bytes(HASHES[NUM_LOCAL + 1]).hex() and evidence["layer"] == 2
        assert evidence["checker"] == "node-b" and evidence["engine_digest"] != evidence["signed_digest"]
        reply = await p.loader.load(NS, HASHES, True, deadline_s=math.inf)
        assert reply.num_blocks == NUM_LOCAL                 # A's blocks: refused, B's own: served
        assert b'kvfabric_provenance_rejections_total{reason="quarantined"}' in _metrics(p)
        again = _auditor(p, cert_dir, tmp_path, AuditConfig())   # a restart reads the file
        assert again.book.quarantined() == {"node-a"} and p.loader.quarantined == {"node-a"}
    _run(cert_dir, tmp_path, body)


def test_float_noise_within_the_tolerance_is_checked_and_not_a_lie(cert_dir: Path, tmp_path: Path) -> None:
    async def body(p: Pair) -> None:
        auditor = _auditor(p, cert_dir, tmp_path, AuditConfig(rate=1.0, atol=1e-3, rtol=1e-2))
        await _sampled(p)
        values = TRUTH.view(np.float16).astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):   # random bytes: NaNs, infinities, f16 maxima (kept)
            noisy = np.where(np.abs(values) < 6e4, values * (1 + 2e-3), values).astype(np.float16).view(np.uint8)
        assert not np.array_equal(noisy[NUM_LOCAL:], TRUTH[NUM_LOCAL:])   # a couple of f16 steps apart
        report = await auditor.audit(NS, HASHES, noisy.reshape(TRUTH.shape))
        assert report.num_checked == NUM_BLOCKS - NUM_LOCAL and report.num_mismatched == 0
        assert auditor.book.quarantined() == frozenset()
    _run(cert_dir, tmp_path, body)


def test_a_producer_outvoted_on_enough_blocks_of_a_bitwise_model_is_quarantined(cert_dir: Path,
                                                                                 tmp_path: Path) -> None:
    async def body(p: Pair) -> None:
        honest, liar = b"\1" * 8 + b"node-c", b"\2" * 8 + b"node-a"
        off = _auditor(p, cert_dir, tmp_path / "off", AuditConfig(outvoted_blocks=2))   # not a bitwise model
        for h in HASHES[:3]:
            off.outvoted(NS, h, honest, liar)
        auditor = _auditor(p, cert_dir, tmp_path, AuditConfig(outvoted_blocks=2, bitwise_models=[NS.model_id]))
        auditor.outvoted(NS, HASHES[0], honest, liar)
        auditor.outvoted(NS, HASHES[0], honest, liar)       # the same block twice counts once
        await asyncio.gather(*p.tasks)
        assert auditor.book.quarantined() == frozenset()
        auditor.outvoted(NS, HASHES[1], honest, liar)
        await asyncio.gather(*p.tasks)
        assert auditor.book.quarantined() == {"node-a"}
        assert auditor.book.entries["node-a"]["evidence"]["outvoted_by"] == "node-c"
        assert off.book.quarantined() == frozenset()
    _run(cert_dir, tmp_path, body)


def _metrics(p: Pair) -> bytes:
    from prometheus_client import generate_latest

    return generate_latest(p.registry)
