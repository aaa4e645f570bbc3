"""The puller over real TLS-TCP and real stores: only payloads their producer signed are accepted.

Nodes here are real Stores served by real TLS-TCP servers with certificates of one cluster CA;
the puller is `pull_prefix` as the NodeActor runs it, on a `LoadPlan` made as the NodeLoader makes
it. A liar holds a valid node certificate and serves its own bytes with digests that match them,
so every transport check passes: only provenance can tell its bytes from the producer's.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import blake3
import numpy as np
import pytest
from cryptography import x509
from testkit import PkiFactory

from cluster.api import payload_shape
from cluster.node.local import LocalFabric
from cluster.node.plan import new_plan
from cluster.node.pulls import PullOutcome, pull_prefix
from cluster.planner import plan_pulls
from fabric.config import KVConfig
from fabric.keys import BlockAddress, BlockHash, Namespace, block_hashes
from fabric.layout import KVLayout
from fabric.provenance import Provenance, Rejection, sign_block
from fabric.store import Store
from transports.core.base import Peer, PullResult
from transports.tls.client import TlsTcpClient
from transports.tls.server import TlsTcpServer
from transports.trust.certs import CredentialFiles, NodeCredentials, revoke
from transports.trust.identity import NodeSigner, TrustAnchor
from transports.trust.provenance_check import ProvenanceVerifier

LAYOUT = KVLayout.mha(3, 2, 32, "f16")
NS = Namespace("prov-model", LAYOUT, block_size=16, weights_fingerprint="prov")
TOKENS = list(range(16 * 6))
HASHES = block_hashes(NS, TOKENS)
NUM_BLOCKS = len(HASHES)
NODES = ("node-honest", "node-mirror", "node-puller", "node-revoked", *(f"liar-{i}" for i in range(8)))


@pytest.fixture(scope="module")
def cert_dir(tmp_path_factory: pytest.TempPathFactory, make_pki: PkiFactory) -> Path:
    pki = make_pki(tmp_path_factory.mktemp("certs"), *NODES)
    pki.node("node-acme", tenants=("acme",))
    return pki.dir


def _signer(cert_dir: Path, node: str) -> NodeSigner:
    return NodeSigner(cert_dir / f"{node}.pem", cert_dir / f"{node}.key")


def _creds(cert_dir: Path, node: str) -> NodeCredentials:
    return NodeCredentials(CredentialFiles.for_node(cert_dir, node))


@dataclasses.dataclass
class Node:
    name: str
    store: Store
    fabric: LocalFabric


@pytest.fixture
def open_node(tmp_path: Path) -> Iterator[object]:
    stores: list[Store] = []

    def open_(name: str) -> Node:
        kv = KVConfig(ram_gib=0.05, ssd_dir=str(tmp_path / name / "ssd"), index_dir=str(tmp_path / name / "index"),
                      ssd_gib=0.1, write_through=True, durable=False, o_direct=False)
        store = Store.open(kv, background=False)
        stores.append(store)
        return Node(name, store, LocalFabric(store, name))
    yield open_
    for store in stores:
        store.close()


def _random_payloads(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, payload_shape(NS, NUM_BLOCKS), dtype=np.uint8)


class _UnnamedPulls:
    """A puller's client whose PULLs name no namespace: to the puller, the servers then act as a liar's
    would that ignores the namespace it is asked under (an honest server serves only blocks whose
    record names it), so what is left to stop a liar is the puller's own provenance check."""

    def __init__(self, client: TlsTcpClient) -> None:
        self.client = client

    def pull(self, peer: Peer, addresses: Sequence[BlockAddress], *, into: memoryview | None = None,
             namespace: bytes = b"") -> AsyncIterator[PullResult]:
        return self.client.pull(peer, addresses, into=into)

    async def close(self) -> None:
        await self.client.close()


