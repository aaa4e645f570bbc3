"""Starting the fabric: on an existing Ray cluster (`start_fabric`) or on a local one (`start_local_cluster`).

A local cluster is several real Ray nodes on this machine (a head plus worker raylets, each with
its own node id), bound to 127.0.0.1 only: by default Ray binds and dials the machine's other
interface, so the loopback settings are applied here once for every caller (CLI, tests, benches).
"""

from __future__ import annotations

import os

# Before the first `import ray` anywhere in this process: Ray reads it once, at import.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import atexit
import contextlib
import dataclasses
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.cluster_utils import Cluster

from cluster.directory.actor import shard_actor_name, start_directory
from cluster.node.actor import node_actor_name, node_name_for
from cluster.supervisor import SUPERVISOR_NAME, alive_node_ids, ensure_nodes, start_supervisor
from fabric.config import Config
from transports.trust.certs import CA_CERT, init_ca, issue_node

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def loopback_env() -> None:
    """Keep Ray on 127.0.0.1: without this Ray resolves the node address from the machine's other
    interface even when every node is given `node_ip_address="127.0.0.1"`. Ray reads the variable
    when it is first imported, so if it was imported before this module, its cached flag is set too."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def start_fabric(config: Config, *, timeout_s: float = 120.0,
                 require_all: bool = True) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Directory shards + supervisor + a NodeActor on every alive node; returns `(answers, missing)`
    once each node serves or `timeout_s` passes. Needs `ray.init(...)` first. Idempotent: actors
    that exist are reused. `require_all=False` tolerates nodes that do not answer (a node that is
    dying, or still starting: the supervisor keeps trying); no node at all is always an error."""
    start_directory(config.cluster, config.transport.cert_dir)
    answers = ensure_nodes(config, timeout_s=timeout_s)
    start_supervisor(config)
    missing = sorted(set(alive_node_ids()) - set(answers))
    if missing and (require_all or not answers):
        raise RuntimeError(f"NodeActors on {missing} did not start within {timeout_s:.0f} s "
                           "(see their logs under the Ray session folder)")
    return answers, missing


def stop_fabric(config: Config) -> int:
    """Close every NodeActor's store and kill the fabric's actors; returns how many were killed."""
    ns = config.cluster.namespace
    killed = 0
    handles = []
    for node_id in alive_node_ids():
        try:
            handles.append(ray.get_actor(node_actor_name(node_id), namespace=ns))
        except ValueError:
            continue
    _ready, _ = ray.wait([h.shutdown.remote() for h in handles], num_returns=len(handles), timeout=30)
    for h in handles:
        ray.kill(h, no_restart=True)
        killed += 1
    shards = [shard_actor_name(config.cluster, k) for k in range(config.cluster.directory_shards)]
    for name in [SUPERVISOR_NAME, *shards]:
        try:
            ray.kill(ray.get_actor(name, namespace=ns), no_restart=True)
            killed += 1
        except ValueError:
            pass
    return killed


def local_config(root: Path, base: Config | None = None) -> Config:
    """`base` with every folder under `root` and ports chosen by the OS (several nodes share the host)."""
    cfg = base or Config()
    kv = dataclasses.replace(cfg.kv, ssd_dir=str(root / "ssd"), index_dir=str(root / "index"))
    transport = dataclasses.replace(cfg.transport, host=LOOPBACK, tcp_port=0, quic_port=0,
                                    cert_dir=str(root / "certs"))
    cluster = dataclasses.replace(cfg.cluster, metrics_port=0)
    return dataclasses.replace(cfg, kv=kv, transport=transport, cluster=cluster)


def ensure_ca(cert_dir: str) -> None:
    if not (Path(cert_dir) / CA_CERT).exists():
        init_ca(cert_dir)


def issue_local_certs(cert_dir: str, node_ids: list[str], hosts: Mapping[str, str] | None = None) -> list[str]:
    """As the operator of a local cluster (this process holds the CA): issue the certificate of each
    node that has none, naming its node and its address (`hosts[node_id]`, else 127.0.0.1), before
    its NodeActor starts. Returns the names."""
    names = []
    for node_id in node_ids:
        name = node_name_for(node_id)
        if not (Path(cert_dir) / f"{name}.pem").exists():
            issue_node(cert_dir, name, extra_sans=((hosts or {}).get(node_id, LOOPBACK),))
            names.append(name)
    return names


