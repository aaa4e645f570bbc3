"""`kvfabric up / start / stats / down`: run the fabric on a local or an existing Ray cluster.

    kvfabric up --nodes 3            a local Ray cluster (head + 2 worker raylets on 127.0.0.1)
                                     with the fabric on it; returns and leaves it running
    kvfabric up --nodes 3 --netns [--link dc]
                                     the same, each Ray node in its own network namespace (a test
                                     bed of hosts on a private bridge, links shaped by the profile)
    kvfabric start --address ADDR    the fabric on an existing Ray cluster (Ray jobs, the Helm chart)
    kvfabric stats [--config F] [--json] [--credential OPERATOR.pem]
                                     per node: blocks (of their block capacity) and bytes per tier,
                                          refused puts, hit ratio, pulls by outcome;
                                     directory entries per shard
    kvfabric down                    stop the fabric (and the local cluster `up` started)
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from cluster.cli.main import CLIError
from cluster.netbed.bed import NetBed, pid_alive
from fabric.config import ClusterConfig, Config, ConfigError, kvfabric_home
from transports.trust.certs import CA_KEY, OPERATOR_SUFFIX, CertificateError, issue_operator
from transports.trust.tenant_tokens import TenantMinter

logger = logging.getLogger(__name__)

OPERATOR_NAME = "operator"   # the credential the CLI issues itself where it finds the CA key


def state_file() -> Path:
    return kvfabric_home() / "local-cluster.json"


def register(sub: Any) -> None:
    up = sub.add_parser("up", help="start a local multi-node Ray cluster with the fabric, and return")
    up.add_argument("--nodes", type=int, default=None, help="Ray nodes to start (default: [cluster] num_nodes)")
    up.add_argument("--config", help="kvfabric TOML config")
    up.add_argument("--root", help="folder for stores and certificates (default: $KVFABRIC_HOME/local)")
    up.add_argument("--cpus-per-node", type=int, default=1)
    up.add_argument("--netns", action="store_true",
                    help="each node in its own network namespace on a private bridge (needs root)")
    up.add_argument("--link", help="link profile of every host with --netns: lan, dc, wan, lossy or "
                                   "rate=200mbit,delay=20ms,loss=0.1%% (default: dc)")
    up.set_defaults(func=cmd_up)
    start = sub.add_parser("start", help="start the fabric on an existing Ray cluster")
    start.add_argument("--address", default="auto", help="Ray address (default: auto)")
    start.add_argument("--config", help="kvfabric TOML config")
    start.set_defaults(func=cmd_start)
    stats = sub.add_parser("stats", help="per-node and directory statistics")
    stats.add_argument("--address", help="Ray address (default: the cluster `up` started, else auto)")
    stats.add_argument("--config", help="kvfabric TOML config (its [cluster] namespace and directory)")
    stats.add_argument("--json", action="store_true", help="print one JSON object")
    add_credential_argument(stats)
    stats.set_defaults(func=cmd_stats)
    down = sub.add_parser("down", help="stop the fabric and the local cluster `up` started")
    down.add_argument("--address", help="Ray address (default: the cluster `up` started)")
    down.set_defaults(func=cmd_down)


def _config(path: str | None) -> Config:
    if path is None:
        return Config()
    try:
        return Config.load(path)
    except ConfigError as e:
        raise CLIError(str(e)) from None


def add_credential_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--credential", help="operator certificate <name>.operator.pem, key beside it (default: "
                                             "[tenancy] operator_credential, else the local cluster's, issued "
                                             "where the CA key is)")


def operator_minter(credential: str | None, config: Config, state: dict[str, Any] | None) -> TenantMinter | None:
    """The operator credential the CLI's node-wide calls carry: `credential`, else [tenancy]
    operator_credential, else `operator.operator.pem` in the certificate folder of the local cluster
    `up` started (else [transport] cert_dir), issued there when the CA key is beside it (the CLI then
    runs as the operator). None: no credential anywhere, the calls go anonymously (which nodes admit
    only where tenancy is not required)."""
    from cluster.client import minter

    path = credential or config.tenancy.operator_credential
    if not path:
        cert_dir = Path(state["root"]) / "certs" if state and "root" in state else Path(config.transport.cert_dir)
        found = cert_dir / f"{OPERATOR_NAME}{OPERATOR_SUFFIX}.pem"
        if not found.exists() and (cert_dir / CA_KEY).exists():
            issue_operator(cert_dir, OPERATOR_NAME)
        if not found.exists():
            return None
        path = str(found)
    try:
        return minter(path, config.tenancy.token_ttl_s)
    except CertificateError as e:
        raise CLIError(f"operator credential: {e}") from None


def _connect(address: str | None) -> tuple[str, dict[str, Any] | None]:
    import ray

    from cluster.launch import loopback_env

    state = json.loads(state_file().read_text()) if state_file().exists() else None
    address = address or (state["address"] if state else "auto")
    if state is not None and "netbed" in state and address == state["address"]:
        _join_bed(state)
        return address, state
    if address != "auto":
        _check_reachable(address)
    if address.startswith(("127.", "localhost")):
        loopback_env()   # only for a local cluster: on Kubernetes the node's address is its pod IP
    try:
        ray.init(address=address, namespace="kvfabric", logging_level=logging.WARNING, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise CLIError(f"no Ray cluster at {address!r} ({str(e).splitlines()[0]}); "
                       "start one with `kvfabric up --nodes 3` or pass --address") from None
    return address, state


def _bed_driver(state: dict[str, Any]) -> tuple[NetBed, AbstractContextManager[None]]:
    """The bed `up --netns` made, and the context that joins its Ray cluster as a driver does: from
    inside host 0, with the bed's own Ray token."""
    from cluster.netbed.plan import NetbedError
    from cluster.netbed.ray_cluster import BedRay, driver, ray_env

    try:
        bed = NetBed.load(state["netbed"])
    except NetbedError as e:
        raise CLIError(str(e)) from None
    namespace = _config(state.get("config")).cluster.namespace
    return bed, driver(bed, BedRay(state["address"], ray_env(bed)), namespace)


