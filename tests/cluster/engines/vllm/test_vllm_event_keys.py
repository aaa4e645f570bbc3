"""The extra keys the vLLM connector names its stored blocks by in KV events are vLLM's own: the same
per-block keys vLLM's block pool hashes with and publishes (LoRA on every block, cache_salt on the
first), so a router that hashes tokens as vLLM does maps the fabric's events."""

from __future__ import annotations

import pytest
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.v1.request import Request

from cluster.engines.vllm.scheduler import event_extra_keys

pytestmark = pytest.mark.vllm


def _request(cache_salt: str | None, lora: LoRARequest | None, num_tokens: int) -> Request:
    return Request("r", list(range(num_tokens)), SamplingParams(max_tokens=1), None, cache_salt=cache_salt,
                   lora_request=lora)


def test_the_salt_names_only_the_first_block_and_a_lora_every_block() -> None:
    keys = event_extra_keys(_request("s3cret", LoRARequest("adapter-a", 1, "/nowhere"), 3 * 32 + 5), 32)
    assert len(keys) == 3   # full prompt blocks only
    assert keys[0] is not None and "s3cret" in keys[0] and "adapter-a" in keys[0]
    assert all(k is not None and "adapter-a" in k and "s3cret" not in k for k in keys[1:])


def test_a_plain_request_has_no_extra_keys() -> None:
    assert event_extra_keys(_request(None, None, 64), 32) == (None, None)
