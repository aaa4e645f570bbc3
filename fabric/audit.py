"""Catching a lying producer, pure: which pulled prefixes to recompute, and whether what an engine
computed matches what the producer signed at the same address.

A producer with a valid certificate can sign wrong KV as its own: every provenance check passes,
because it *is* that block's producer. The fabric catches it by sampled recompute: with a small
probability a request that would hit pulled KV computes it instead, and the node compares the
engine's KV with the producer's signed payload for the same block hashes. A mismatch is evidence
against that producer (its signature over its digests, and the engine's bytes), and quarantines it.

Sampling (`AuditSampler`). A load whose pulled blocks come from producers P is recomputed with
probability max over p in P of `rate(p)`:

    rate(p) = min(1, base(p) x boost(p))
    base(p)  = [audit] producer_rates[p], else tenant_rates[tenant], else rate (default 1 %)
    boost(p) = the largest that applies of
               new_boost      while p has been checked fewer than `new_checks` times (new producers),
               stale_boost    when p was last checked more than `stale_s` ago (rarely checked),
               dispute_boost  within `dispute_window_s` of a disagreement naming p (recently disputed),
               else 1.

The largest boost, not their product: a new producer that is also disputed is checked at 8x the
base rate, not 64x, so the recompute cost stays bounded by `max boost x rate` of prefill time.
The draws come from one `random.Random` (seeded: a simulation or a test replays them exactly).

Comparison (`compare_block`). Where the namespace's engine is deterministic (its model id is in
`[audit] bitwise_models`), engine KV and signed KV must be bitwise equal. Otherwise both are
decoded in the layout's dtype and each (block, layer) must satisfy

    max |engine - signed|  <=  atol + rtol x max |signed|

(a scale-relative bound: KV values of one layer share a scale, and a lie that matters moves them
far more than kernel nondeterminism does). Choosing it: recompute the same prompts on two honest
nodes (different thread counts, batch shapes, libraries as deployed), take the largest left side
seen, and set the tolerance about ten times above it; anything below the tolerance is by definition
not caught, so keep it well under what changes the model's output (the default, rtol 1 %, leaves
greedy tokens unchanged on the models in docs/benchmarks.md). Non-finite values must sit at the
same places with the same values.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Collection
from dataclasses import dataclass, field

import blake3
import numpy as np

from fabric.config import AuditConfig
from fabric.layout import DType, KVLayout


@dataclass(slots=True)
class ProducerChecks:
    """What the sampler remembers of one producer."""

    checks: int = 0
    last_check: float | None = None
    last_dispute: float | None = None


@dataclass(slots=True)
class AuditSampler:
    """The sampling decision (see the module doc). Not thread-safe: one per node's event loop."""

    config: AuditConfig
    rng: random.Random
    producers: dict[str, ProducerChecks] = field(default_factory=dict)

    def rate(self, producer: str, tenant: str, now: float) -> float:
        c = self.config
        base = c.producer_rates.get(producer, c.tenant_rates.get(tenant, c.rate))
        seen = self.producers.get(producer, ProducerChecks())
        boost = 1.0
        if seen.checks < c.new_checks:
            boost = max(boost, c.new_boost)
        if seen.last_check is not None and now - seen.last_check > c.stale_s:
            boost = max(boost, c.stale_boost)
        if seen.last_dispute is not None and now - seen.last_dispute <= c.dispute_window_s:
            boost = max(boost, c.dispute_boost)
        return min(1.0, base * boost)

    def sample(self, producers: Collection[str], tenant: str, now: float) -> bool:
        """Whether a load whose pulled blocks name `producers` is recomputed (one draw per load)."""
        if not producers:
            return False
        p = max(self.rate(name, tenant, now) for name in producers)
        return p > 0 and self.rng.random() < p

    def checked(self, producer: str, now: float) -> None:
        seen = self.producers.setdefault(producer, ProducerChecks())
        seen.checks += 1
        seen.last_check = now

    def disputed(self, producer: str, now: float) -> None:
        self.producers.setdefault(producer, ProducerChecks()).last_dispute = now


