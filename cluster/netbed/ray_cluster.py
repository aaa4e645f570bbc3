"""Ray and the fabric on a bed of hosts: `ray start --head` in host 0 on its own address, `ray start
--address` in the others, this process joined as the driver, and a NodeActor per host that serves
on its host's address with a certificate naming that address.

Each bed's Ray has its own temp dir, its own token (token authentication on, the token file in the
bed's folder) and no dashboard; the bed's teardown stops it by PID, never with Ray's own stop
command (which ends every Ray process on the machine).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from cluster.launch import ensure_ca, issue_local_certs, local_config, start_fabric
from cluster.netbed.bed import NetBed
from cluster.netbed.plan import ray_start_command
from fabric.config import ADVERTISE_HOST_ENV, Config

logger = logging.getLogger(__name__)

RAY_PORT = 6379                  # each host has its own port space: no clash with other clusters
# A partition that outlives Ray's default health checks (about 15 s) would get the cut-off node
# declared dead; the bed exists to cut links, so Ray waits longer before it gives up on a node.
RAY_SYSTEM_CONFIG = {"health_check_failure_threshold": 40}


@dataclass(frozen=True, slots=True)
class BedRay:
    """Ray on a bed: the GCS address and the environment every Ray process of the bed needs."""

    address: str
    env: dict[str, str]


def ray_env(bed: NetBed) -> dict[str, str]:
    """Token auth with the bed's own token, Ray on non-loopback addresses."""
    token = bed.root / "ray_token"
    if not token.exists():
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", "RAY_USAGE_STATS_ENABLED": "0"}


def start_ray(bed: NetBed, *, num_cpus: int = 1, object_store_bytes: int = 128 << 20) -> BedRay:
    """A Ray node in every host, head in host 0. Their processes are the bed's (stopped by teardown)."""
    env = ray_env(bed)
    ray_bin = str(Path(sys.executable).with_name("ray"))
    temp_dir = str(bed.root / "ray")
    for i in range(bed.plan.num_hosts):
        cmd = ray_start_command(ray_bin, bed.plan, i, temp_dir, port=RAY_PORT, num_cpus=num_cpus,
                                object_store_bytes=object_store_bytes, system_config=json.dumps(RAY_SYSTEM_CONFIG))
        # The NodeActor of this host binds 0.0.0.0 in its namespace and advertises the host's address.
        bed.run(i, cmd, env={**env, ADVERTISE_HOST_ENV: bed.plan.address(i)})
    return BedRay(f"{bed.plan.address(0)}:{RAY_PORT}", env)


@contextmanager
def driver(bed: NetBed, bed_ray: BedRay, namespace: str = "kvfabric") -> Iterator[None]:
    """This process as a Ray driver of the bed's cluster, joined from host 0 (the threads Ray starts
    live there); restores the environment and Ray's cluster flag when it leaves."""
    from ray._private import ray_constants
    from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]
    from ray._raylet import Config as RayConfig  # type: ignore[attr-defined]

    saved = {k: os.environ.get(k) for k in bed_ray.env}
    saved_flag = ray_constants.ENABLE_RAY_CLUSTER
    os.environ.update(bed_ray.env)
    ray_constants.ENABLE_RAY_CLUSTER = True
    # Ray caches its auth mode and token at import: make it read the bed's now, and again on leaving.
    RayConfig.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
    try:
        with bed.inside(0):
            ray.init(address=bed_ray.address, _node_ip_address=bed.plan.address(0), namespace=namespace,
                     logging_level=logging.WARNING, log_to_driver=False)
        yield
    finally:
        ray.shutdown()
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        RayConfig.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


def node_hosts() -> dict[str, str]:
    """Ray node id → its address, for the alive nodes of the connected cluster."""
    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}


def bed_config(bed: NetBed, base: Config | None = None) -> Config:
    """`base` with its folders under the bed's folder and the transport listening on every address
    of its host (each host has only its own)."""
    cfg = local_config(bed.root / "fabric", base)
    return dataclasses.replace(cfg, transport=dataclasses.replace(cfg.transport, host="0.0.0.0"))


def start_bed_fabric(bed: NetBed, base: Config | None = None,
                     *, timeout_s: float = 120.0) -> tuple[Config, dict[str, dict[str, Any]]]:
    """Certificates for every host (naming its address), then the fabric; needs `driver` entered."""
    cfg = bed_config(bed, base)
    ensure_ca(cfg.transport.cert_dir)
    hosts = node_hosts()
    issue_local_certs(cfg.transport.cert_dir, list(hosts), hosts)
    answers, _ = start_fabric(cfg, timeout_s=timeout_s)
    return cfg, answers