async def _pull(cert_dir: Path, nodes: list[Node], owners: list[list[str]], trust: TrustAnchor,
                layer_major: bool = True, *, name_namespace: bool = True, tenants: frozenset[str] | None = None
                ) -> tuple[np.ndarray, int, list[Provenance | None], PullOutcome]:
    """Pull every block from `owners` (per block, as the directory would name them) into a fresh buffer."""
    servers = {n.name: TlsTcpServer(_creds(cert_dir, n.name), n.store, "127.0.0.1", 0) for n in nodes}
    peers = {}
    for name, server in servers.items():
        host, port = await server.start()
        peers[name] = Peer(name, host, port)
    tls = TlsTcpClient(_creds(cert_dir, "node-puller"))
    client: TlsTcpClient | _UnnamedPulls = tls if name_namespace else _UnnamedPulls(tls)
    out = np.zeros(payload_shape(NS, NUM_BLOCKS), dtype=np.uint8)
    # the plan as the NodeLoader makes it: the directory's owners, and the runs plan_pulls makes of them
    plan = new_plan(HASHES, owners, plan_pulls(owners, 0, hashes=HASHES), peers, out, num_blocks=NUM_BLOCKS,
                    num_local=0, sources=[""] * NUM_BLOCKS, verifier=ProvenanceVerifier(trust), namespace=NS.root,
                    tenants=tenants, layer_major=layer_major)
    try:
        outcome = await pull_prefix(client, plan, timeout_s=10.0)
    finally:
        await client.close()
        for server in servers.values():
            await server.close()
    return out, plan.progress.complete_blocks(), plan.provenance, outcome


def _liar_first() -> str:
    """A liar's name that the planner puts before the honest node for this prefix."""
    for i in range(8):
        name = f"liar-{i}"
        if plan_pulls([[name, "node-honest"]] * NUM_BLOCKS, 0, hashes=HASHES)[0].node_id == name:
            return name
    raise AssertionError("no liar name wins the tie-break: is it still a function of the block?")


def _lie(liar: Node, honest: Node, cert_dir: Path, how: str) -> np.ndarray:
    """The liar stores its own bytes under the honest blocks' addresses, with correct digests."""
    fake = _random_payloads(99)
    if how == "unsigned":
        liar.fabric.write_blocks(NS, HASHES, fake)
    elif how == "copied_record":   # the honest producer's records beside the liar's bytes
        records = [honest.store.get_block(a).provenance for a in _first_layers()]
        liar.fabric.write_blocks(NS, HASHES, fake, provenance=records)
    else:   # signed with the liar's own key, naming the honest node as producer
        signer = _signer(cert_dir, liar.name)
        records = [sign_block(NS.root, h, [blake3.blake3(fake[b, layer]).digest()
                                           for layer in range(LAYOUT.num_layers)], "node-honest",
                              signer.cert_der, signer.sign) for b, h in enumerate(HASHES)]
        liar.fabric.write_blocks(NS, HASHES, fake, provenance=records)
    return fake


def _first_layers() -> list[BlockAddress]:
    return [BlockAddress(BlockHash(h), 0) for h in HASHES]


@pytest.mark.parametrize("layer_major", [True, False], ids=["layer_major", "into_slots"])
@pytest.mark.parametrize(("how", "reason"), [("unsigned", Rejection.UNSIGNED),
                                             ("copied_record", Rejection.WRONG_DIGEST),
                                             ("forged_producer", Rejection.PRODUCER_MISMATCH)])
def test_a_liar_with_a_valid_certificate_serves_no_byte(cert_dir: Path, open_node, how: str,
                                                       reason: Rejection, layer_major: bool) -> None:
    # block-major pulls receive runs of hits straight into the load's slots: a refused payload may
    # sit in its slot, but the slot never counts and is asked again from the next owner
    honest, liar = open_node("node-honest"), open_node(_liar_first())
    truth = _random_payloads(1)
    stored = honest.fabric.write_blocks(NS, HASHES, truth, signer=_signer(cert_dir, "node-honest"))
    assert stored.num_stored == NUM_BLOCKS
    fake = _lie(liar, honest, cert_dir, how)
    trust = TrustAnchor.from_files(cert_dir / "ca.pem")

    # the liar alone: nothing is accepted, every payload is a named rejection
    # (an unsigned block is not even served to a PULL that names its namespace: see _UnnamedPulls)
    unnamed = how == "unsigned"
    out, complete, provenance, outcome = asyncio.run(
        _pull(cert_dir, [liar], [[liar.name]] * NUM_BLOCKS, trust, layer_major, name_namespace=not unnamed))
    assert complete == 0
    assert outcome.rejections == {reason: NUM_BLOCKS * LAYOUT.num_layers}
    assert provenance == [None] * NUM_BLOCKS

    # the liar first, the honest producer next: every byte is the producer's, none the liar's
    out, complete, provenance, outcome = asyncio.run(
        _pull(cert_dir, [liar, honest], [[liar.name, "node-honest"]] * NUM_BLOCKS, trust, layer_major,
              name_namespace=not unnamed))
    assert complete == NUM_BLOCKS
    assert np.array_equal(out, truth) and not np.array_equal(out, fake)
    assert outcome.rejections.get(reason, 0) > 0 and outcome.num_fallbacks > 0
    assert all(p is not None and p.producer == "node-honest" for p in provenance)


