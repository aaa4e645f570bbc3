"""RDMA transport: parameter exchange and control framing (no device needed), then a loopback
pull that runs only where pyverbs and an RDMA device exist."""

from __future__ import annotations

import asyncio
import os
import socket
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from support import creds, run

from fabric.config import TransportConfig
from fabric.keys import BlockAddress, BlockHash
from transports.core.base import Hit, Peer
from transports.factory import TransportUnavailableError, create_client, create_server
from transports.rdma.transport import (
    CONTROL_MAX,
    ControlDecoder,
    ControlError,
    RdmaClient,
    RdmaParams,
    RdmaServer,
    encode_control,
    exchange_params,
    gid_bytes,
    gid_text,
    rdma_unavailable_reason,
)
from transports.tls.channel import TlsChannel
from transports.tls.handshake import accept_tls, open_tls, tls_send_all

ROCE_GID = bytes.fromhex("fe80" + "00" * 6 + "0a0b0c0d0e0f1011")
PARAMS = RdmaParams(node="node-a", qp_num=0x1234, psn=0xABCDE, lid=0, gid=ROCE_GID, port_num=1, mtu=4096,
                    recv_slots=32, slot_size=1 << 20, max_payload=64 << 20)


# --- pure: parameters and control framing ------------------------------------------------------------


def test_params_survive_the_control_framing_split_anywhere() -> None:
    wire = encode_control(PARAMS.to_message()) + encode_control({"type": "later", "n": 1})
    for cut in range(len(wire) + 1):
        decoder = ControlDecoder()
        msgs = decoder.feed(wire[:cut]) + decoder.feed(wire[cut:])
        assert RdmaParams.from_message(msgs[0]) == PARAMS
        assert msgs[1] == {"type": "later", "n": 1}


BAD_FIELDS: dict[str, Any] = {
    "qp_num": 0, "psn": 1 << 24, "lid": 1 << 16, "port_num": 0, "mtu": 1500, "recv_slots": 0,
    "slot_size": 100, "max_payload": 0, "gid": b"\x00" * 15, "node": "",
}


@pytest.mark.parametrize("field", sorted(BAD_FIELDS))
def test_out_of_range_params_are_refused(field: str) -> None:
    msg = PARAMS.to_message() | {field: BAD_FIELDS[field]}
    with pytest.raises(ControlError, match=field):
        RdmaParams.from_message(msg)


@pytest.mark.parametrize("change", [
    {"qp_num": True},                  # a bool is not a queue pair number
    {"psn": "12"},
    {"gid": "fe80::1"},                # text where 16 bytes are due
    {"type": "hello"},
    {"v": 2},
    {"lid": 0, "gid": b"\x00" * 16},   # neither an InfiniBand LID nor a RoCE GID
])
def test_malformed_params_are_refused(change: dict[str, Any]) -> None:
    with pytest.raises(ControlError):
        RdmaParams.from_message(PARAMS.to_message() | change)


def test_missing_fields_and_peer_errors_are_named() -> None:
    msg = PARAMS.to_message()
    del msg["psn"]
    with pytest.raises(ControlError, match="lacks psn"):
        RdmaParams.from_message(msg)
    with pytest.raises(ControlError, match="no free queue pairs"):
        RdmaParams.from_message({"type": "error", "message": "no free queue pairs"})
    extra = PARAMS.to_message() | {"future_field": [1, 2]}  # newer peers may add keys
    assert RdmaParams.from_message(extra) == PARAMS


def test_control_decoder_refuses_bad_input() -> None:
    with pytest.raises(ControlError, match="exceeds"):
        ControlDecoder().feed((CONTROL_MAX + 1).to_bytes(4, "little"))  # refused before buffering
    with pytest.raises(ControlError, match="map"):
        ControlDecoder().feed(b"\x01\x00\x00\x00" + b"\x05")        # msgpack 5, not a map
    with pytest.raises(ControlError, match="msgpack"):
        ControlDecoder().feed(b"\x01\x00\x00\x00" + b"\xc1")        # reserved msgpack byte
    assert ControlDecoder().feed(b"\x05\x00\x00") == []             # incomplete: wait for more


def test_gid_text_round_trip() -> None:
    text = gid_text(PARAMS.gid)
    assert text == "fe80:0000:0000:0000:0a0b:0c0d:0e0f:1011"
    assert gid_bytes(text) == PARAMS.gid
    with pytest.raises(ValueError):
        gid_bytes("fe80::1")


# --- parameter exchange over the authenticated control connection (real TLS, no device) -------------


async def _control_pair(cert_dir: Path) -> tuple[TlsChannel, TlsChannel, socket.socket]:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    loop = asyncio.get_running_loop()
    dial = asyncio.ensure_future(open_tls(Peer("node-a", "127.0.0.1", port), creds(cert_dir, "client-1"), 5))
    raw, _ = await loop.sock_accept(listener)
    server_side = await accept_tls(raw, creds(cert_dir, "node-a"), 5)
    return await dial, server_side, listener


