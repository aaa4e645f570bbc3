"""Block-id chains map to kvfabric block hashes: per the documented formula, the same in every
process, bound to the namespace (tenant) and to the parent id, with clear errors for bad ids."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import blake3
import pytest

from fabric.block_ids import block_id_hashes
from fabric.keys import Namespace, block_hashes
from fabric.layout import KVLayout

ROOT = Path(__file__).resolve().parents[2]
NS = Namespace("ids-model", KVLayout.mha(2, 2, 4, "f16"), block_size=4, weights_fingerprint="w")


def by_formula(ns: Namespace, ids: list[bytes | int], parent: bytes | int | None) -> list[bytes]:
    """The module docstring's formula, written out again with plain blake3."""
    def enc(x: bytes | int | None) -> bytes:
        if x is None:
            return b"\x00"
        if isinstance(x, int):
            return b"\x01" + (x % 2**64).to_bytes(8, "big")
        return b"\x02" + bytes([len(x)]) + x
    root = blake3.blake3(b"kvfabric/block-ids/v1" + ns.root).digest()
    out, prev = [], enc(parent)
    for x in ids:
        out.append(blake3.blake3(root + prev + enc(x)).digest())
        prev = enc(x)
    return out


def test_hashes_follow_the_documented_formula_for_int_and_bytes_ids() -> None:
    ids: list[bytes | int] = [2**64 - 1, 7, b"\x01" * 32, b"x"]
    assert block_id_hashes(NS, ids) == by_formula(NS, ids, None)
    assert block_id_hashes(NS, ids, parent=123) == by_formula(NS, ids, 123)


def test_a_chain_given_in_parts_maps_to_the_same_hashes_as_the_whole() -> None:
    ids = [11, 22, 33, 44]
    whole = block_id_hashes(NS, ids)
    assert block_id_hashes(NS, ids[2:], parent=ids[1]) == whole[2:]
    assert block_id_hashes(NS, ids[2:]) != whole[2:]          # without its parent it is another block


def test_signed_and_unsigned_spellings_of_a_64_bit_id_name_the_same_block() -> None:
    assert block_id_hashes(NS, [-1]) == block_id_hashes(NS, [2**64 - 1])


def test_tenants_and_token_chains_never_share_a_block() -> None:
    alice = Namespace("ids-model", NS.layout, 4, weights_fingerprint="w", tenant_salt=b"alice")
    assert block_id_hashes(alice, [1, 2]) != block_id_hashes(NS, [1, 2])
    assert set(block_id_hashes(NS, [1, 2])).isdisjoint(block_hashes(NS, [1, 0, 0, 0, 2, 0, 0, 0]))


@pytest.mark.parametrize("bad", [b"", b"x" * 33, 2**64, -(2**63) - 1, True, 1.5, "abc"])
def test_a_bad_id_is_a_clear_error(bad: object) -> None:
    with pytest.raises(ValueError, match="block id"):
        block_id_hashes(NS, [1, bad])  # type: ignore[list-item]


def test_two_processes_with_different_hash_seeds_map_ids_to_the_same_keys() -> None:
    code = ("from fabric.block_ids import block_id_hashes\n"
            "from fabric.keys import Namespace\nfrom fabric.layout import KVLayout\n"
            "ns = Namespace('ids-model', KVLayout.mha(2, 2, 4, 'f16'), block_size=4, weights_fingerprint='w')\n"
            "print(','.join(h.hex() for h in block_id_hashes(ns, [5, b'abc', 2**63], parent=b'p')))\n")
    outputs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        outputs.add(proc.stdout.strip())
    assert outputs == {",".join(h.hex() for h in block_id_hashes(NS, [5, b"abc", 2**63], parent=b"p"))}
