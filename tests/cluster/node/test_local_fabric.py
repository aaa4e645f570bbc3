"""LocalFabric: the Fabric protocol over one real Store (real files under tmp_path)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cluster.api import CacheFill, Where, payload_shape
from cluster.node.local import LocalFabric
from fabric.config import KVConfig
from fabric.keys import Namespace
from fabric.layout import KVLayout
from fabric.store import Store

NS = Namespace("test-model", KVLayout.mha(3, 2, 4, "f16"), block_size=4)


def open_store(tmp_path: Path, **overrides: object) -> Store:
    settings: dict[str, object] = dict(ram_gib=0.01, ssd_dir=str(tmp_path / "ssd"), ssd_gib=0.05,
                                       index_dir=str(tmp_path / "index"), o_direct=False)
    kv = KVConfig(**{**settings, **overrides})  # type: ignore[arg-type]
    return Store.open(kv, background=False)


def random_payloads(num_blocks: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, payload_shape(NS, num_blocks), dtype=np.uint8)


def test_store_then_load_returns_identical_bytes_for_the_full_blocks(tmp_path: Path) -> None:
    tokens = list(range(18))            # 4 full blocks of 4, and a partial tail that is never cached
    data = random_payloads(4)
    with open_store(tmp_path) as store:
        fabric = LocalFabric(store, "n1")
        assert fabric.lookup(NS, tokens).num_blocks == 0
        reply = fabric.store(NS, tokens, data)
        assert (reply.num_stored, reply.num_refused) == (4, 0)
        found = fabric.lookup(NS, tokens)
        assert found.num_tokens == 16
        assert {loc.where for loc in found.locations} == {Where.RAM}
        loaded = fabric.load(NS, tokens)
        assert np.array_equal(loaded.payloads, data)
        assert loaded.sources == ("ram",) * 4
        layers = [(layer, arr.copy()) for layer, arr in fabric.load_layers(NS, tokens)]
        assert [layer for layer, _ in layers] == [0, 1, 2]
        assert all(np.array_equal(arr, data[:, layer]) for layer, arr in layers)


def test_a_shared_prefix_hits_only_up_to_where_the_prompts_differ(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        fabric = LocalFabric(store)
        fabric.store(NS, list(range(16)), random_payloads(4))
        other = [*range(9), 999, *range(10, 16)]     # differs inside block 2
        assert fabric.load(NS, other).num_blocks == 2


def test_a_block_with_a_missing_layer_ends_the_hit(tmp_path: Path) -> None:
    from fabric.keys import BlockAddress, block_hashes
    tokens = list(range(16))
    with open_store(tmp_path) as store:
        fabric = LocalFabric(store)
        fabric.store(NS, tokens, random_payloads(4))
        store.delete(BlockAddress(block_hashes(NS, tokens)[1], 2))
        assert fabric.lookup(NS, tokens).num_blocks == 1
        assert fabric.load(NS, tokens).num_blocks == 1


def test_store_rejects_payloads_of_the_wrong_shape(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        fabric = LocalFabric(store)
        with pytest.raises(ValueError, match="layout wants"):
            fabric.store(NS, list(range(16)), np.zeros((4, 3, 7), dtype=np.uint8))
        with pytest.raises(ValueError, match="outside the prompt"):
            fabric.store(NS, list(range(8)), random_payloads(3))


def test_blocks_named_by_ids_round_trip_and_a_chain_tail_continues_from_its_parent(tmp_path: Path) -> None:
    ids: list[bytes | int] = [101, 102, b"\xaa" * 32, 104]
    data = random_payloads(4, seed=5)
    with open_store(tmp_path) as store:
        fabric = LocalFabric(store, "n1")
        assert fabric.lookup_blocks(NS, ids).num_blocks == 0
        assert fabric.store_blocks(NS, ids, data[:2]).num_stored == 2
        assert fabric.store_blocks(NS, ids, data[2:], first_block=2).num_stored == 2
        assert fabric.lookup_blocks(NS, ids).num_blocks == 4
        assert np.array_equal(fabric.load_blocks(NS, ids).payloads, data)
        tail = fabric.load_blocks(NS, ids[2:], parent=ids[1])
        assert np.array_equal(tail.payloads, data[2:])
        assert fabric.load_blocks(NS, ids[2:]).num_blocks == 0      # no parent: another chain
        assert fabric.load_blocks(NS, [101, 999, b"\xaa" * 32]).num_blocks == 1
        layers = [(layer, arr.copy()) for layer, arr in fabric.load_blocks_layers(NS, ids, max_blocks=3)]
        assert [layer for layer, _ in layers] == [0, 1, 2]
        assert all(np.array_equal(arr, data[:3, layer]) for layer, arr in layers)
        salted = Namespace("test-model", NS.layout, block_size=4, tenant_salt=b"other")
        assert fabric.lookup_blocks(salted, ids).num_blocks == 0   # another tenant sees nothing


def test_a_block_id_store_with_bad_ids_or_shape_raises_and_stores_nothing(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        fabric = LocalFabric(store)
        with pytest.raises(ValueError, match="block id"):
            fabric.store_blocks(NS, [1, b""], random_payloads(2))
        with pytest.raises(ValueError, match="outside the chain's 2 full blocks"):
            fabric.store_blocks(NS, [1, 2], random_payloads(3))
        assert store.held_addresses() == []


@pytest.mark.parametrize("peek", [True, False])
def test_a_peek_at_a_prompt_does_not_save_it_from_eviction(tmp_path: Path, peek: bool) -> None:
    """Two prompts of 2 blocks x 3 layers fill 12 SSD files; maintenance trims to 90 % (2 files,
    the least recently seen). Prompt A was stored first: a peek leaves it first in line, a lookup
    (an access) moves it behind B."""
    from fabric.keys import block_hashes
    from fabric.tiers.ssd_format import HEADER_SIZE
    per_file = HEADER_SIZE + NS.layout.bytes_per_block_layer(NS.block_size)
    first, second = list(range(8)), list(range(100, 108))
    with open_store(tmp_path, write_through=True, ssd_gib=12 * per_file / (1 << 30)) as store:
        fabric = LocalFabric(store)
        fabric.store(NS, first, random_payloads(2, seed=1))
        fabric.store(NS, second, random_payloads(2, seed=2))
        tiers = fabric.local_tiers(block_hashes(NS, first), NS.layout.num_layers, peek=peek)
        assert len(tiers) == 2
        assert store.run_maintenance()["ssd_evicted"] == 2
    with open_store(tmp_path, write_through=True) as store:     # RAM is empty: only SSD answers
        fabric = LocalFabric(store)
        hits = (fabric.lookup(NS, first, peek=True).num_blocks, fabric.lookup(NS, second, peek=True).num_blocks)
        assert hits == ((0, 2) if peek else (2, 0))


def test_a_lookup_says_how_full_the_node_is_in_the_prompts_blocks(tmp_path: Path) -> None:
    """A router reads a node's room from every lookup: capacity from the larger tier (here the block
    caps), what is held from the fuller one, in blocks of the namespace asked about."""
    with open_store(tmp_path, ram_blocks=6, ssd_blocks=10) as store:
        fabric = LocalFabric(store)
        assert fabric.lookup(NS, list(range(16))).fill == CacheFill(held_blocks=0, capacity_blocks=10)
        fabric.store(NS, list(range(16)), random_payloads(4))
        fabric.store(NS, list(range(100, 108)), random_payloads(2, seed=1))
        assert fabric.lookup(NS, [7] * 16).fill == CacheFill(held_blocks=6, capacity_blocks=10)
    with open_store(tmp_path / "bytes") as store:      # no block caps: bytes decide
        per_block = NS.layout.bytes_per_block(NS.block_size)
        assert LocalFabric(store).lookup(NS, []).fill.capacity_blocks == int(0.05 * (1 << 30)) // per_block


def test_a_signed_store_hashes_each_payload_once_and_its_records_sign_the_stored_digests(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import blake3

    from fabric.keys import BlockAddress, block_hashes
    from fabric.tiers import base
    from transports.trust.certs import init_ca, issue_node
    from transports.trust.identity import NodeSigner
    init_ca(tmp_path / "certs")
    issue_node(tmp_path / "certs", "node-a")
    signer = NodeSigner(tmp_path / "certs" / "node-a.pem", tmp_path / "certs" / "node-a.key")
    layer_bytes = NS.layout.bytes_per_block_layer(NS.block_size)
    hashed: list[int] = []

    class CountingBlake3:   # the real BLAKE3 behind the payload digest, its payload-sized inputs counted
        def blake3(self, data: memoryview) -> blake3.blake3:
            hashed.extend([1] if memoryview(data).nbytes == layer_bytes else [])
            return blake3.blake3(data)

    tokens, data = list(range(16)), random_payloads(4)
    with open_store(tmp_path) as store:
        with monkeypatch.context() as patch:
            patch.setattr(base, "blake3", CountingBlake3())
            reply = LocalFabric(store).write_blocks(NS, block_hashes(NS, tokens), data, signer=signer)
        assert reply.num_stored == 4
        assert len(hashed) == 4 * NS.layout.num_layers          # once per (block, layer), no more
        for h in block_hashes(NS, tokens):
            for layer in range(NS.layout.num_layers):
                got = store.get_block(BlockAddress(h, layer))
                assert got is not None and got.provenance is not None
                assert got.provenance.layer_digest(layer) == got.digest


def test_a_load_reads_the_store_in_one_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokens, data = list(range(16)), random_payloads(4)
    with open_store(tmp_path) as store:
        fabric = LocalFabric(store)
        fabric.store(NS, tokens, data)
        visits: list[str] = []

        def counted(name: str) -> object:
            real = getattr(store, name)
            return lambda *args, **kwargs: visits.append(name) or real(*args, **kwargs)

        for name in ("read_run", "get_block", "lookup", "lookup_run", "peek"):
            monkeypatch.setattr(store, name, counted(name))
        loaded = fabric.load(NS, tokens)
        assert np.array_equal(loaded.payloads, data) and visits == ["read_run"]
