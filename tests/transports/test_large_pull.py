"""Regression: one pull of more results than the client buffers before pausing (RESULTS_HIGH).

A pull is split into requests of at most MAX_ADDRESSES_PER_PULL addresses, several in flight at once;
the server may answer later requests before an earlier one completes. The client used to pause
reading once RESULTS_HIGH bytes were buffered, even when all of them belonged to later requests
while the caller waited on the first: the connection stalled until the caller's timeout (3,870
addresses of 24 KiB, the 30 layers of 129 SmolLM2 blocks, delivered 989 and stopped). Real
TLS over loopback, a real Store.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np

from fabric.config import KVConfig, TransportConfig
from fabric.keys import BlockAddress, BlockHash
from fabric.store import Store
from transports.core.base import Hit, Peer
from transports.factory import create_client, create_server
from transports.tls.client import RESULTS_HIGH


def test_a_pull_larger_than_the_client_buffer_bound_completes(tmp_path: Path, cert_dir: Path) -> None:
    num_blocks, num_layers, size = 129, 30, 24 * 1024
    assert num_blocks * num_layers * size > RESULTS_HIGH
    rng = np.random.default_rng(0)
    hashes = [BlockHash(os.urandom(32)) for _ in range(num_blocks)]
    payloads = {BlockAddress(h, layer): rng.integers(0, 256, size, dtype=np.uint8).tobytes()
                for h in hashes for layer in range(num_layers)}
    kv = KVConfig(ram_gib=0.5, ssd_dir=str(tmp_path / "ssd"), index_dir=str(tmp_path / "index"), durable=False,
                  o_direct=False)
    wanted = [BlockAddress(h, layer) for layer in range(num_layers) for h in hashes]   # layer-major, as loads ask

    async def pull(store: Store) -> list[object]:
        server = create_server(TransportConfig(cert_dir=str(cert_dir), node_name="node-a"), store)
        host, port = await server.start()
        client = create_client(TransportConfig(cert_dir=str(cert_dir), node_name="node-b"))
        try:
            async with asyncio.timeout(60):
                return [r async for r in client.pull(Peer("node-a", host, port), wanted)]
        finally:
            await client.close()
            await server.close()

    with Store.open(kv, background=False) as store:
        assert all(r.ok for r in store.put_many(list(payloads.items())))
        results = asyncio.run(pull(store))
    assert len(results) == len(wanted)
    assert all(isinstance(r, Hit) and bytes(r.payload) == payloads[a] for r, a in zip(results, wanted, strict=True))


def test_a_long_pull_delivers_its_first_addresses_first(tmp_path: Path, cert_dir: Path) -> None:
    """A load asks layer-major so that a layer-wise engine can start on layer 0 early. The server
    answers a connection's PULLs round-robin (fair between callers), so a pull split into four PULLs
    submitted at once got its first 1,024 results only after ~4,000 had been sent; the client keeps
    PULL_WINDOW (2) PULLs of one pull in flight, so the first 1,024 arrive within ~2,048 sent."""
    from prometheus_client import CollectorRegistry

    from transports.core.metrics import TransportMetrics
    from transports.core.tracker import MAX_ADDRESSES_PER_PULL

    n, size = 4 * MAX_ADDRESSES_PER_PULL, 8 * 1024
    payloads = {BlockAddress(BlockHash(os.urandom(32)), 0): os.urandom(size) for _ in range(n)}
    wanted = list(payloads)
    kv = KVConfig(ram_gib=0.5, ssd_dir=str(tmp_path / "ssd"), index_dir=str(tmp_path / "index"), durable=False,
                  o_direct=False)
    registry = CollectorRegistry()

    def served() -> float:
        return registry.get_sample_value("kvfabric_served_total", {"transport": "tls-tcp", "outcome": "hit"}) or 0.0

    async def pull(store: Store) -> tuple[int, float]:
        server = create_server(TransportConfig(cert_dir=str(cert_dir), node_name="node-a"), store,
                               metrics=TransportMetrics(registry))
        host, port = await server.start()
        client = create_client(TransportConfig(cert_dir=str(cert_dir), node_name="node-b"))
        got, served_at_first_part = 0, 0.0
        try:
            async with asyncio.timeout(60):
                async for r in client.pull(Peer("node-a", host, port), wanted):
                    assert isinstance(r, Hit) and bytes(r.payload) == payloads[wanted[got]]
                    got += 1
                    if got == MAX_ADDRESSES_PER_PULL:
                        served_at_first_part = served()
            return got, served_at_first_part
        finally:
            await client.close()
            await server.close()

    with Store.open(kv, background=False) as store:
        assert all(r.ok for r in store.put_many(list(payloads.items())))
        got, served_then = asyncio.run(pull(store))
    assert got == n
    assert served_then <= 2.5 * MAX_ADDRESSES_PER_PULL, f"{served_then:.0f} results sent before the first 1,024 arrived"
