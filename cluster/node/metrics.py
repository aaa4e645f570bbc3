"""Prometheus metrics of a NodeActor's cluster side (the Store and transports export their own).

All live in the node's own `CollectorRegistry`, served on `[cluster] metrics_port` at /metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cluster.directory.breaker import CircuitBreaker
from fabric.counters import CountedCounter


def _breaker_value(breaker: CircuitBreaker) -> float:
    return float(breaker.state.value)


class ClusterMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.lookups = Counter("kvfabric_lookups_total", "lookup / load requests served by this node",
                               registry=registry)
        self.lookup_seconds = Histogram("kvfabric_prefix_lookup_seconds",
                                        "Time to answer a prefix lookup (local + directory)",
                                        registry=registry,
                                        buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0))
        self.load_seconds = Histogram("kvfabric_load_seconds", "Time to answer a load (local reads + pulls)",
                                      registry=registry,
                                      buckets=(0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0))
        # Counted in code as well (fabric/counters.py): `stats()` reports these without reading the registry.
        self.requested_blocks = CountedCounter("kvfabric_requested_blocks_total", "Full blocks asked for by load",
                                               registry=registry)
        self.hit_blocks = CountedCounter("kvfabric_hit_blocks_total",
                                         "Blocks a load returned, by where they came from", ["source"],
                                         registry=registry)
        self.said_yes_owner_no = CountedCounter("kvfabric_directory_said_yes_owner_said_no_total",
                                                "Pull runs whose owner, named by the directory, did not have the "
                                                "blocks", registry=registry)
        self.pull_failures = Counter("kvfabric_pull_failures_total",
                                     "Pull runs that failed on a peer (error, timeout, dead peer)", registry=registry)
        self.fallbacks = Counter("kvfabric_pull_fallbacks_total", "Pull runs retried on another owner",
                                 registry=registry)
        self.provenance_rejections = CountedCounter(
            "kvfabric_provenance_rejections_total",
            "Pulled payloads refused because their producer's signature did not hold, by reason",
            ["reason"], registry=registry)
        self.disagreements = Counter("kvfabric_producer_disagreements_total",
                                     "Blocks whose owners held different bytes at one address, by the producer of "
                                     "the version taken (the first reported) and of the one passed over",
                                     ["first_producer", "other_producer"], registry=registry)
        self.disputed_blocks = Counter("kvfabric_disputed_blocks_total",
                                       "Blocks a load treated as a miss: their leading versions are held by as many "
                                       "independent producers each", registry=registry)
        self.crl_reloads = Counter("kvfabric_crl_reloads_total",
                                   "New revocation lists a node read, by outcome: loaded, or refused (unreadable or "
                                   "not signed by the CA: the node keeps the list it had)", ["outcome"],
                                   registry=registry)
        self.crl_seconds_left = Gauge("kvfabric_crl_seconds_to_next_update",
                                      "Seconds until the CA's revocation list (crl.pem) passes its nextUpdate, after "
                                      "which every handshake is refused on both transports (+Inf: no list)",
                                      registry=registry)
        self.audits = Counter("kvfabric_audits_total",
                              "Pulled blocks recomputed by a sampled engine and compared with their producer's signed "
                              "payload, by outcome (equal, within the tolerance, mismatch)", ["outcome"],
                              registry=registry)
        self.audit_samples = Counter("kvfabric_audit_samples_total",
                                     "Loads with pulled blocks this node told its engine to recompute",
                                     registry=registry)
        self.quarantines = Counter("kvfabric_quarantines_total",
                                   "Producers this node learned are quarantined, by who caught them",
                                   ["producer", "checker"], registry=registry)
        self.quarantined = Gauge("kvfabric_quarantined_producers", "Producers quarantined now (pullers refuse their "
                                 "records, their blocks are dropped)", registry=registry)
        self.purged = Counter("kvfabric_purged_blocks_total", "(block, layer) payloads removed by purge --producer",
                              registry=registry)
        self.resyncs = Counter("kvfabric_directory_resyncs_total", "Full resyncs of this node's entries, by reason",
                               ["reason"], registry=registry)
        self.batches = Counter("kvfabric_directory_batches_total", "Register/unregister batches by outcome",
                               ["outcome"], registry=registry)
        self.breaker_state = Gauge("kvfabric_directory_breaker_state",
                                   "Each directory shard's breaker: 0 closed, 1 open (lookups answer local-only), "
                                   "2 probing", ["shard"], registry=registry)
        self.peer_bandwidth = Gauge("kvfabric_peer_bandwidth_bytes_per_second",
                                    "Pull bandwidth per peer (EWMA of this node's pulls from it)", ["peer"],
                                    registry=registry)
        self.peer_rtt = Gauge("kvfabric_peer_rtt_seconds", "Time to a peer's first answer (EWMA)", ["peer"],
                              registry=registry)
        self.prefill_rate = Gauge("kvfabric_prefill_tokens_per_second",
                                  "Prefill rate the engines report, per namespace", ["namespace"], registry=registry)
        self.engine_load = Gauge("kvfabric_engine_load", "What this node's engines last reported",
                                 ["kind"], registry=registry)
        self.skipped_blocks = Counter("kvfabric_pull_skipped_blocks_total",
                                      "Blocks a peer held that a load did not pull: recomputing them was expected "
                                      "to be faster", registry=registry)
        self.deadline_cuts = Counter("kvfabric_load_deadline_cuts_total",
                                     "Loads whose pulls were cut at their deadline (the leading run that arrived "
                                     "was returned)", registry=registry)

    def watch_breakers(self, breakers: Sequence[CircuitBreaker]) -> None:
        """Export each directory shard's breaker state (`breakers[k]` is shard k's) as it is when scraped."""
        for k, breaker in enumerate(breakers):
            self.breaker_state.labels(str(k)).set_function(partial(_breaker_value, breaker))
