"""Pulling the missing part of a prefix from peers: runs per owner, concurrently, with fallback.

    LoadPlan (plan.py) ──► its runs [(node, start, end, alternates)], concurrently
    each run: pull every (block, layer) of the run from its node; a MISS, an error or a timeout moves
    the blocks still incomplete to the next alternate; when none is left, a next round plans the
    rest over the owners not seen failing (plan_pulls); what is still missing then stays missing.

For a layer-wise consumer a run is asked layer-major (layer 0 of every block first, so it can start
early). Otherwise it is asked block-major: the run's slots in `out` ([blocks, layers, bytes]) are
then one contiguous region in the order asked, handed to the transport as `into`, and TLS-TCP
receives runs of hits straight into their slots (no copy of the pulled bytes on this side).

The transport has already checked every payload against the digest its authenticated peer
announced; here a result is also checked to be an address we asked for and of the exact size
the namespace implies, so a peer cannot fill the wrong slot, and its provenance is checked: the
digest must be the one the block's producer signed, for this namespace, block and layer, with a
certificate of the cluster CA that is not revoked (transports/trust/provenance_check.py). A payload that
fails is a miss counted by reason (`PullOutcome.rejections`), never filled, so never mirrored or
advertised, and its peer's blocks move to the next owner. The answer is the leading run of
blocks complete in every layer — any failure makes a shorter hit, never wrong KV.

One record per block: the first record a block's layer is accepted under is the block's; a layer
under any other record (a peer interleaving two producers' layers) is refused as `mixed_records`.
A block-major pull then drops what it had of that block and asks the next owner for the whole
block; a layer-wise consumer may have read the accepted layers already, so there the block
completes under its first record or stays missing. So every block a load returns, and every
mirror it makes, carries exactly one producer's record, which purge and revocation can find.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from cluster.node.plan import LoadPlan
from cluster.planner import PullRun, plan_pulls
from fabric.keys import BlockAddress
from fabric.provenance import Rejection
from transports.core.base import Hit, TransportClient
from transports.core.codec import ProtocolError
from transports.trust.certs import CertificateError

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PullOutcome:
    """What a load's pulls did: counts for the node's metrics, and one sample per attempt on a peer."""

    num_bytes: int = 0
    num_failures: int = 0          # a peer that errored or timed out
    num_fallbacks: int = 0         # tries of a run (or its rest) on another owner than the one planned first
    said_yes_owner_no: int = 0     # runs whose owner answered MISS for what the directory said it held
    rejections: dict[Rejection, int] = field(default_factory=dict)   # payloads whose provenance failed
    samples: list[PullSample] = field(default_factory=list)   # one per attempt on a peer, for estimates


@dataclass(frozen=True, slots=True)
class PullSample:
    """One attempt to pull a run from a peer: what arrived, how long it took, whether it failed.
    `cut` attempts were cancelled (the load's deadline) before they finished."""

    node_id: str
    num_bytes: int
    seconds: float
    first_s: float | None     # until the first answer (None: none came)
    failed: bool = False
    cut: bool = False


async def pull_prefix(client: TransportClient, plan: LoadPlan, *, timeout_s: float, max_rounds: int = 3,
                      outcome: PullOutcome | None = None) -> PullOutcome:
    """Fill `plan.out[b]` for the plan's blocks `num_local..num_blocks` from their owners.

    The first round pulls the plan's runs concurrently, each falling back to its alternates; a
    later round plans runs again over the owners not yet seen failing, from the first incomplete
    block. Only payloads whose provenance `plan.checks` accepts are filled; `plan.provenance[b]`
    gets the record block b was accepted under. `outcome` (made here when not given) collects
    counts and one `PullSample` per attempt, also when the caller cancels the pull midway (its deadline).
    """
    outcome = outcome if outcome is not None else PullOutcome()
    progress, owners, peers = plan.progress, plan.owners, plan.peers
    bad: set[str] = set()
    runs = plan.runs
    for round_ in range(max_rounds):
        first = progress.complete_blocks()
        if first >= progress.num_blocks:
            break
        if round_:   # some owner failed: plan what is left over the others
            usable = [() if i < first else tuple(o for o in owners[i] if o not in bad and o in peers)
                      for i in range(progress.num_blocks)]
            runs = plan_pulls(usable, first, hashes=plan.hashes)
        if not runs:
            break
        await asyncio.gather(*(_pull_run(client, plan, run, outcome, bad, timeout_s, retry=round_ > 0)
                               for run in runs))
    return outcome


async def _pull_run(client: TransportClient, plan: LoadPlan, run: PullRun, outcome: PullOutcome, bad: set[str],
                    timeout_s: float, *, retry: bool) -> None:
    """Pull `run` from its node, then from each alternate while blocks of it are missing. `retry`:
    the run is a later round's (its blocks' first owner failed), so its every attempt is a fallback."""
    out, digests, progress, sources, provs = plan.out, plan.digests, plan.progress, plan.sources, plan.checks
    hashes, layer_major = plan.hashes, plan.layer_major
    num_layers, nbytes = out.shape[1], out.shape[2]
    for attempt, node_id in enumerate((run.node_id, *run.alternates)):
        peer = plan.peers.get(node_id)
        if layer_major:
            missing = [(b, layer) for layer in range(num_layers) for b in range(run.start, run.end)
                       if not progress.done[b, layer]]
        else:
            missing = [(b, layer) for b in range(run.start, run.end) for layer in range(num_layers)
                       if not progress.done[b, layer]]
        if not missing:
            return
        # Every slot of the run still missing, block-major: they are `out[run.start:run.end]` in order.
        flat = out[run.start:run.end].reshape(-1) if not layer_major and \
            len(missing) == (run.end - run.start) * num_layers and out.flags.c_contiguous else None
        if peer is None or node_id in bad:
            continue
        if attempt or retry:   # counted once per try on another owner than the blocks' first
            outcome.num_fallbacks += 1
        slot = {BlockAddress(hashes[b], layer): (b, layer) for b, layer in missing}
        got_miss = False
        refused: dict[Rejection, int] = {}   # this attempt's provenance rejections, by reason
        mixed: set[int] = set()              # blocks this peer served under two records: the rest is ignored
        source = f"peer:{node_id}"
        check, namespace, tenants, rejections = provs.verifier.check, provs.namespace, provs.tenants, \
            outcome.rejections
        started, first_s, got_bytes = time.perf_counter(), None, 0
        try:
            async with asyncio.timeout(timeout_s):
                into = None if flat is None else memoryview(flat)  # type: ignore[arg-type]  # numpy's buffer stubs
                async for result in client.pull(peer, list(slot), into=into, namespace=namespace):
                    where = slot.get(result.address)
                    if where is None:
                        logger.warning("peer %s answered an address it was not asked for; ignored", node_id)
                        continue
                    if first_s is None:
                        first_s = time.perf_counter() - started
                    if not isinstance(result, Hit):
                        got_miss = True
                        continue
                    b, layer = where
                    if b in mixed:
                        continue
                    view = memoryview(result.payload)
                    if view.nbytes != nbytes:
                        logger.warning("peer %s sent %d bytes for a %d-byte block; ignored", node_id,
                                       view.nbytes, nbytes)
                        continue
                    rejected = check(result.provenance, namespace, result.address.hash, layer, result.digest,
                                     tenants=tenants)
                    if rejected is None and provs.quarantined and result.provenance is not None and \
                            result.provenance.producer in provs.quarantined:
                        rejected = Rejection.QUARANTINED
                    if rejected is not None:
                        rejections[rejected] = rejections.get(rejected, 0) + 1
                        refused[rejected] = refused.get(rejected, 0) + 1
                        continue
                    if not provs.accept(b, result.provenance):
                        rejected = Rejection.MIXED_RECORDS
                        rejections[rejected] = rejections.get(rejected, 0) + 1
                        refused[rejected] = refused.get(rejected, 0) + 1
                        if not layer_major:   # nothing of it was handed on yet: the next owner sends it whole
                            mixed.add(b)
                            progress.unfill_block(b)
                            provs.forget(b)
                        continue
                    if flat is None or view.obj is not flat:   # type: ignore[comparison-overlap]  # not received in its slot: copied there
                        out[b, layer] = np.frombuffer(view, dtype=np.uint8)
                    digests[b][layer] = result.digest
                    sources[b] = source
                    outcome.num_bytes += nbytes
                    got_bytes += nbytes
                    progress.fill(b, layer)
        except asyncio.CancelledError:   # the load's deadline: what arrived so far says how slow this peer is
            outcome.samples.append(PullSample(node_id, got_bytes, time.perf_counter() - started, first_s, cut=True))
            raise
        except (TimeoutError, OSError, ProtocolError, CertificateError) as e:
            outcome.samples.append(PullSample(node_id, got_bytes, time.perf_counter() - started, first_s,
                                              failed=True))
            outcome.num_failures += 1
            bad.add(node_id)
            logger.info("pull of blocks %d..%d from %s failed (%s); trying the next owner",
                        run.start, run.end, node_id, type(e).__name__ if str(e) == "" else e)
            continue
        outcome.samples.append(PullSample(node_id, got_bytes, time.perf_counter() - started, first_s))
        if refused:   # a peer that serves what its producer did not sign is not asked again in this load
            bad.add(node_id)
            logger.warning("peer %s served blocks %d..%d without valid provenance (%s); trying the next owner",
                           node_id, run.start, run.end, ", ".join(f"{r.value}: {n}" for r, n in refused.items()))
        if got_miss:
            bad.add(node_id)
            outcome.said_yes_owner_no += 1
