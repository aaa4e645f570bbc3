"""The node's side of the directory: `DirectoryClient` routes hashes to shards (`shard_of`), merges
their answers and tracks each shard's epoch.

A dead, restarting or stalled shard becomes "no owners" (a hint that is missing is a miss, never an
error for the engine). A lookup waits at most `[cluster] directory_lookup_timeout_s` for a shard;
after a timeout that shard's `CircuitBreaker` opens and lookups answer local-only at once, while one
probe at a time checks whether the shard answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from cluster.directory.actor import SHARD_DOWN, shard_actor_name
from cluster.directory.breaker import BreakerState, CircuitBreaker
from cluster.directory.report import Report
from cluster.directory.types import ApplyOutcome, NodeAddress, shard_of
from cluster.directory.upkeep import ShardUnavailable
from fabric.config import ClusterConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Located:
    """The merged answer of every shard for one run of hashes."""

    owners: tuple[tuple[str, ...], ...]
    addresses: dict[str, NodeAddress]
    versions: tuple[tuple[bytes, ...], ...] = ()   # per hash, each owner's block version (LocateReply)
    firsts: tuple[bytes, ...] = ()                 # per hash, the first-reported version still held


class DirectoryClient:
    """A node's view of the sharded directory: routing, merging, and epoch tracking."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.num_shards = config.directory_shards
        self.call_timeout_s = config.directory_call_timeout_s
        self.lookup_timeout_s = config.directory_lookup_timeout_s
        self._handles: dict[int, ray.actor.ActorHandle] = {}
        self.epochs: dict[int, str] = {}
        self.breakers = [CircuitBreaker(config.directory_probe_s) for _ in range(self.num_shards)]
        self.num_skipped = 0     # lookups of a shard answered local-only because its breaker was open
        self._probes: set[asyncio.Task[None]] = set()

    def handle(self, shard: int) -> ray.actor.ActorHandle:
        h = self._handles.get(shard)
        if h is None:
            h = ray.get_actor(shard_actor_name(self.config, shard), namespace=self.config.namespace)
            self._handles[shard] = h
        return h

    def split(self, hashes: Sequence[bytes]) -> dict[int, list[int]]:
        """Positions of `hashes` per shard."""
        out: dict[int, list[int]] = {}
        for i, h in enumerate(hashes):
            out.setdefault(shard_of(h, self.num_shards), []).append(i)
        return out

    async def _invoke(self, shard: int, what: str, remote: Callable[[Any], Any], timeout_s: float | None = None
                      ) -> Any:
        breaker = self.breakers[shard]
        try:
            handle = self.handle(shard)
        except ValueError:  # get_actor: the shard has not been created (yet)
            breaker.failure(time.monotonic())
            raise ray.exceptions.RayActorError() from None
        try:
            epoch, *answer = await asyncio.wait_for(remote(handle), timeout_s or self.call_timeout_s)
        except SHARD_DOWN:
            self._handles.pop(shard, None)
            if breaker.state is BreakerState.CLOSED:
                logger.warning("directory shard %d did not answer %s in time: lookups answer local-only "
                               "until it does", shard, what)
            breaker.failure(time.monotonic())
            raise
        if breaker.state is not BreakerState.CLOSED:
            logger.info("directory shard %d answers again", shard)
        breaker.success()
        self.epochs[shard] = epoch
        return answer[0] if len(answer) == 1 else tuple(answer)

    # ---- the calls a node's DirectoryUpkeep makes (DirectoryApi) ----------------------------------------

    def epoch(self, shard: int) -> str | None:
        return self.epochs.get(shard)

    async def report(self, report: Report) -> ApplyOutcome:
        """Hand a signed report to its shard; raises `ShardUnavailable` when the shard does not answer."""
        try:
            outcome: ApplyOutcome = await self._invoke(report.shard, report.op.value,
                                                       lambda h: h.report.remote(report))
        except SHARD_DOWN as e:
            raise ShardUnavailable(f"directory shard {report.shard} did not answer {report.op.value}: "
                                   f"{type(e).__name__}") from None
        return outcome

    def _probe_if_due(self, shard: int) -> None:
        """Send the one probe of an open breaker, off the request path."""
        if not self.breakers[shard].take_probe(time.monotonic()):
            return

        async def probe() -> None:
            # On failure call() re-opens the breaker; the next lookup after probe_s probes again.
            with contextlib.suppress(*SHARD_DOWN):
                await self._invoke(shard, "probe", lambda h: h.probe.remote())

        task = asyncio.get_running_loop().create_task(probe())
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def locate(self, hashes: Sequence[bytes], exclude: Collection[str]) -> Located:
        """Live owners per hash; a shard that does not answer contributes no owners."""
        owners: list[tuple[str, ...]] = [()] * len(hashes)
        versions: list[tuple[bytes, ...]] = [()] * len(hashes)
        firsts: list[bytes] = [b""] * len(hashes)
        addresses: dict[str, NodeAddress] = {}
        parts = self.split(hashes)

        async def one(shard: int, positions: list[int]) -> None:
            if not self.breakers[shard].allow():
                self.num_skipped += 1
                self._probe_if_due(shard)
                return
            try:
                asked = [hashes[i] for i in positions]
                reply, addrs = await self._invoke(shard, "locate", lambda h: h.locate.remote(asked, list(exclude)),
                                                  self.lookup_timeout_s)
            except SHARD_DOWN as e:
                logger.info("directory shard %d did not answer a lookup (%s): treating as no owners",
                            shard, type(e).__name__)
                return
            for i, per_hash in zip(positions, reply.owners, strict=True):
                owners[i] = tuple(per_hash)
            for i, per_owner, first in zip(positions, reply.versions, reply.firsts, strict=False):
                versions[i], firsts[i] = per_owner, first
            addresses.update(addrs)

        await asyncio.gather(*(one(s, pos) for s, pos in parts.items()))
        known = any(firsts)
        return Located(tuple(owners), addresses, tuple(versions) if known else (), tuple(firsts) if known else ())

    def breaker_stats(self) -> dict[str, Any]:
        return {"breaker_states": [b.state.name.lower() for b in self.breakers],
                "breaker_opened": sum(b.num_opened for b in self.breakers),
                "lookups_answered_local_only": self.num_skipped}

    async def unbind(self, node_id: str, token: bytes | None) -> dict[int, str | None]:
        """The operator's call on every shard: per shard, the certificate name `node_id` was bound to.
        Raises TenantRefusedError without an operator's `token`; a shard that does not answer raises too."""
        out: dict[int, str | None] = {}
        for k in range(self.num_shards):
            out[k] = await self._invoke(k, "unbind", lambda h: h.unbind.remote(node_id, token))
        return out

    async def stats(self) -> list[dict[str, Any]]:
        out = []
        for k in range(self.num_shards):
            try:
                out.append(await self._invoke(k, "stats", lambda h: h.stats.remote()))
            except SHARD_DOWN as e:
                out.append({"shard": k, "error": type(e).__name__})
        return out
