"""Block keys: pinned vectors, process independence, chaining rules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fabric.keys import SCHEMA_VERSION, BlockAddress, BlockHash, Namespace, addresses, block_hashes
from fabric.layout import KVLayout

VECTORS = Path(__file__).parent.parent / "vectors" / "block_hashes.json"


def _namespace(spec: dict[str, object]) -> Namespace:
    spec = dict(spec)
    lay = spec.pop("layout")
    assert isinstance(lay, dict)
    layout = (KVLayout.mla(lay["num_layers"], lay["head_dim"], lay["dtype"]) if lay["kind"] == "mla"
              else KVLayout.mha(lay["num_layers"], lay["num_kv_heads"], lay["head_dim"], lay["dtype"]))
    if "tenant_salt" in spec:
        spec["tenant_salt"] = bytes.fromhex(str(spec["tenant_salt"]))
    return Namespace(layout=layout, **spec)  # type: ignore[arg-type]


def test_vectors_reproduce() -> None:
    data = json.loads(VECTORS.read_text())
    assert data["schema_version"] == SCHEMA_VERSION
    assert len(data["cases"]) >= 12
    for case in data["cases"]:
        ns = _namespace(case["namespace"])
        assert ns.root.hex() == case["root"], case["namespace_name"]
        hashes = block_hashes(ns, case["tokens"])
        assert [h.hex() for h in hashes] == case["hashes"], (case["namespace_name"], case["case"])
        for h, (k0, klast) in zip(hashes, case["storage_keys_layer0_and_last"], strict=True):
            assert BlockAddress(h, 0).storage_key.hex() == k0
            assert BlockAddress(h, ns.layout.num_layers - 1).storage_key.hex() == klast


def test_vector_cases_cover_the_edges() -> None:
    cases = json.loads(VECTORS.read_text())["cases"]
    by_kind = {c["case"]: c for c in cases}
    assert by_kind["empty"]["hashes"] == []
    assert by_kind["short"]["hashes"] == []
    assert len(by_kind["one_block"]["hashes"]) == 1
    assert all(len(c["hashes"]) == 5 for c in cases if c["case"] == "many_with_tail")
    roots = {c["root"] for c in cases}
    assert len(roots) == 4  # salts, shards, dtypes and models all separate namespaces


_CHILD = """
import json, sys
from fabric.keys import Namespace, block_hashes, BlockAddress
from fabric.layout import KVLayout
ns = Namespace("m", KVLayout.mha(4, 2, 64, "bf16"), 16, tenant_salt=b"s")
hs = block_hashes(ns, list(range(1000)))
print(json.dumps([ns.root.hex()] + [h.hex() for h in hs] + [BlockAddress(hs[-1], 3).storage_key.hex()]))
"""


def test_same_keys_across_processes_with_different_hash_seeds() -> None:
    outputs = []
    for seed in ("0", "12345", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
        outputs.append(json.loads(out.stdout))
    assert outputs[0] == outputs[1] == outputs[2]
    assert len(outputs[0]) == 1 + 1000 // 16 + 1


@pytest.fixture
def ns() -> Namespace:
    return Namespace("model", KVLayout.mha(2, 2, 8, "f16"), block_size=4)


def test_only_full_blocks_and_prefix_sharing(ns: Namespace) -> None:
    a = block_hashes(ns, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = block_hashes(ns, [1, 2, 3, 4, 5, 6, 7, 0])
    assert len(a) == 2 and len(b) == 2
    assert a[0] == b[0] and a[1] != b[1]  # shared exactly up to the first differing block


def test_chain_depends_on_whole_prefix(ns: Namespace) -> None:
    a = block_hashes(ns, [9, 9, 9, 9, 1, 2, 3, 4])
    b = block_hashes(ns, [8, 9, 9, 9, 1, 2, 3, 4])
    assert a[1] != b[1]  # same second block, different first block


def test_parent_continues_a_chain(ns: Namespace) -> None:
    whole = block_hashes(ns, list(range(12)))
    tail = block_hashes(ns, list(range(4, 12)), parent=whole[0])
    assert tail == whole[1:]


def test_numpy_and_list_inputs_agree(ns: Namespace) -> None:
    toks = [0, 1, 2**32 - 1, 7, 70000, 3, 2, 1]
    assert block_hashes(ns, toks) == block_hashes(ns, np.array(toks, dtype=np.int64))
    assert block_hashes(ns, toks) == block_hashes(ns, np.array(toks, dtype="<u4"))


def test_namespace_fields_change_the_root() -> None:
    layout = KVLayout.mha(2, 2, 8, "f16")
    base = Namespace("model", layout, 4)
    variants = [
        Namespace("model2", layout, 4),
        Namespace("model", KVLayout.mha(2, 2, 8, "bf16"), 4),
        Namespace("model", layout, 8),
        Namespace("model", layout, 4, tenant_salt=b"x"),
        Namespace("model", layout, 4, shard=1, num_shards=2),
        Namespace("model", layout, 4, weights_fingerprint="w"),
    ]
    roots = {base.root} | {v.root for v in variants}
    assert len(roots) == 1 + len(variants)
    assert Namespace("model", layout, 4).root == base.root


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5]])
def test_bad_tokens_are_rejected(ns: Namespace, bad: list[object]) -> None:
    with pytest.raises(ValueError):
        block_hashes(ns, bad)  # type: ignore[arg-type]


def test_addresses_and_storage_keys(ns: Namespace) -> None:
    hs = block_hashes(ns, list(range(8)))
    addrs = addresses(hs, ns.layout.num_layers)
    assert [(a.hash, a.layer) for a in addrs] == [(hs[0], 0), (hs[0], 1), (hs[1], 0), (hs[1], 1)]
    keys = {a.storage_key for a in addrs}
    assert len(keys) == 4 and all(len(k) == 32 for k in keys)
    with pytest.raises(ValueError):
        BlockAddress(BlockHash(b"short"), 0)
    with pytest.raises(ValueError):
        BlockAddress(hs[0], -1)


def test_bad_namespace_is_rejected() -> None:
    layout = KVLayout.mha(2, 2, 8, "f16")
    with pytest.raises(ValueError):
        Namespace("", layout, 4)
    with pytest.raises(ValueError):
        Namespace("m", layout, 0)
    with pytest.raises(ValueError):
        Namespace("m", layout, 4, shard=2, num_shards=2)