def _join_bed(state: dict[str, Any]) -> None:
    """Join the Ray cluster of a bed `up --netns` made, until the command exits."""
    bed, joined = _bed_driver(state)
    try:
        joined.__enter__()
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise CLIError(f"no Ray cluster at {state['address']!r} in test bed {bed.plan.prefix} "
                       f"({str(e).splitlines()[0]}); `kvfabric down` removes the bed") from None
    atexit.register(joined.__exit__, None, None, None)


def _check_reachable(address: str) -> None:
    """Ray retries an unreachable GCS for minutes; a user who mistyped the address wants to know now."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
    except (OSError, ValueError) as e:
        raise CLIError(f"no Ray cluster at {address!r} ({e}); start one with `kvfabric up --nodes 3` "
                       "or pass --address") from None


def cmd_up(args: argparse.Namespace) -> int:
    from cluster.launch import start_local_cluster

    if state_file().exists():
        raise CLIError(f"a local cluster is already up ({state_file()}); run `kvfabric down` first")
    if args.link and not args.netns:
        raise CLIError("--link needs --netns (links are shaped only between the hosts of a test bed)")
    config = _config(args.config)
    num_nodes = args.nodes or config.cluster.num_nodes
    if num_nodes < 1:
        raise CLIError(f"--nodes must be at least 1, got {num_nodes}")
    if args.netns:
        return _up_netns(args, config, num_nodes)
    root = Path(args.root or kvfabric_home() / "local")
    start = time.monotonic()
    with Console().status(f"starting {num_nodes} Ray nodes and the fabric on 127.0.0.1 ..."):
        local = start_local_cluster(num_nodes, root, config, num_cpus_per_node=args.cpus_per_node, persistent=True)
    pids = [p.process.pid for node in [local.cluster.head_node, *local.cluster.worker_nodes]
            for infos in node.all_processes.values() for p in infos if p.process is not None]
    state_file().parent.mkdir(parents=True, exist_ok=True)
    state_file().write_text(json.dumps({"address": local.address, "root": str(local.root), "pids": pids,
                                        "config": args.config, "ray_dir": str(local.ray_dir)}))
    print(f"kvfabric is up: {num_nodes} Ray nodes at {local.address} ({time.monotonic() - start:.1f} s), "
          f"stores under {local.root}")
    print(f"  connect:  ray.init(address={local.address!r}); FabricClient.connect()")
    print("  inspect:  kvfabric stats    stop: kvfabric down")
    return 0


def _up_netns(args: argparse.Namespace, config: Config, num_nodes: int) -> int:
    from cluster.netbed.bed import NetbedUnavailable
    from cluster.netbed.plan import NetbedError, parse_profile
    from cluster.netbed.ray_cluster import driver, start_bed_fabric, start_ray

    try:
        profile = parse_profile(args.link or "dc")
        start = time.monotonic()
        bed = NetBed.create(num_nodes, profile=profile)
    except (NetbedError, NetbedUnavailable) as e:
        raise CLIError(str(e)) from None
    try:
        with Console().status(f"starting {num_nodes} hosts, Ray and the fabric ..."):
            bed_ray = start_ray(bed, num_cpus=args.cpus_per_node)
            with driver(bed, bed_ray, config.cluster.namespace):
                start_bed_fabric(bed, config)
    except BaseException:
        bed.teardown()
        raise
    state_file().parent.mkdir(parents=True, exist_ok=True)
    state_file().write_text(json.dumps({"address": bed_ray.address, "root": str(bed.root), "pids": bed.pids,
                                        "config": args.config, "netbed": str(bed.state_path)}))
    print(f"kvfabric is up: {num_nodes} Ray nodes at {bed_ray.address} ({time.monotonic() - start:.1f} s), "
          f"one per network namespace, stores under {bed.root}")
    for i in range(num_nodes):
        print(f"  host {i} at {bed.plan.address(i)}  (namespace {bed.plan.namespace(i)})")
    applied = [part for part, on in bed.applied.items() if on and part != "partition"]
    print(f"  link {profile.name}: {profile.rate_bps / 1e6:g} Mbit/s, loss {profile.loss_percent:g} %"
          f" ({', '.join(applied)} applied; delay not applied: this kernel has no tc netem)")
    print(f"  run inside a host:  ip netns exec {bed.plan.namespace(0)} CMD    stop: kvfabric down")
    return 0


def _down_netns(state: dict[str, Any]) -> None:
    """Stop the fabric of a bed `up --netns` made, then remove the bed (its processes by PID)."""
    from cluster.launch import stop_fabric

    bed, joined = _bed_driver(state)
    try:
        with joined:
            print(f"stopped {stop_fabric(_config(state.get('config')))} fabric actors")
    except (ConnectionError, RuntimeError) as e:
        logger.warning("could not reach the bed's Ray cluster to stop the fabric cleanly: %s", e)
    bed.teardown()
    print(f"test bed {bed.plan.prefix} and its Ray cluster at {state['address']} removed")


def cmd_start(args: argparse.Namespace) -> int:
    from cluster.launch import start_fabric

    config = _config(args.config)
    _connect(args.address)
    try:
        answers, missing = start_fabric(config, require_all=False)
    except (RuntimeError, CertificateError) as e:
        raise CLIError(str(e)) from None
    for node_id, info in sorted(answers.items()):
        addr = info["address"]
        print(f"node {node_id[:12]}  {addr.transport}://{addr.host}:{addr.port}  incarnation {info['incarnation']}")
    for node_id in missing:
        print(f"node {node_id[:12]}  not serving yet (the supervisor keeps trying)")
    print(f"kvfabric started on {len(answers)} Ray nodes ({config.cluster.directory_shards} directory shards)")
    return 0


def gather_stats(cluster: ClusterConfig, operator: TenantMinter | None = None) -> dict[str, Any]:
    """Every NodeActor's stats and every directory shard's, from a connected driver, calling with
    `operator`'s tokens (None: anonymously)."""
    import ray

    from cluster.directory.actor import shard_actor_name
    from cluster.directory.client import DirectoryClient
    from cluster.node.actor import node_actor_name
    from cluster.supervisor import alive_node_ids
    from cluster.tenancy import TenantRefusedError

    namespace = cluster.namespace
    nodes = []
    token = None if operator is None else operator.token(time.time())
    for node_id in alive_node_ids():
        try:
            nodes.append(ray.get(ray.get_actor(node_actor_name(node_id), namespace=namespace)
                                 .stats.remote(token=token), timeout=10))
        except TenantRefusedError as e:
            nodes.append({"node_id": node_id, "error": f"refused: {getattr(e, 'cause', e)}"})
        except (ValueError, ray.exceptions.RayError) as e:
            nodes.append({"node_id": node_id, "error": type(e).__name__})
    num_shards = 0
    while True:
        try:
            ray.get_actor(shard_actor_name(cluster, num_shards), namespace=namespace)
            num_shards += 1
        except ValueError:
            break
    shards = asyncio.run(DirectoryClient(dataclasses.replace(cluster, directory_shards=num_shards)).stats()) \
        if num_shards else []
    return {"nodes": nodes, "directory": shards}


