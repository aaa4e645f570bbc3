"""A store's books: what it holds and how it is used (the held addresses with their STORED /
REMOVED events, access frequency, the accesses the next maintenance pass needs), and its counts (no I/O).

    held          storage key -> BlockAddress of every (block, layer) in any tier whose hash is known;
                  a key enters with a STORED event (`hold`) and leaves with a REMOVED event (`forget`)
    freq          decayed access frequency per key (the planner's prefetch input)
    touched_ssd   keys accessed since the last pass while only on SSD (prefetch candidates)
    touched_rows  keys whose index row holds a last-seen time LAST_SEEN_RESOLUTION_S old or more

`Holdings` is the one writer of these; the store calls it under its lock. Costs: O(1) per call,
O(held) for a listing.

`StoreCounters` is what `Store.stats()` reports: plain integers counted where things happen (under
the store's lock), so stats never read numbers back out of Prometheus. It feeds the Prometheus
metrics at the same points, for export only; it is the one writer of both.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from fabric.events import EventKind, StoreEventLog, StoreEvents
from fabric.eviction import DecayedFrequency
from fabric.keys import BlockAddress, StorageKey
from fabric.metrics import StoreMetrics
from fabric.store_types import PutResult
from fabric.tiers.base import Tier

# An index row's last-seen time is refreshed once it is this much older than the block's: TTL
# expiry (days) and the LRU order after a restart do not need it finer.
LAST_SEEN_RESOLUTION_S = 60.0


class Holdings:
    """Held addresses, their events and their accesses (module docstring). Not locked itself."""

    def __init__(self, max_events: int, half_life_s: float, held: Iterable[tuple[StorageKey, BlockAddress]]) -> None:
        self._held: dict[StorageKey, BlockAddress] = dict(held)
        self._events = StoreEventLog(max_events)
        self._freq: DecayedFrequency[StorageKey] = DecayedFrequency(half_life_s)
        self._touched_ssd: set[StorageKey] = set()
        self._touched_rows: set[StorageKey] = set()

    # ---- held addresses and events -----------------------------------------------------------------

    def hold(self, key: StorageKey, address: BlockAddress) -> None:
        """An acknowledged put: queue STORED unless the key was held already."""
        if key not in self._held:
            self._held[key] = address
            self._events.append(EventKind.STORED, address)

    def forget(self, key: StorageKey) -> None:
        """The key left its last tier: drop its bookkeeping, queue REMOVED."""
        self._freq.forget(key)
        self._touched_ssd.discard(key)
        self._touched_rows.discard(key)
        address = self._held.pop(key, None)
        if address is not None:
            self._events.append(EventKind.REMOVED, address)

    def items(self) -> Iterator[tuple[StorageKey, BlockAddress]]:
        return iter(self._held.items())

    def addresses(self) -> list[BlockAddress]:
        return list(self._held.values())

    def take_events(self, max_events: int | None = None) -> StoreEvents:
        return self._events.take(max_events)

    @property
    def num_events(self) -> int:
        return len(self._events)

    # ---- accesses ----------------------------------------------------------------------------------

    def accessed(self, key: StorageKey, now: float, row_stale: bool, ssd_only: bool = False) -> None:
        """One access of `key`. `row_stale`: its index row's last-seen time is LAST_SEEN_RESOLUTION_S
        behind (rewritten at the next pass: a pull that reads 7,680 (block, layer) rows again and
        again would rewrite all of them every second otherwise). `ssd_only`: it is not in RAM."""
        self._freq.touch(key, now)
        if row_stale:
            self._touched_rows.add(key)
        if ssd_only:
            self._touched_ssd.add(key)

    def relative_frequency(self, key: StorageKey) -> float:
        return self._freq.relative(key)

    def take_touched_ssd(self) -> set[StorageKey]:
        """The keys accessed on SSD alone since the last call (the planner's prefetch candidates)."""
        touched, self._touched_ssd = self._touched_ssd, set()
        return touched

    def take_touched_rows(self) -> set[StorageKey]:
        """The keys whose index row is due for a last-seen rewrite, since the last call."""
        touched, self._touched_rows = self._touched_rows, set()
        return touched


class StoreCounters:
    """Monotonic counts since open, and their Prometheus twins; call under the store's lock."""

    def __init__(self, metrics: StoreMetrics) -> None:
        self._metrics = metrics
        self._put_rejected = {r.value: 0 for r in PutResult if not r.ok}
        self._evictions = {Tier.RAM.value: 0, Tier.SSD.value: 0}
        self._corrupt_blocks = {Tier.RAM.value: 0, Tier.SSD.value: 0}
        self._reconciled: dict[str, int] = {}
        self._flush_failures = 0

    def rejected(self, result: PutResult) -> PutResult:
        """Count a refused put; returns `result`."""
        self._put_rejected[result.value] += 1
        self._metrics.put_rejected.labels(result.value).inc()
        return result

    def evicted(self, tier: Tier, n: int) -> None:
        if n:
            self._evictions[tier.value] += n
            self._metrics.evictions.labels(tier.value).inc(n)

    def corrupt(self, tier: Tier) -> None:
        """A block that failed verification was removed (the exported counter is fed by the read's
        own observation, `StoreMetrics.observe_corrupt`, or by `verify`)."""
        self._corrupt_blocks[tier.value] += 1

    def reconciled(self, action: str, n: int = 1, *, export: bool = True) -> None:
        self._reconciled[action] = self._reconciled.get(action, 0) + n
        if export:
            self._metrics.reconciled.labels(action).inc(n)

    def reconciled_counts(self) -> dict[str, int]:
        return dict(self._reconciled)

    def flush_failed(self) -> None:
        self._flush_failures += 1

    def snapshot(self) -> dict[str, object]:
        return {"reconciled": dict(self._reconciled), "corrupt_blocks": dict(self._corrupt_blocks),
                "evictions": dict(self._evictions), "put_rejected": dict(self._put_rejected),
                "flush_failures": self._flush_failures}
