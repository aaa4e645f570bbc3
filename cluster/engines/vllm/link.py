"""How a vLLM process reaches its node's fabric: as a Ray driver of the cluster kvfabric runs on.

    vLLM engine process ──ray.init(address)──► Ray cluster ──FabricClient──► NodeActor of this node
                          (once per process)                  (by Ray node id)

vLLM runs the connector's scheduler side in its engine-core process and the worker side in each
worker process (one process in `VLLM_ENABLE_V1_MULTIPROCESSING=0` mode); each connects once. A
process that is already a Ray worker (vLLM inside a Ray actor, in-process) uses its own connection.
KV crosses as uint8 numpy arrays through the node's shared-memory object store: a load is read
zero-copy from it, a store is one copy into it.

`kv_connector_extra_config` keys read here:
    ray_address     the cluster ("auto": the one this host runs; default $RAY_ADDRESS, else "auto")
    ray_namespace   the Ray namespace kvfabric runs in (default "kvfabric")
    node_id         the Ray node whose fabric to use (default: the node this process attached to;
                    needed only where several Ray nodes share one host, as in local test clusters)
    credential      a tenant certificate (docs/tenants.md); every call is then that tenant's
    call_timeout_s  the longest any fabric call may take before the engine recomputes instead
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import ray

from cluster.client import DEFAULT_CALL_TIMEOUT_S, DEFAULT_NAMESPACE, FabricClient
from cluster.launch import LOOPBACK, loopback_env

logger = logging.getLogger(__name__)
_lock = threading.Lock()


def connect(extra: dict[str, Any]) -> FabricClient:
    """This process's client of its node's fabric (joining the Ray cluster first if needed)."""
    namespace = str(extra.get("ray_namespace") or DEFAULT_NAMESPACE)
    with _lock:
        if not ray.is_initialized():
            address = str(extra.get("ray_address") or os.environ.get("RAY_ADDRESS") or "auto")
            if address.startswith(LOOPBACK):   # a local cluster (`kvfabric up`): keep Ray on 127.0.0.1
                loopback_env()
            ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level=logging.WARNING,
                     configure_logging=False)
            logger.info("joined the Ray cluster at %s", address)
    return FabricClient.connect(node_id=extra.get("node_id") or None, namespace=namespace,
                                call_timeout_s=float(extra.get("call_timeout_s") or DEFAULT_CALL_TIMEOUT_S),
                                credential=extra.get("credential") or None)
