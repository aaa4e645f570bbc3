"""The key test vectors, derived again from the formula in docs/architecture.md alone with raw blake3, msgpack and
struct: no import of fabric.keys, so a drift between the code and the documented formula fails here.

    root     = BLAKE3("kvfabric/keys/v1" ‖ msgpack(canonical namespace, map keys sorted, bin type))
    h_i      = BLAKE3(h_{i-1} ‖ tokens of block i as little-endian u32), h_{-1} = root
    key(h,l) = BLAKE3(h ‖ l as little-endian u32)

canonical namespace = {block_size, layout: {dtype, head_dim, kind, num_kv_heads, num_layers},
model_id, num_shards, shard, tenant_salt (bytes), weights_fingerprint}.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import blake3
import msgpack

VECTORS = Path(__file__).parent.parent / "vectors" / "block_hashes.json"


def canonical(ns: dict[str, Any]) -> dict[str, Any]:
    layout = ns["layout"]
    return {
        "block_size": ns["block_size"],
        "layout": {k: layout[k] for k in sorted(("kind", "num_layers", "num_kv_heads", "head_dim", "dtype"))},
        "model_id": ns["model_id"],
        "num_shards": ns.get("num_shards", 1),
        "shard": ns.get("shard", 0),
        "tenant_salt": bytes.fromhex(ns.get("tenant_salt", "")),
        "weights_fingerprint": ns.get("weights_fingerprint", ""),
    }


def test_vectors_match_an_independent_derivation_of_the_readme_formula() -> None:
    data = json.loads(VECTORS.read_text())
    assert data["schema_version"] == "kvfabric/keys/v1"
    num_hashes = 0
    for case in data["cases"]:
        ns = case["namespace"]
        packed = msgpack.packb(canonical(ns), use_bin_type=True)
        root = blake3.blake3(b"kvfabric/keys/v1" + packed).digest()
        assert root.hex() == case["root"], case["namespace_name"]
        size = ns["block_size"]
        tokens = case["tokens"]
        h, hashes = root, []
        for i in range(len(tokens) // size):
            h = blake3.blake3(h + struct.pack(f"<{size}I", *tokens[i * size:(i + 1) * size])).digest()
            hashes.append(h.hex())
        assert hashes == case["hashes"], f"{case['namespace_name']}/{case['case']}"
        last = ns["layout"]["num_layers"] - 1
        keys = [[blake3.blake3(bytes.fromhex(x) + struct.pack("<I", layer)).hexdigest() for layer in (0, last)]
                for x in hashes]
        assert keys == case["storage_keys_layer0_and_last"]
        num_hashes += len(hashes)
    assert num_hashes > 10
