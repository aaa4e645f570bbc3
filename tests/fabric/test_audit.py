"""The audit core: sampling decisions over seeded draws, and KV comparison bitwise or within a tolerance."""

from __future__ import annotations

import random

import numpy as np
import pytest

from fabric.audit import AuditSampler, Outcome, compare_block, decode, is_bitwise
from fabric.config import AuditConfig, Config, ConfigError
from fabric.layout import DType, KVLayout

LAYOUT = KVLayout.mha(2, 2, 8, "f32")


def _first_sampled(sampler: AuditSampler, limit: int) -> int | None:
    """The 1-based index of the liar's first sampled prefix among `limit` served, as a node counts them."""
    for served in range(1, limit + 1):
        if sampler.sample({"liar"}, "", now=float(served)):
            return served
    return None


def test_a_liar_is_sampled_within_50_prefixes_at_10_percent_in_99_percent_of_seeded_runs() -> None:
    runs = 2000
    caught = sum(_first_sampled(AuditSampler(AuditConfig(rate=0.1), random.Random(seed)), 50) is not None
                 for seed in range(runs))
    assert caught / runs >= 0.99
    # Without boosts the rate alone predicts 1 - 0.9**50 = 99.5 %: the boosts only add to it.
    plain = AuditConfig(rate=0.1, new_boost=1.0)
    caught_plain = sum(_first_sampled(AuditSampler(plain, random.Random(seed)), 50) is not None
                       for seed in range(runs))
    assert 0.985 <= caught_plain / runs <= caught / runs


def test_a_rate_of_zero_never_samples_and_the_same_seed_draws_the_same() -> None:
    off = AuditSampler(AuditConfig(rate=0.0), random.Random(1))
    assert not any(off.sample({"p"}, "", now=float(i)) for i in range(1000))
    def draws() -> list[bool]:
        sampler = AuditSampler(AuditConfig(rate=0.3, new_boost=1.0), random.Random(7))
        return [sampler.sample({"p"}, "", now=float(i)) for i in range(200)]
    first = draws()
    assert first == draws() and 0 < sum(first) < 200


def test_new_stale_and_disputed_producers_are_sampled_more_often() -> None:
    config = AuditConfig(rate=0.01, new_checks=2, new_boost=4.0, stale_s=100.0, stale_boost=2.0,
                         dispute_window_s=50.0, dispute_boost=8.0, tenant_rates={"acme": 0.02},
                         producer_rates={"watched": 0.5})
    s = AuditSampler(config, random.Random(0))
    assert s.rate("fresh", "", now=0.0) == pytest.approx(0.04)          # new
    s.checked("fresh", 0.0)
    s.checked("fresh", 1.0)
    assert s.rate("fresh", "", now=2.0) == pytest.approx(0.01)          # checked twice: no longer new
    assert s.rate("fresh", "acme", now=2.0) == pytest.approx(0.02)      # the tenant's rate
    assert s.rate("fresh", "", now=200.0) == pytest.approx(0.02)        # not checked for 199 s: stale
    s.disputed("fresh", 190.0)
    assert s.rate("fresh", "", now=200.0) == pytest.approx(0.08)        # the largest boost, not the product
    assert s.rate("fresh", "", now=241.0) == pytest.approx(0.02)        # the dispute is 51 s old
    assert s.rate("watched", "acme", now=0.0) == 1.0                    # a producer's rate wins, capped at 1
    many = AuditSampler(AuditConfig(rate=0.01, new_boost=1.0), random.Random(3))
    assert not many.sample((), "", now=0.0)                              # nothing pulled: nothing to check
    hits = sum(many.sample({"a", "b"}, "", now=0.0) for _ in range(20_000))
    assert 150 < hits < 250                                              # one draw per load, not per producer


def _kv(seed: int) -> np.ndarray:
    values = np.random.default_rng(seed).normal(0, 2.0, (2, LAYOUT.bytes_per_block_layer(16) // 4))
    return values.astype(np.float32).view(np.uint8)


def test_equal_blocks_match_and_any_changed_byte_fails_a_bitwise_comparison() -> None:
    kv = _kv(0)
    same = compare_block(LAYOUT, kv, kv.copy(), bitwise=True, atol=0.0, rtol=0.0)
    assert same.outcome is Outcome.EQUAL and same.engine_digest == same.signed_digest
    other = kv.copy()
    other[1, 5] ^= 1
    verdict = compare_block(LAYOUT, kv, other, bitwise=True, atol=1.0, rtol=1.0)
    assert verdict.outcome is Outcome.MISMATCH and verdict.layer == 1
    assert verdict.engine_digest != verdict.signed_digest


def test_float_noise_within_the_tolerance_passes_and_a_lie_does_not() -> None:
    kv = _kv(1)
    values = kv.view(np.float32)
    noisy = (values * (1 + np.random.default_rng(2).uniform(-1e-5, 1e-5, values.shape))).astype(np.float32)
    verdict = compare_block(LAYOUT, noisy.view(np.uint8), kv, bitwise=False, atol=1e-3, rtol=1e-2)
    assert verdict.outcome is Outcome.WITHIN and 0 < verdict.worst < 1
    lie = values.copy()
    lie[0, :64] += 0.5   # a few values moved by a quarter of their scale
    verdict = compare_block(LAYOUT, lie.view(np.uint8), kv, bitwise=False, atol=1e-3, rtol=1e-2)
    assert verdict.outcome is Outcome.MISMATCH and verdict.layer == 0 and verdict.worst > 1
    nan = values.copy()
    nan[1, 3] = np.nan
    assert compare_block(LAYOUT, nan.view(np.uint8), kv, bitwise=False, atol=1.0,
                         rtol=1.0).outcome is Outcome.MISMATCH


def test_values_decode_in_the_layouts_dtype() -> None:
    halves = np.array([1.5, -2.0], dtype=np.float16).view(np.uint8)
    assert decode(DType.F16, halves).tolist() == [1.5, -2.0]
    bf16 = (np.array([3.0, -0.5], dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    assert decode(DType.BF16, bf16).tolist() == [3.0, -0.5]
    fp8 = decode(DType.FP8_E4M3, np.array([0x38, 0xB8], dtype=np.uint8))   # 1.0 and -1.0 in e4m3
    assert fp8.tolist() == [1.0, -1.0]
    with pytest.raises(ValueError, match="one shape"):
        compare_block(LAYOUT, _kv(0), _kv(0)[:1], bitwise=True, atol=0, rtol=0)


def test_audit_config_reads_rates_per_tenant_and_producer_and_refuses_bad_ones() -> None:
    cfg = Config.from_dict({"audit": {"rate": 0.05, "tenant_rates": {"acme": 0.2}, "producer_rates": {"n-1": 1},
                                      "bitwise_models": ["m"]}})
    assert cfg.audit.tenant_rates == {"acme": 0.2} and cfg.audit.producer_rates == {"n-1": 1.0}
    assert is_bitwise(cfg.audit, "m") and not is_bitwise(cfg.audit, "other")
    with pytest.raises(ConfigError, match=r"audit.tenant_rates.acme must be in \[0, 1\]"):
        Config.from_dict({"audit": {"tenant_rates": {"acme": 2.0}}})
    with pytest.raises(ConfigError, match=r"audit\.dispute_boost must be >= 1"):
        Config.from_dict({"audit": {"dispute_boost": 0.5}})
    with pytest.raises(ConfigError, match="must be a table"):
        Config.from_dict({"audit": {"tenant_rates": [1]}})
