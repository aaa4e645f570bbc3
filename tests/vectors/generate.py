"""Regenerate block_hashes.json. Run only when the key schema version changes on purpose:

    .venv/bin/python tests/vectors/generate.py > tests/vectors/block_hashes.json
"""

from __future__ import annotations

import json
import random

from fabric.keys import SCHEMA_VERSION, BlockAddress, Namespace, block_hashes
from fabric.layout import KVLayout

NAMESPACES = {
    "llama-f16-bs16": dict(model_id="meta-llama/Llama-3.1-8B", layout=KVLayout.mha(32, 8, 128, "f16"), block_size=16),
    "llama-f16-bs16-salted": dict(model_id="meta-llama/Llama-3.1-8B", layout=KVLayout.mha(32, 8, 128, "f16"),
                                  block_size=16, tenant_salt=b"tenant-a"),
    "llama-bf16-bs4-tp1of2": dict(model_id="meta-llama/Llama-3.1-8B", layout=KVLayout.mha(32, 8, 128, "bf16"),
                                  block_size=4, shard=1, num_shards=2, weights_fingerprint="sha256:abc123"),
    "mla-fp8-bs64": dict(model_id="deepseek-ai/DeepSeek-V3", layout=KVLayout.mla(61, 576, "fp8_e4m3"), block_size=64),
}


def token_cases(block_size: int, rng: random.Random) -> dict[str, list[int]]:
    return {
        "empty": [],
        "short": [rng.randrange(2**32) for _ in range(block_size - 1)],
        "one_block": [rng.randrange(2**17) for _ in range(block_size)],
        "many_with_tail": [rng.randrange(2**32) for _ in range(5 * block_size + block_size // 2 + 1)],
    }


def main() -> None:
    rng = random.Random(20261121)
    cases = []
    for name, kwargs in NAMESPACES.items():
        ns = Namespace(**kwargs)  # type: ignore[arg-type]
        for case, tokens in token_cases(ns.block_size, rng).items():
            hashes = block_hashes(ns, tokens)
            cases.append({
                "namespace_name": name,
                "namespace": {k: (v.hex() if isinstance(v, bytes) else v.describe() if isinstance(v, KVLayout) else v)
                              for k, v in kwargs.items()},
                "root": ns.root.hex(),
                "case": case,
                "tokens": tokens,
                "hashes": [h.hex() for h in hashes],
                "storage_keys_layer0_and_last": [
                    [BlockAddress(h, 0).storage_key.hex(), BlockAddress(h, ns.layout.num_layers - 1).storage_key.hex()]
                    for h in hashes
                ],
            })
    print(json.dumps({"schema_version": SCHEMA_VERSION, "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