def test_a_mirrored_block_still_verifies_on_a_third_node(cert_dir: Path, open_node) -> None:
    honest, mirror = open_node("node-honest"), open_node("node-mirror")
    truth = _random_payloads(2)
    honest.fabric.write_blocks(NS, HASHES, truth, signer=_signer(cert_dir, "node-honest"))
    trust = TrustAnchor.from_files(cert_dir / "ca.pem")
    out, complete, provenance, _ = asyncio.run(_pull(cert_dir, [honest], [["node-honest"]] * NUM_BLOCKS, trust))
    assert complete == NUM_BLOCKS
    # the mirror keeps the producer's records verbatim (what NodeActor._mirror does)
    digests = [[blake3.blake3(out[b, layer]).digest() for layer in range(LAYOUT.num_layers)]
               for b in range(NUM_BLOCKS)]
    assert mirror.fabric.write_blocks(NS, HASHES, out, digests=digests, provenance=provenance).num_stored == NUM_BLOCKS
    out, complete, provenance, outcome = asyncio.run(
        _pull(cert_dir, [mirror], [["node-mirror"]] * NUM_BLOCKS, trust))
    assert complete == NUM_BLOCKS and np.array_equal(out, truth) and not outcome.rejections
    assert {p.producer for p in provenance if p is not None} == {"node-honest"}


def test_a_revoked_producers_blocks_are_refused(cert_dir: Path, open_node, tmp_path: Path) -> None:
    producer = open_node("node-revoked")
    producer.fabric.write_blocks(NS, HASHES, _random_payloads(3), signer=_signer(cert_dir, "node-revoked"))
    cert = x509.load_pem_x509_certificate((cert_dir / "node-revoked.pem").read_bytes())
    crl_dir = tmp_path / "crl"
    crl_dir.mkdir()
    for name in ("ca.pem", "ca.key"):
        (crl_dir / name).write_bytes((cert_dir / name).read_bytes())
    revoke(crl_dir, {cert.serial_number})
    trust = TrustAnchor.from_files(crl_dir / "ca.pem")
    out, complete, _, outcome = asyncio.run(_pull(cert_dir, [producer], [["node-revoked"]] * NUM_BLOCKS, trust))
    assert complete == 0 and not out.any()
    assert outcome.rejections == {Rejection.REVOKED: NUM_BLOCKS * LAYOUT.num_layers}


def _interleave(liar: Node, honest: Node, cert_dir: Path) -> np.ndarray:
    """The liar, a producer in its own right, holds block 0 wholly its own (signed, wrong bytes) and
    every later block mixed: layer 0 the honest producer's (its bytes and record) and the other
    layers its own wrong bytes under its own valid record. Every layer verifies on its own."""
    fake = _random_payloads(98)
    signer = _signer(cert_dir, liar.name)
    items, digests, records = [], [], []
    for b, h in enumerate(HASHES):
        own = sign_block(NS.root, h, [blake3.blake3(fake[b, layer]).digest() for layer in range(LAYOUT.num_layers)],
                         liar.name, signer.cert_der, signer.sign)
        for layer in range(LAYOUT.num_layers):
            address = BlockAddress(BlockHash(h), layer)
            held = honest.store.get_block(address) if b > 0 and layer == 0 else None
            payload = bytes(held.payload) if held is not None else fake[b, layer].tobytes()
            items.append((address, memoryview(payload)))
            digests.append(blake3.blake3(payload).digest())
            records.append(held.provenance if held is not None else own)
    assert all(r.ok for r in liar.store.put_many(items, digests=digests, provenance=records))
    return fake


