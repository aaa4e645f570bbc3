"""kvfabric configuration: one TOML file with sections [kv], [transport], [cluster], [events], [tenancy],
[audit].

Every key has a default that works on a laptop. Unknown sections or keys and values of the wrong
type or range raise `ConfigError` naming the file, the key and what was expected, so a typo never
silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, get_args, get_origin, get_type_hints

from fabric.errors import FabricError
from fabric.keys import Namespace
from fabric.layout import KVLayout


class ConfigError(FabricError, ValueError):
    """The configuration file or a value in it is invalid."""


HOME_ENV: Final = "KVFABRIC_HOME"
NODE_NAME_ENV: Final = "KVFABRIC_NODE_NAME"
ADVERTISE_HOST_ENV: Final = "KVFABRIC_ADVERTISE_HOST"


@dataclass(frozen=True, slots=True)
class Environment:
    """What kvfabric takes from a process's environment, read here and nowhere else.

    `home` ($KVFABRIC_HOME, else ~/.cache/kvfabric): the root of every default path. `node_name`
    ($KVFABRIC_NODE_NAME; "": derived from the Ray node id): a node's certificate name, e.g. the
    Kubernetes pod's, so a restarted pod finds its SSD blocks again under a new Ray node id.
    `advertise_host` ($KVFABRIC_ADVERTISE_HOST; "": the Ray node's IP address): the host a node
    listening on every interface advertises, a name its certificate carries."""

    home: Path
    node_name: str = ""
    advertise_host: str = ""

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> Environment:
        env = os.environ if environ is None else environ
        return cls(Path(env.get(HOME_ENV) or Path.home() / ".cache" / "kvfabric"), env.get(NODE_NAME_ENV, ""),
                   env.get(ADVERTISE_HOST_ENV, ""))


def kvfabric_home() -> Path:
    """The root of every default path: `$KVFABRIC_HOME`, else `~/.cache/kvfabric`."""
    return Environment.read().home


# The [transport] defaults, in one place: `TransportConfig` and every transport's constructor and
# session take theirs from here (a transport built without a config behaves as the default config).
MAX_PAYLOAD_BYTES: Final = 64 * 1024 * 1024   # largest frame payload a peer may send
MAX_DATAGRAM_SIZE: Final = 8952               # QUIC: a 9000-byte MTU minus IP/UDP headers; 1452 for Ethernet
QUIC_MAX_DATA: Final = 8 * 1024 * 1024         # QUIC connection flow-control window
QUIC_MAX_STREAM_DATA: Final = 4 * 1024 * 1024  # QUIC per-stream flow-control window
MAX_INFLIGHT: Final = 32                       # PULLs a server works on at once per connection
CONNECT_TIMEOUT_S: Final = 5.0                 # dial + handshake (a server's handshake deadline too)
IDLE_TIMEOUT_S: Final = 30.0                   # a connection idle this long is closed
FRAME_TIMEOUT_S: Final = 10.0                  # a frame arrives whole, and a waiting pull hears, within this
MAX_CONNECTIONS_PER_PEER: Final = 8            # per peer node, on each transport (past it: ERROR overloaded)
QUIC_MAX_HALF_OPEN: Final = 128                # QUIC connections mid-handshake, in total ...
QUIC_MAX_HALF_OPEN_PER_ADDRESS: Final = 16     # ... and from one source address
PEER_PULLS_PER_S: Final = 1000.0               # PULLs one peer node may start per second ...
PEER_PULL_BURST: Final = 2000.0                # ... and at once after being idle
PEER_BYTES_PER_S: Final = 4.0 * (1 << 30)      # payload bytes one peer node may be served per second ...
PEER_BYTES_BURST: Final = 4.0 * (1 << 30)      # ... and at once after being idle
NODE_BYTES_PER_S: Final = 8.0 * (1 << 30)      # payload bytes all peers together, shared fairly when short ...
NODE_BYTES_BURST: Final = 8.0 * (1 << 30)      # ... and at once after being idle
NODE_HANDSHAKES_PER_S: Final = 200.0           # TLS / QUIC handshakes begun, all sources, shared fairly ...
NODE_HANDSHAKE_BURST: Final = 400.0            # ... and at once after being idle
IO_THREADS: Final = 4                          # threads for slow (disk) reads, in the store and the servers
LEASE_S: Final = 10.0                          # a node silent this long is never returned as an owner
DIRECTORY_PROBE_S: Final = 0.5                 # after a shard timed out, probe it this often (lookups skip it)

TransportKind = Literal["quic", "tls-tcp", "rdma"]
QuicBackendName = Literal["auto", "aioquic", "qh3"]


@dataclass(slots=True)
class KVConfig:
    ram_gib: float = 1.0
    ram_blocks: int = 0                  # at most this many blocks (all their layers) in RAM too (0: bytes only)
    ssd_dir: str = str(kvfabric_home() / "ssd")
    ssd_gib: float = 8.0
    ssd_blocks: int = 0                  # at most this many blocks on SSD too (0: bytes only)
    ssd_ttl_s: float = 7 * 24 * 3600.0
    index_dir: str = str(kvfabric_home() / "index")
    mirror_pulls: bool = True
    mirror_delay_s: float = 1.0          # a pull's mirror starts this long after its load returned
    block_size: int = 16
    write_through: bool = False          # True: put() returns after the SSD copy is fsynced
    durable: bool = True                 # fsync SSD files and folders
    o_direct: bool = True                # use O_DIRECT reads where the filesystem allows it
    eviction_interval_s: float = 1.0
    ram_high_water: float = 1.25         # past ram_gib * this, put() answers "full"
    io_threads: int = IO_THREADS
    gpu_offload_threshold: float = 0.85
    cpu_offload_threshold: float = 0.90
    prefetch_threshold: float = 0.7
    ssd_low_water: float = 0.9           # SSD eviction trims down to ssd_gib * this
    frequency_half_life_s: float = 60.0  # decay of the access frequency behind prefetch
    event_queue_max: int = 100_000       # store events not yet taken; past it: cleared, overflowed=True
    background_nice: int = 10            # write-behind flush, eviction, mirroring run this much nicer (0: off)
    reply_pool_gib: float = 0.5          # load reply arrays a NodeActor keeps for reuse (0: a fresh one per load)

    def namespace(self, model_id: str, layout: KVLayout, *, weights_fingerprint: str = "", shard: int = 0,
                  num_shards: int = 1, tenant_salt: bytes = b"") -> Namespace:
        """The namespace of a model's blocks with this node's `block_size`: every process that builds
        its keys here agrees on the block size, so their hashes match."""
        return Namespace(model_id, layout, self.block_size, weights_fingerprint=weights_fingerprint,
                         shard=shard, num_shards=num_shards, tenant_salt=tenant_salt)


@dataclass(slots=True)
class TransportConfig:
    kind: TransportKind = "tls-tcp"
    host: str = "127.0.0.1"
    quic_port: int = 0
    quic_backend: QuicBackendName = "auto"       # QUIC library: qh3 when installed (auto), or pinned
    tcp_port: int = 0
    cert_dir: str = str(kvfabric_home() / "certs")
    node_name: str = "node-0"
    max_payload_bytes: int = MAX_PAYLOAD_BYTES
    max_datagram_size: int = MAX_DATAGRAM_SIZE
    quic_max_data: int = QUIC_MAX_DATA
    quic_max_stream_data: int = QUIC_MAX_STREAM_DATA
    quic_max_half_open: int = QUIC_MAX_HALF_OPEN
    quic_max_half_open_per_address: int = QUIC_MAX_HALF_OPEN_PER_ADDRESS
    max_connections_per_peer: int = MAX_CONNECTIONS_PER_PEER
    peer_pulls_per_s: float = PEER_PULLS_PER_S
    peer_pull_burst: float = PEER_PULL_BURST
    peer_bytes_per_s: float = PEER_BYTES_PER_S
    peer_bytes_burst: float = PEER_BYTES_BURST
    node_bytes_per_s: float = NODE_BYTES_PER_S
    node_bytes_burst: float = NODE_BYTES_BURST
    node_handshakes_per_s: float = NODE_HANDSHAKES_PER_S
    node_handshake_burst: float = NODE_HANDSHAKE_BURST
    connect_timeout_s: float = CONNECT_TIMEOUT_S
    idle_timeout_s: float = IDLE_TIMEOUT_S
    frame_timeout_s: float = FRAME_TIMEOUT_S
    max_inflight: int = MAX_INFLIGHT
    send_rate_mb_s: float = 0.0                  # TLS-TCP: MB/s this node serves at most, all peers (0: no cap)


@dataclass(slots=True)
class ClusterConfig:
    directory_name: str = "kvfabric-directory"   # shard k's actor is named f"{directory_name}-{k}"
    namespace: str = "kvfabric"                  # Ray namespace of every fabric actor
    heartbeat_s: float = 2.0
    lease_s: float = LEASE_S
    num_nodes: int = 2                           # `kvfabric up` default
    directory_shards: int = 1                    # the directory is split by block hash over this many actors
    metrics_port: int = 9108                     # each NodeActor serves /metrics here (0: any free port)
    flush_ms: float = 5.0                        # register/unregister batches leave after this long ...
    flush_blocks: int = 512                      # ... or this many block hashes, whichever first
    queue_max: int = 65536                       # pending directory updates; past it: resync, never drop
    resync_batch: int = 4096                     # hashes per resync call
    resync_jitter_s: float = 0.5                 # nodes spread their resyncs after a directory restart
    pull_timeout_s: float = 10.0                 # a pull from one owner is abandoned after this
    directory_lookup_timeout_s: float = 0.5      # a lookup waits this long for a shard, then answers local-only
    directory_call_timeout_s: float = 5.0        # batches, heartbeats, resyncs and probes wait this long
    directory_probe_s: float = DIRECTORY_PROBE_S
    directory_resource: str = "node:__internal_head__"   # Ray resource the shards are placed by ("": anywhere)
    client_timeout_s: float = 120.0              # a FabricClient call waits this long for its NodeActor


@dataclass(slots=True)
class EventsConfig:
    """KV events in vLLM's format, published by each NodeActor (docs/kv-events.md). Off by default.

    In an endpoint or the topic, `{node}` is replaced by the node's name (one ipc path per node on a
    shared host). As in vLLM, the PUB socket binds a wildcard, ipc or inproc endpoint and connects to
    any other; a TCP port `*` binds any free port (the NodeActor's `stats()` reports the one it got).
    The replay socket always binds. An endpoint other hosts can reach needs CURVE (`curve_*`); with
    `[tenancy] required`, token ids go out only on ipc:// or CURVE endpoints (`exposure_error`).
    """

    enabled: bool = False
    endpoint: str = "ipc:///tmp/kvfabric-events/{node}.pub"   # ZMQ PUB: [topic, 8-byte seq, batch]
    replay_endpoint: str = ""          # ZMQ ROUTER serving the last batches from a sequence ("": none)
    topic: str = ""
    buffer_batches: int = 10_000       # batches kept for replay
    hwm: int = 100_000                 # ZMQ send high-water mark of the PUB and replay sockets
    replay_max_batches: int = 1_000    # batches in one replay reply (a marker says where to go on)
    replay_rate: float = 5_000.0       # batches per second one requester may replay
    replay_total_rate: float = 20_000.0   # batches and requests per second all requesters together
    curve_secret_key: str = ""         # the node's events key pair (`kvfabric certs events-key`): CURVE on
    curve_allow_dir: str = ""          # folder of the consumers' public keys allowed to subscribe
    curve_server_key: str = ""         # a connect endpoint's subscriber public key (the node is its client)
    token_ids_tenants: list[str] = field(default_factory=lambda: ["*"])   # whose token ids events show

    def curve(self) -> bool:
        return bool(self.curve_secret_key)


def endpoint_is_loopback(endpoint: str) -> bool:
    """ipc:// and inproc:// stay on the host; tcp:// only to 127.0.0.0/8, ::1 or localhost."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    return host.startswith("127.") or host in ("::1", "localhost")


def exposure_error(events: EventsConfig, tenancy_required: bool) -> str | None:
    """Why these events may not start as configured (None: they may). Other hosts reach only CURVE
    endpoints that check an allow-list; with tenancy required, tenants' token ids go out only where
    no other local user reads them either (ipc:// with its 0600 file, inproc://, or CURVE)."""
    if not events.enabled:
        return None
    if events.curve() and not events.curve_allow_dir and not events.curve_server_key:
        return ("events.curve_secret_key is set but neither events.curve_allow_dir (consumers allowed to "
                "subscribe) nor events.curve_server_key (the subscriber this node connects to) is")
    for key in ("endpoint", "replay_endpoint"):
        value = getattr(events, key)
        if value and not endpoint_is_loopback(value) and not events.curve():
            return (f"events.{key} {value} is reachable from other hosts without authentication: set "
                    "events.curve_secret_key and events.curve_allow_dir (`kvfabric certs events-key`), or use "
                    "a loopback or ipc:// endpoint")
    if tenancy_required and events.token_ids_tenants and not events.curve():
        open_tcp = [v for v in (events.endpoint, events.replay_endpoint) if v.startswith("tcp://")]
        if open_tcp:
            return (f"[tenancy] required = true, but KV events would show tenants' prompt token ids "
                    f"(events.token_ids_tenants = {events.token_ids_tenants}) on {open_tcp[0]}, which any local "
                    "process can read: configure CURVE (events.curve_secret_key, events.curve_allow_dir), use "
                    "ipc:// endpoints, or set events.token_ids_tenants = [] (or the tenants that opted in, "
                    "with CURVE)")
    return None


@dataclass(slots=True)
class TenancyConfig:
    """Tenants by certificate (docs/tenants.md). `required`: calls without a valid tenant token are
    refused (false: they are the anonymous tenant with the empty salt). `shared`: groups of tenant
    names that share one namespace (explicit opt-in). `credential`: a client's tenant certificate
    (`<name>.tenant.pem`, its key beside as `.key`; "": calls carry no token). `operator_credential`:
    the operator's (`<name>.operator.pem`), for the CLI's node-wide calls (`purge`, `stats`)."""

    required: bool = False
    shared: list[list[str]] = field(default_factory=list)
    credential: str = ""
    operator_credential: str = ""
    token_ttl_s: float = 300.0


@dataclass(slots=True)
class AuditConfig:
    """Sampled recompute of pulled KV and quarantine of a producer caught lying (fabric/audit.py,
    docs/security.md). Rates are probabilities per load that pulled blocks; the boosts multiply them
    for new, rarely checked and recently disputed producers (the largest that applies)."""

    rate: float = 0.01                    # default share of pulled loads recomputed and compared
    tenant_rates: dict[str, float] = field(default_factory=dict)    # per tenant name ("" anonymous)
    producer_rates: dict[str, float] = field(default_factory=dict)  # per producer node name (wins)
    new_checks: int = 10                  # a producer checked fewer times than this is new ...
    new_boost: float = 4.0                # ... and sampled this many times more often
    stale_s: float = 3600.0               # a producer last checked longer ago than this ...
    stale_boost: float = 2.0              # ... is sampled this many times more often
    dispute_window_s: float = 600.0       # after a disagreement naming a producer ...
    dispute_boost: float = 8.0            # ... it is sampled this many times more often
    bitwise_models: list[str] = field(default_factory=list)   # model ids compared bitwise ("*": all)
    atol: float = 1e-3                    # otherwise: max|engine - signed| <= atol + rtol * max|signed|
    rtol: float = 1e-2
    outvoted_blocks: int = 64             # a producer outvoted on this many blocks is quarantined (0: never)
    seed: int = 0                         # the sampler's seed (0: a fresh one per node start)


@dataclass(slots=True)
class Config:
    kv: KVConfig = field(default_factory=KVConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    tenancy: TenancyConfig = field(default_factory=TenancyConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Config:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{p}: config file not found") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from None
        return cls.from_dict(data, source=str(p))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<config>") -> Config:
        sections = {f.name: f for f in dataclasses.fields(cls)}
        cfg = cls()
        for name, values in data.items():
            if name not in sections:
                raise ConfigError(f"{source}: unknown section [{name}]; expected one of "
                                  f"{', '.join(f'[{s}]' for s in sections)}")
            if not isinstance(values, dict):
                raise ConfigError(f"{source}: [{name}] must be a table")
            _apply(getattr(cfg, name), values, f"{source}: [{name}]")
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "<config>") -> None:
        kv = self.kv
        positive = {"kv.ram_gib": kv.ram_gib, "kv.ssd_gib": kv.ssd_gib, "kv.ssd_ttl_s": kv.ssd_ttl_s,
                    "kv.block_size": kv.block_size, "kv.eviction_interval_s": kv.eviction_interval_s,
                    "kv.io_threads": kv.io_threads, "kv.frequency_half_life_s": kv.frequency_half_life_s,
                    "kv.event_queue_max": kv.event_queue_max,
                    "transport.max_payload_bytes": self.transport.max_payload_bytes,
                    "transport.max_datagram_size": self.transport.max_datagram_size,
                    "transport.max_inflight": self.transport.max_inflight,
                    "transport.quic_max_data": self.transport.quic_max_data,
                    "transport.quic_max_stream_data": self.transport.quic_max_stream_data,
                    "transport.quic_max_half_open": self.transport.quic_max_half_open,
                    "transport.quic_max_half_open_per_address": self.transport.quic_max_half_open_per_address,
                    "transport.max_connections_per_peer": self.transport.max_connections_per_peer,
                    "transport.peer_pulls_per_s": self.transport.peer_pulls_per_s,
                    "transport.peer_pull_burst": self.transport.peer_pull_burst,
                    "transport.peer_bytes_per_s": self.transport.peer_bytes_per_s,
                    "transport.peer_bytes_burst": self.transport.peer_bytes_burst,
                    "transport.node_bytes_per_s": self.transport.node_bytes_per_s,
                    "transport.node_bytes_burst": self.transport.node_bytes_burst,
                    "transport.node_handshakes_per_s": self.transport.node_handshakes_per_s,
                    "transport.node_handshake_burst": self.transport.node_handshake_burst,
                    "cluster.heartbeat_s": self.cluster.heartbeat_s, "cluster.lease_s": self.cluster.lease_s,
                    "cluster.num_nodes": self.cluster.num_nodes,
                    "cluster.directory_shards": self.cluster.directory_shards,
                    "cluster.flush_ms": self.cluster.flush_ms, "cluster.flush_blocks": self.cluster.flush_blocks,
                    "cluster.queue_max": self.cluster.queue_max, "cluster.resync_batch": self.cluster.resync_batch,
                    "cluster.pull_timeout_s": self.cluster.pull_timeout_s,
                    "cluster.directory_lookup_timeout_s": self.cluster.directory_lookup_timeout_s,
                    "cluster.directory_call_timeout_s": self.cluster.directory_call_timeout_s,
                    "cluster.directory_probe_s": self.cluster.directory_probe_s,
                    "cluster.client_timeout_s": self.cluster.client_timeout_s,
                    "events.buffer_batches": self.events.buffer_batches, "events.hwm": self.events.hwm,
                    "events.replay_max_batches": self.events.replay_max_batches,
                    "events.replay_rate": self.events.replay_rate,
                    "events.replay_total_rate": self.events.replay_total_rate}
        for key, value in positive.items():
            if value <= 0:
                raise ConfigError(f"{source}: {key} must be > 0, got {value}")
        for key in ("gpu_offload_threshold", "cpu_offload_threshold", "prefetch_threshold", "ssd_low_water"):
            value = getattr(kv, key)
            if not 0.0 < value <= 1.0:
                raise ConfigError(f"{source}: kv.{key} must be in (0, 1], got {value}")
        for key in ("ram_blocks", "ssd_blocks"):
            if getattr(kv, key) < 0:
                raise ConfigError(f"{source}: kv.{key} must be >= 0 (0: capacity by bytes only), "
                                  f"got {getattr(kv, key)}")
        if kv.mirror_delay_s < 0:
            raise ConfigError(f"{source}: kv.mirror_delay_s must be >= 0, got {kv.mirror_delay_s}")
        if self.transport.send_rate_mb_s < 0:
            raise ConfigError(f"{source}: transport.send_rate_mb_s must be >= 0, got {self.transport.send_rate_mb_s}")
        if kv.reply_pool_gib < 0:
            raise ConfigError(f"{source}: kv.reply_pool_gib must be >= 0, got {kv.reply_pool_gib}")
        if not 0 <= kv.background_nice <= 19:
            raise ConfigError(f"{source}: kv.background_nice must be in [0, 19], got {kv.background_nice}")
        if kv.ram_high_water < 1.0:
            raise ConfigError(f"{source}: kv.ram_high_water must be >= 1.0, got {kv.ram_high_water}")
        if not 1200 <= self.transport.max_datagram_size <= 65527:
            raise ConfigError(f"{source}: transport.max_datagram_size must be in [1200, 65527], "
                              f"got {self.transport.max_datagram_size}")
        if not 0 <= self.cluster.metrics_port <= 65535:
            raise ConfigError(f"{source}: cluster.metrics_port must be in [0, 65535], got {self.cluster.metrics_port}")
        if self.cluster.resync_jitter_s < 0:
            raise ConfigError(f"{source}: cluster.resync_jitter_s must be >= 0, got {self.cluster.resync_jitter_s}")
        for key in ("quic_port", "tcp_port"):
            port = getattr(self.transport, key)
            if not 0 <= port <= 65535:
                raise ConfigError(f"{source}: transport.{key} must be in [0, 65535], got {port}")
        for key in ("endpoint", "replay_endpoint"):
            value = getattr(self.events, key)
            if (value or key == "endpoint") and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(f"{source}: events.{key} must be a tcp://, ipc:// or inproc:// ZMQ endpoint, "
                                  f"got {value!r}")
        problem = exposure_error(self.events, self.tenancy.required)
        if problem is not None:
            raise ConfigError(f"{source}: {problem}")
        if not 0 < self.tenancy.token_ttl_s <= 3600:
            raise ConfigError(f"{source}: tenancy.token_ttl_s must be in (0, 3600], got {self.tenancy.token_ttl_s}")
        seen: set[str] = set()
        for group in self.tenancy.shared:
            if len(set(group)) < 2 or not all(group) or seen & set(group):
                raise ConfigError(f"{source}: tenancy.shared groups name two or more tenants each, none in two "
                                  f"groups; got {group!r}")
            seen |= set(group)
        self._validate_audit(source)
        if self.cluster.lease_s <= self.cluster.heartbeat_s:
            raise ConfigError(f"{source}: cluster.lease_s ({self.cluster.lease_s}) must exceed "
                              f"cluster.heartbeat_s ({self.cluster.heartbeat_s})")


    def _validate_audit(self, source: str) -> None:
        a = self.audit
        rates = {"audit.rate": a.rate, **{f"audit.tenant_rates.{k}": v for k, v in a.tenant_rates.items()},
                 **{f"audit.producer_rates.{k}": v for k, v in a.producer_rates.items()}}
        for key, value in rates.items():
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"{source}: {key} must be in [0, 1], got {value}")
        for key in ("new_boost", "stale_boost", "dispute_boost"):
            if getattr(a, key) < 1.0:
                raise ConfigError(f"{source}: audit.{key} must be >= 1, got {getattr(a, key)}")
        for key in ("new_checks", "stale_s", "dispute_window_s", "atol", "rtol", "outvoted_blocks", "seed"):
            if getattr(a, key) < 0:
                raise ConfigError(f"{source}: audit.{key} must be >= 0, got {getattr(a, key)}")


def _apply(section: Any, values: dict[str, Any], where: str) -> None:
    hints = get_type_hints(type(section))
    known = {f.name for f in dataclasses.fields(section)}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"{where}: unknown key {key!r}; expected one of {', '.join(sorted(known))}")
        setattr(section, key, _coerce(value, hints[key], f"{where} {key}"))


def _coerce(value: Any, hint: Any, where: str) -> Any:
    origin = get_origin(hint)
    if origin is Literal:
        choices = get_args(hint)
        if value not in choices:
            raise ConfigError(f"{where}: must be one of {', '.join(map(repr, choices))}, got {value!r}")
        return value
    if origin is types.UnionType:
        raise RuntimeError(f"{where}: union types are not supported in config fields")
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}: must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: must be a string, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: must be a list, got {value!r}")
        (item,) = get_args(hint)
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: must be a table, got {value!r}")
        key_hint, item = get_args(hint)
        return {_coerce(k, key_hint, where): _coerce(v, item, f"{where}.{k}") for k, v in value.items()}
    raise RuntimeError(f"{where}: unsupported config type {hint!r}")
