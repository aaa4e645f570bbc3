"""Tier thresholds and access-frequency tracking: pure policy, no I/O, time passed in as `now`.

Byte lines per tier (C = capacity)::

    RAM  0 ........ offload·C ........ C ........ high_water·C
                    evictor target     ram_gib    a put past here evicts inline first
    SSD  0 ........ low_water·C ...... C
                    evictor target     ssd_gib: a write that would pass it evicts inline first

Block lines (B = ram_blocks / ssd_blocks, when set; a block is one block hash with all its
layers): a put of a new block past B evicts inline first, and the evictor trims to offload·B
(RAM) or low_water·B (SSD), as for bytes.

* Device -> RAM: `should_offload_device(u)` answers whether the engine pool's utilisation u passes
  gpu_offload_threshold. Advisory: nothing in the fabric acts on it; an engine adapter may ask it
  and put its coldest blocks (no shipped engine does yet).
* RAM -> SSD: once RAM passes cpu_offload_threshold·C the evictor drops least recently used blocks
  (each already on SSD, written first if it was not) down to that line, so bursts between two
  evictor ticks land in the headroom instead of evicting inline.
* SSD: blocks not seen for ssd_ttl_s expire; past low_water·C the least recently seen go (and,
  after a write was refused for room, as many more as that write needs).
* SSD -> RAM prefetch: a block whose decayed access frequency is at least prefetch_threshold of
  the hottest block's is read back into RAM while RAM is under its offload line.

The planner. `TierPolicy.plan(snapshot, now)` turns a `TierSnapshot` (sizes and the prefetch
candidates, gathered by the store under its lock) into a `MaintenancePlan`: the SSD expiry cutoff
and byte target, whether to flush, the RAM byte target and which blocks to prefetch. It does no
I/O and reads no clock; the store carries the plan out (aioquic's habit: decisions take `now` and
return work).

Decayed frequency: every access adds 1 and the sum halves every `half_life_s`. It is stored as a
score s = log2(f(t)) + (t - t0) / half_life, which no longer changes as time passes, so comparing
two blocks (2 ** (s_a - s_b)) or finding the hottest needs no decay pass: touch O(1),
relative O(1), forget O(1) (O(n) only when the hottest key itself is forgotten).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from fabric.config import KVConfig

GIB = 1 << 30
PREFETCH_MAX_BLOCKS = 64
K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class TierSnapshot:
    """What the planner needs to know, taken at one instant."""

    ram_used_bytes: int
    ssd_used_bytes: int
    ssd_wanted_bytes: int     # refused or kept waiting for SSD room since the last pass
    num_pending: int          # write-behind blocks not yet on SSD
    ram_held_blocks: int = 0  # distinct block hashes in RAM / on SSD
    ssd_held_blocks: int = 0
    # SSD-only blocks seen since the last pass: (key, frequency relative to the hottest, file bytes)
    prefetch_candidates: tuple[tuple[bytes, float, int], ...] = ()


@dataclass(frozen=True, slots=True)
class MaintenancePlan:
    """Work for one evictor pass, in the order the store carries it out."""

    ssd_expiry_cutoff: float     # 1. drop SSD blocks last seen before this (TTL) ...
    ssd_target_bytes: int        #    ... then the least recently seen until SSD use is at most this
    flush: bool                  # 2. write pending write-behind blocks
    ram_target_bytes: int        # 3. evict unpinned RAM blocks (CLOCK order) down to this
    prefetch: tuple[bytes, ...]  # 4. read these SSD blocks back into RAM, hottest first
    ssd_evict_blocks: int = 0    # 1'. and take at least this many whole blocks off the SSD
    ram_evict_blocks: int = 0    # 3'. and out of RAM


@dataclass(frozen=True, slots=True)
class TierPolicy:
    ram_capacity_bytes: int
    ram_high_water_bytes: int
    ram_offload_threshold: float
    ssd_capacity_bytes: int
    ssd_low_water: float
    ssd_ttl_s: float
    gpu_offload_threshold: float
    prefetch_threshold: float
    ram_capacity_blocks: int = 0     # 0: bytes only
    ssd_capacity_blocks: int = 0

    def __post_init__(self) -> None:
        if self.ram_capacity_bytes <= 0 or self.ssd_capacity_bytes <= 0:
            raise ValueError("tier capacities must be positive")
        if self.ram_capacity_blocks < 0 or self.ssd_capacity_blocks < 0:
            raise ValueError("block capacities must be >= 0")
        if self.ram_high_water_bytes < self.ram_capacity_bytes:
            raise ValueError("RAM high-water mark must be >= its capacity")
        for name in ("ram_offload_threshold", "ssd_low_water", "gpu_offload_threshold", "prefetch_threshold"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value}")

    @classmethod
    def from_config(cls, kv: KVConfig) -> TierPolicy:
        ram = max(1, int(kv.ram_gib * GIB))
        return cls(ram_capacity_bytes=ram, ram_high_water_bytes=int(ram * kv.ram_high_water),
                   ram_offload_threshold=kv.cpu_offload_threshold,
                   ssd_capacity_bytes=max(1, int(kv.ssd_gib * GIB)), ssd_low_water=kv.ssd_low_water,
                   ssd_ttl_s=kv.ssd_ttl_s, gpu_offload_threshold=kv.gpu_offload_threshold,
                   prefetch_threshold=kv.prefetch_threshold, ram_capacity_blocks=kv.ram_blocks,
                   ssd_capacity_blocks=kv.ssd_blocks)

    @property
    def ram_offload_line(self) -> int:
        return int(self.ram_capacity_bytes * self.ram_offload_threshold)

    def ram_room_for_promotion(self, used: int) -> int:
        """Bytes a promotion or prefetch may add without creating eviction work."""
        return max(0, self.ram_offload_line - used)

    def ssd_has_room(self, used: int, num_bytes: int) -> bool:
        return used + num_bytes <= self.ssd_capacity_bytes

    def ssd_expiry_cutoff(self, now_unix: float) -> float:
        """Blocks last seen before this instant have outlived ssd_ttl_s."""
        return now_unix - self.ssd_ttl_s

    def should_offload_device(self, pool_utilisation: float) -> bool:
        return pool_utilisation > self.gpu_offload_threshold

    def should_prefetch(self, relative_frequency: float) -> bool:
        return relative_frequency >= self.prefetch_threshold

    def plan(self, snapshot: TierSnapshot, now: float) -> MaintenancePlan:
        """One pass of decisions (see MaintenancePlan); pure."""
        cap = self.ssd_capacity_bytes
        target = max(0, min(int(cap * self.ssd_low_water), cap - snapshot.ssd_wanted_bytes))
        budget = self.ram_room_for_promotion(snapshot.ram_used_bytes)
        prefetch: list[bytes] = []
        hot = sorted((c for c in snapshot.prefetch_candidates if self.should_prefetch(c[1])),
                     key=lambda c: c[1], reverse=True)
        for key, _, num_bytes in hot[:PREFETCH_MAX_BLOCKS]:
            if num_bytes > budget:
                break
            prefetch.append(key)
            budget -= num_bytes
        ssd_blocks = self.ssd_capacity_blocks
        ram_blocks = self.ram_capacity_blocks
        return MaintenancePlan(
            ssd_expiry_cutoff=self.ssd_expiry_cutoff(now), ssd_target_bytes=target,
            flush=snapshot.num_pending > 0, ram_target_bytes=self.ram_offload_line, prefetch=tuple(prefetch),
            ssd_evict_blocks=max(0, snapshot.ssd_held_blocks - int(ssd_blocks * self.ssd_low_water))
            if ssd_blocks else 0,
            ram_evict_blocks=max(0, snapshot.ram_held_blocks - int(ram_blocks * self.ram_offload_threshold))
            if ram_blocks else 0)


class DecayedFrequency(Generic[K]):
    """Exponentially decayed access counts per key, compared relative to the hottest key."""

    def __init__(self, half_life_s: float = 60.0) -> None:
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be positive, got {half_life_s}")
        self.half_life_s = half_life_s
        self._origin: float | None = None
        self._scores: dict[K, float] = {}
        self._hottest: K | None = None

    def __len__(self) -> int:
        return len(self._scores)

    def __contains__(self, key: object) -> bool:
        return key in self._scores

    def touch(self, key: K, now: float, weight: float = 1.0) -> None:
        if self._origin is None:
            self._origin = now
        base = (now - self._origin) / self.half_life_s
        old = self._scores.get(key)
        decayed = 0.0 if old is None else 2.0 ** (old - base)
        score = base + math.log2(decayed + weight)
        self._scores[key] = score
        if self._hottest is None or score >= self._scores[self._hottest]:
            self._hottest = key

    def frequency(self, key: K, now: float) -> float:
        """The decayed count at `now` (0 for an unknown key)."""
        score = self._scores.get(key)
        if score is None or self._origin is None:
            return 0.0
        return float(2.0 ** (score - (now - self._origin) / self.half_life_s))

    def relative(self, key: K) -> float:
        """This key's frequency divided by the hottest key's, in [0, 1]."""
        score = self._scores.get(key)
        if score is None or self._hottest is None:
            return 0.0
        return float(2.0 ** (score - self._scores[self._hottest]))

    def forget(self, key: K) -> None:
        if self._scores.pop(key, None) is not None and key == self._hottest:
            self._hottest = max(self._scores, key=self._scores.__getitem__) if self._scores else None