@pytest.mark.parametrize("layer_major", [True, False], ids=["layer_major", "into_slots"])
def test_a_mixed_block_is_never_mirrored_and_purge_and_revocation_leave_none_of_the_producers_layers(
        cert_dir: Path, open_node, tmp_path: Path, layer_major: bool) -> None:
    honest, liar = open_node("node-honest"), open_node(_liar_first())
    mirror, other_mirror = open_node("node-mirror"), open_node("node-mirror-2")
    truth = _random_payloads(4)
    honest.fabric.write_blocks(NS, HASHES, truth, signer=_signer(cert_dir, "node-honest"))
    fake = _interleave(liar, honest, cert_dir)
    trust = TrustAnchor.from_files(cert_dir / "ca.pem")

    # the interleaver alone: block 0 is its own (it is that block's producer); no mixed block is accepted
    _, complete, provenance, outcome = asyncio.run(
        _pull(cert_dir, [liar], [[liar.name]] * NUM_BLOCKS, trust, layer_major))
    assert complete == 1 and provenance[0] is not None and provenance[0].producer == liar.name
    assert outcome.rejections[Rejection.MIXED_RECORDS] >= NUM_BLOCKS - 1

    # the interleaver first, the honest producer next: each later block comes whole from one record
    out, complete, provenance, outcome = asyncio.run(
        _pull(cert_dir, [liar, honest], [[liar.name, "node-honest"]] * NUM_BLOCKS, trust, layer_major))
    assert complete == NUM_BLOCKS and outcome.rejections[Rejection.MIXED_RECORDS] > 0
    assert np.array_equal(out[0], fake[0]) and np.array_equal(out[1:], truth[1:])
    assert [p.producer if p is not None else None for p in provenance] == \
        [liar.name] + ["node-honest"] * (NUM_BLOCKS - 1)
    digests = [[blake3.blake3(out[b, layer]).digest() for layer in range(LAYOUT.num_layers)]
               for b in range(NUM_BLOCKS)]
    for node in (mirror, other_mirror):   # what the NodeActor mirrors: the producers' records, verbatim
        node.fabric.write_blocks(NS, HASHES, out, digests=digests, provenance=provenance)
        assert not node.store.held_addresses_where(lambda record: record is None)   # nothing unsigned

    # one mirror is purged of the interleaver's blocks; the other only reads the revocation
    assert mirror.store.purge_producer(liar.name) == LAYOUT.num_layers
    other_mirror.fabric.revoked = frozenset(
        {x509.load_pem_x509_certificate((cert_dir / f"{liar.name}.pem").read_bytes()).serial_number})
    for node in (mirror, other_mirror):
        served = np.zeros((LAYOUT.num_layers, out.shape[2]), dtype=np.uint8)
        liar_layers = 0
        for b, h in enumerate(HASHES):
            if node.fabric.read_blocks([h], served[np.newaxis]):
                liar_layers += sum(np.array_equal(served[layer], fake[b, layer]) for layer in range(LAYOUT.num_layers))
        assert liar_layers == 0
        assert node.fabric.read_blocks([HASHES[1]], served[np.newaxis]) and np.array_equal(served, truth[1])
        assert node.store.get_block(BlockAddress(BlockHash(HASHES[0]), 1)) is None   # gone, not only hidden


def test_a_producer_restricted_to_another_tenant_is_refused_for_this_namespace(cert_dir: Path, open_node) -> None:
    producer = open_node("node-acme")
    truth = _random_payloads(5)
    assert producer.fabric.write_blocks(NS, HASHES, truth, signer=_signer(cert_dir, "node-acme")).num_stored \
        == NUM_BLOCKS
    trust = TrustAnchor.from_files(cert_dir / "ca.pem")
    _, complete, _, outcome = asyncio.run(_pull(cert_dir, [producer], [["node-acme"]] * NUM_BLOCKS, trust,
                                                tenants=frozenset({"globex"})))
    assert complete == 0 and outcome.rejections == {Rejection.UNAUTHORISED: NUM_BLOCKS * LAYOUT.num_layers}
    out, complete, _, outcome = asyncio.run(_pull(cert_dir, [producer], [["node-acme"]] * NUM_BLOCKS, trust,
                                                  tenants=frozenset({"acme"})))
    assert complete == NUM_BLOCKS and np.array_equal(out, truth) and not outcome.rejections


def test_a_run_retried_once_on_its_alternate_counts_one_fallback(cert_dir: Path, open_node) -> None:
    # the first owner holds nothing (it answers MISS); its alternate serves the whole run
    honest, empty = open_node("node-honest"), open_node(_liar_first())
    truth = _random_payloads(6)
    honest.fabric.write_blocks(NS, HASHES, truth, signer=_signer(cert_dir, "node-honest"))
    trust = TrustAnchor.from_files(cert_dir / "ca.pem")
    out, complete, _, outcome = asyncio.run(
        _pull(cert_dir, [empty, honest], [[empty.name, "node-honest"]] * NUM_BLOCKS, trust))
    assert complete == NUM_BLOCKS and np.array_equal(out, truth)
    assert outcome.said_yes_owner_no == 1 and outcome.num_fallbacks == 1