def test_exchange_swaps_params_after_the_responder_connects(cert_dir: Path) -> None:
    mine_client = replace(PARAMS, node="client-1", qp_num=77)
    order: list[str] = []

    async def main() -> None:
        client_sock, server_sock, listener = await _control_pair(cert_dir)
        try:
            def connect(theirs: RdmaParams) -> None:
                order.append(f"server connected to qp {theirs.qp_num}")

            server_view, client_view = await asyncio.gather(
                exchange_params(server_sock, PARAMS, initiator=False, expected_node="client-1", timeout_s=5,
                                before_reply=connect),
                exchange_params(client_sock, mine_client, initiator=True, expected_node="node-a", timeout_s=5))
            assert server_view == mine_client and client_view == PARAMS
            assert order == ["server connected to qp 77"]
        finally:
            client_sock.close()
            server_sock.close()
            listener.close()

    asyncio.run(main())


def test_exchange_refuses_params_naming_another_node(cert_dir: Path) -> None:
    async def main() -> None:
        client_sock, server_sock, listener = await _control_pair(cert_dir)
        try:
            liar = replace(PARAMS, node="node-b")  # the certificate says client-1
            await tls_send_all(client_sock, encode_control(liar.to_message()))
            with pytest.raises(ControlError, match="certificate names 'client-1'"):
                await exchange_params(server_sock, PARAMS, initiator=False, expected_node="client-1", timeout_s=5)
            await tls_send_all(client_sock, b"\xff\xff\xff\xff")  # garbage after that is refused too
            with pytest.raises(ControlError):
                await exchange_params(server_sock, PARAMS, initiator=False, expected_node="client-1", timeout_s=5)
        finally:
            client_sock.close()
            server_sock.close()
            listener.close()

    asyncio.run(main())


def test_exchange_times_out_on_a_silent_peer(cert_dir: Path) -> None:
    async def main() -> None:
        client_sock, server_sock, listener = await _control_pair(cert_dir)
        try:
            with pytest.raises(TimeoutError):
                await exchange_params(client_sock, PARAMS, initiator=True, expected_node="node-a", timeout_s=0.2)
        finally:
            client_sock.close()
            server_sock.close()
            listener.close()

    asyncio.run(main())


# --- device ------------------------------------------------------------------------------------------

UNAVAILABLE = rdma_unavailable_reason()


def test_from_config_builds_rdma_endpoints_with_the_config_settings(cert_dir: Path) -> None:
    # No device needed: the NIC is opened per connection, not at construction.
    config = TransportConfig(kind="rdma", cert_dir=str(cert_dir), node_name="node-a", max_inflight=3,
                             frame_timeout_s=7.0, max_payload_bytes=1 << 20)
    server = RdmaServer.from_config(config, creds(cert_dir, "node-a"), source=None)  # type: ignore[arg-type]
    client = RdmaClient.from_config(config, creds(cert_dir, "client-1"))
    assert isinstance(server, RdmaServer) and isinstance(client, RdmaClient)
    assert (server.transport, client.transport) == ("rdma", "rdma")
    assert (server.max_inflight, server.frame_timeout_s, server.max_payload) == (3, 7.0, 1 << 20)
    assert (client.frame_timeout_s, client.max_payload) == (7.0, 1 << 20)
    run(server.close())
    run(client.close())


@pytest.mark.skipif(UNAVAILABLE is None, reason="an RDMA device is present: the refusal path does not apply")
def test_factory_names_why_rdma_is_unavailable(cert_dir: Path) -> None:
    config = TransportConfig(kind="rdma", cert_dir=str(cert_dir), node_name="node-a")
    with pytest.raises(TransportUnavailableError, match="rdma") as info:
        create_server(config, source=None)  # type: ignore[arg-type]
    assert UNAVAILABLE is not None and UNAVAILABLE in str(info.value)
    with pytest.raises(TransportUnavailableError):
        create_client(config)


@pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))
def test_pull_over_rdma_loopback(cert_dir: Path, memory_source: Any) -> None:
    source = memory_source(num_blocks=8, num_layers=2, payload_size=300_000)
    missing = BlockAddress(BlockHash(os.urandom(32)), 0)

    async def main() -> None:
        server = RdmaServer(creds(cert_dir, "node-a"), source)
        host, port = await server.start()
        client = RdmaClient(creds(cert_dir, "client-1"))
        try:
            asked = [*source.addresses, missing]
            results = [r async for r in client.pull(Peer("node-a", host, port), asked)]
            assert [r.address for r in results] == asked
            assert all(isinstance(r, Hit) and bytes(r.payload) == source.blocks[r.address].payload
                       for r in results[:-1])
            assert not isinstance(results[-1], Hit)
        finally:
            await client.close()
            await server.close()

    asyncio.run(main())