def blocks_cell(tier: dict[str, Any]) -> str:
    """Blocks a tier holds (distinct block hashes, all layers counted once), over its block
    capacity when one is set: "120 / 1000"."""
    held = tier.get("held_blocks", tier.get("blocks", "?"))
    capacity = tier.get("capacity_blocks", 0)
    return f"{held} / {capacity}" if capacity else str(held)


def cmd_stats(args: argparse.Namespace) -> int:
    _, state = _connect(args.address)
    # The config the local cluster was started with, unless one is named: its namespace and shards.
    config_path = args.config or (state or {}).get("config")
    config = _config(config_path)
    stats = gather_stats(config.cluster, operator_minter(args.credential, config, state))
    if args.json:
        print(json.dumps(stats, default=str))
        return 0
    if not stats["nodes"]:
        raise CLIError("no kvfabric nodes found; start the fabric with `kvfabric start` or `kvfabric up`")
    table = Table(title="kvfabric nodes")
    columns = ("node", "transport", "RAM blocks", "RAM MB", "SSD blocks", "SSD MB", "refused puts", "hit ratio",
               "pulled MB", "pull hits", "pull misses", "said yes / had no")
    for col in columns:
        table.add_column(col, justify="right")
    for n in stats["nodes"]:
        if "error" in n:
            table.add_row(n["node_id"][:12], f"unreachable: {n['error']}", *[""] * (len(columns) - 2))
            continue
        if "store" not in n:   # a tenant's credential: only its own blocks (docs/tenants.md)
            table.add_row(n["node_id"][:12], f"tenant view: {n.get('held_blocks', 0)} blocks of "
                                             f"{', '.join(n.get('tenants', []))}", *[""] * (len(columns) - 2))
            continue
        store = n["store"]
        ram, ssd = store.get("ram", {}), store.get("ssd", {})
        table.add_row(n["node_id"][:12], f"{n['transport']} {n['address']}", blocks_cell(ram),
                      f"{ram.get('bytes', 0) / 1e6:.1f}", blocks_cell(ssd), f"{ssd.get('bytes', 0) / 1e6:.1f}",
                      str(sum(store.get("put_rejected", {}).values())),
                      f"{n['hit_ratio']:.3f}", f"{n['pulled_bytes'] / 1e6:.1f}", f"{n['pulls'].get('hit', 0):.0f}",
                      f"{sum(v for k, v in n['pulls'].items() if k != 'hit'):.0f}", f"{n['said_yes_owner_no']:.0f}")
    console = Console(width=160)
    console.print(table)
    shards = Table(title="directory shards")
    for col in ("shard", "nodes", "entries", "hashes", "bytes/entry"):
        shards.add_column(col, justify="right")
    for s in stats["directory"]:
        shards.add_row(str(s.get("shard")), str(s.get("num_nodes", s.get("error", ""))), str(s.get("num_entries", "")),
                       str(s.get("num_hashes", "")), str(s.get("bytes_per_entry", "")))
    console.print(shards)
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    import ray

    from cluster.launch import forget_default_address, stop_fabric

    state = json.loads(state_file().read_text()) if state_file().exists() else None
    if state is None and args.address is None:
        raise CLIError("no local cluster was started with `kvfabric up`; pass --address to stop a fabric elsewhere")
    if state is not None and "netbed" in state and args.address is None:
        _down_netns(state)
        state_file().unlink()
        return 0
    try:
        _connect(args.address)
        config = _config(state.get("config") if state else None)
        print(f"stopped {stop_fabric(config)} fabric actors")
        ray.shutdown()
    except CLIError as e:
        logger.warning("could not reach the cluster to stop the fabric cleanly: %s", e)
    if state is not None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [pid for pid in state["pids"] if pid_alive(pid)]
            for pid in alive:
                os.kill(pid, sig)
            deadline = time.monotonic() + 10
            while any(pid_alive(p) for p in alive) and time.monotonic() < deadline:
                time.sleep(0.1)
        if state.get("ray_dir"):   # Ray's session files and sockets of the stopped nodes
            shutil.rmtree(state["ray_dir"], ignore_errors=True)
        forget_default_address(state["address"])
        state_file().unlink()
        print(f"local cluster at {state['address']} stopped")
    return 0