class Outcome(enum.StrEnum):
    EQUAL = "equal"              # bitwise
    WITHIN = "within"            # within the tolerance on decoded values
    MISMATCH = "mismatch"


@dataclass(frozen=True, slots=True)
class BlockVerdict:
    outcome: Outcome
    engine_digest: bytes         # BLAKE3 of the engine's block (all layers)
    signed_digest: bytes         # BLAKE3 of the producer's signed block
    worst: float                 # the largest max|engine - signed| / (atol + rtol x max|signed|) of its layers
    layer: int                   # the layer with that ratio (the first differing one when bitwise)


def compare_block(layout: KVLayout, engine: np.ndarray, signed: np.ndarray, *, bitwise: bool,
                  atol: float, rtol: float) -> BlockVerdict:
    """Compare one block, uint8 `[layers, bytes_per_block_layer]` each (see the module doc)."""
    if engine.shape != signed.shape or engine.dtype != np.uint8 or signed.dtype != np.uint8:
        raise ValueError(f"blocks to compare must be uint8 of one shape, got {engine.dtype}{engine.shape} "
                         f"and {signed.dtype}{signed.shape}")
    digests = blake3.blake3(engine.tobytes()).digest(), blake3.blake3(signed.tobytes()).digest()
    if digests[0] == digests[1]:
        return BlockVerdict(Outcome.EQUAL, *digests, 0.0, -1)
    if bitwise or layout.dtype is DType.U8:
        differ = next(i for i in range(engine.shape[0]) if not np.array_equal(engine[i], signed[i]))
        return BlockVerdict(Outcome.MISMATCH, *digests, math.inf, differ)
    worst, where = 0.0, -1
    for layer in range(engine.shape[0]):
        a, b = decode(layout.dtype, engine[layer]), decode(layout.dtype, signed[layer])
        finite = np.isfinite(b)
        if not np.array_equal(finite, np.isfinite(a)) or not np.array_equal(a[~finite], b[~finite], equal_nan=True):
            return BlockVerdict(Outcome.MISMATCH, *digests, math.inf, layer)
        if not finite.any():
            continue
        allowed = atol + rtol * float(np.abs(b[finite]).max())
        ratio = float(np.abs(a[finite] - b[finite]).max()) / allowed if allowed > 0 else math.inf
        if ratio > worst:
            worst, where = ratio, layer
    return BlockVerdict(Outcome.WITHIN if worst <= 1.0 else Outcome.MISMATCH, *digests, worst, where)


def decode(dtype: DType, raw: np.ndarray) -> np.ndarray:
    """The values of a uint8 payload in `dtype`, as float64."""
    data = np.ascontiguousarray(raw)
    if dtype is DType.F32:
        return data.view(np.float32).astype(np.float64)
    if dtype is DType.F16:
        return data.view(np.float16).astype(np.float64)
    if dtype is DType.BF16:
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if dtype in (DType.FP8_E4M3, DType.FP8_E5M2):
        values: np.ndarray = _fp8_table(dtype)[data]
        return values
    return data.astype(np.float64)


_FP8: dict[DType, np.ndarray] = {}


def _fp8_table(dtype: DType) -> np.ndarray:
    """The 256 values of an fp8 format (torch knows the encodings; imported only here)."""
    table = _FP8.get(dtype)
    if table is None:
        import torch

        codes = torch.arange(256, dtype=torch.uint8).view(dtype.torch_dtype)
        table = _FP8[dtype] = codes.to(torch.float64).numpy()
    return table


def is_bitwise(config: AuditConfig, model_id: str) -> bool:
    """Whether KV of `model_id` must match bitwise (its engines are deterministic)."""
    return "*" in config.bitwise_models or model_id in config.bitwise_models