@dataclass
class LocalCluster:
    """A running local Ray cluster with the fabric on it."""

    cluster: Cluster
    config: Config
    root: Path
    ray_dir: Path | None = None   # Ray's session files and sockets: removed by `shutdown` (`kvfabric down`)

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def add_node(self, num_cpus: int = 1, wait_s: float = 60.0) -> str:
        """Add a Ray node; returns its id once the supervisor has a NodeActor serving on it."""
        before = set(alive_node_ids())
        with contextlib.nullcontext() if self.ray_dir is None else _ray_tmpdir(self.ray_dir):
            self.cluster.add_node(node_ip_address=LOOPBACK, num_cpus=num_cpus)
        self.cluster.wait_for_nodes()
        new = sorted(set(alive_node_ids()) - before)
        assert len(new) == 1, f"expected one new node, saw {new}"
        node_id = new[0]
        # Whoever adds a node issues its certificate: until then its NodeActor refuses to start, and
        # the supervisor starts it on its next pass.
        issue_local_certs(self.config.transport.cert_dir, new)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                ray.get(ray.get_actor(node_actor_name(node_id), namespace=self.config.cluster.namespace)
                        .ping.remote(), timeout=5)
                return node_id
            except (ValueError, ray.exceptions.RayError):
                time.sleep(0.2)
        raise TimeoutError(f"no NodeActor on the new node {node_id} after {wait_s:.0f} s")

    def remove_node(self, node_id: str) -> None:
        """Stop a worker Ray node abruptly (its processes are killed, as when a machine dies)."""
        for node in list(self.cluster.worker_nodes):
            if node.node_id == node_id:
                self.cluster.remove_node(node, allow_graceful=False)
                return
        raise ValueError(f"no worker node {node_id} in this cluster")

    def node_ids(self) -> list[str]:
        return alive_node_ids()

    def shutdown(self) -> None:
        try:
            stop_fabric(self.config)
        finally:
            ray.shutdown()
            self.cluster.shutdown()
            if self.ray_dir is not None:
                shutil.rmtree(self.ray_dir, ignore_errors=True)


def default_address_file() -> Path:
    """Where `ray.init(address="auto")` looks first for the cluster to join (under `$RAY_TMPDIR`, else /tmp)."""
    from ray._common.utils import get_ray_address_file

    return Path(get_ray_address_file(None))


def forget_default_address(address: str) -> None:
    """Remove the note `start_local_cluster(persistent=True)` left, if it still names `address`."""
    note = default_address_file()
    with contextlib.suppress(OSError):
        if note.read_text().strip() == address:
            note.unlink()


@contextlib.contextmanager
def _ray_tmpdir(path: Path) -> Iterator[None]:
    before = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = str(path)
    try:
        yield
    finally:
        if before is None:
            del os.environ["RAY_TMPDIR"]
        else:
            os.environ["RAY_TMPDIR"] = before


def start_local_cluster(num_nodes: int, root: str | os.PathLike[str], config: Config | None = None, *,
                        num_cpus_per_node: int = 1, persistent: bool = False,
                        object_store_bytes: int = 256 << 20) -> LocalCluster:
    """`num_nodes` Ray nodes on 127.0.0.1 with the fabric started; connects this process to it.

    `persistent`: the Ray processes outlive this process (`kvfabric up`); stop them with
    `kvfabric down`. Otherwise they stop with this process.
    """
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    loopback_env()
    root = Path(root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    cfg = local_config(root, config)
    ensure_ca(cfg.transport.cert_dir)
    node_args = dict(node_ip_address=LOOPBACK, num_cpus=num_cpus_per_node, object_store_memory=object_store_bytes)
    # Ray's session files and sockets in a directory of this cluster's own, not the shared /tmp/ray
    # (a short path: a Unix socket's must stay under 108 bytes); every node of the cluster uses it.
    # Ray's test cluster also notes its address under the default temp directory's ray/ (RAY_TMPDIR while
    # the nodes start), which need not exist on a fresh machine: that goes here too.
    ray_dir = Path(tempfile.mkdtemp(prefix="kvf-ray-"))
    (ray_dir / "ray").mkdir()
    if not persistent:   # registered first, so it runs after Ray's own exit handler has stopped the nodes
        atexit.register(shutil.rmtree, ray_dir, ignore_errors=True)
    with _ray_tmpdir(ray_dir):
        cluster = Cluster(initialize_head=True, shutdown_at_exit=not persistent,
                          head_node_args=dict(include_dashboard=False, temp_dir=str(ray_dir), **node_args))
        for _ in range(num_nodes - 1):
            cluster.add_node(**node_args)
    cluster.wait_for_nodes()
    if persistent:   # as `ray start` does: `ray.init(address="auto")` on this machine finds it
        note = default_address_file()
        note.parent.mkdir(parents=True, exist_ok=True)
        note.write_text(cluster.address)
    ray.init(address=cluster.address, namespace=cfg.cluster.namespace, logging_level=logging.WARNING,
             log_to_driver=False)
    try:
        issue_local_certs(cfg.transport.cert_dir, alive_node_ids())
        start_fabric(cfg)
    except BaseException:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)
        raise
    return LocalCluster(cluster, cfg, root, ray_dir)
