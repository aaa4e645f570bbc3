"""The record-layer baseline of the transfer benchmarks (benchmarks/lib/stream_records.py) over a real
mutual-TLS loopback connection: the blocks asked for arrive intact and in order through kvfabric's
own record layer, a block's last record included (its content-type byte does not fit in the block's
buffer), and a client whose certificate is not from the cluster CA gets nothing."""

from __future__ import annotations

import os
import socket
import ssl
import threading
from pathlib import Path

import pytest
from testkit import Pki, PkiFactory

from benchmarks.lib import stream_records
from transports.tls.records import MAX_CONTENT


@pytest.fixture(scope="module")
def pki(make_pki: PkiFactory, tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("certs"), "node-a", "client-1")


def _stop(listener: socket.socket) -> None:
    listener.shutdown(socket.SHUT_RDWR)   # wakes an accept() that is waiting (close alone does not)
    listener.close()


def _serve(blocks: dict[int, list[bytes]], pki: Pki) -> tuple[socket.socket, threading.Thread]:
    listener = socket.create_server(("127.0.0.1", 0))
    served = threading.Thread(target=stream_records.serve, args=(listener, pki.credentials("node-a"), blocks),
                              daemon=True)
    served.start()
    return listener, served


@pytest.mark.parametrize("size", [4096, 3 * MAX_CONTENT, 3 * MAX_CONTENT + 5], ids=["small", "whole-records", "odd"])
def test_blocks_arrive_intact_in_order_from_the_first_asked_for(pki: Pki, size: int) -> None:
    blocks = [os.urandom(size) for _ in range(5)]
    listener, served = _serve({size: blocks}, pki)
    stream = stream_records.dial(listener.getsockname()[1], pki.credentials("client-1"), "node-a")
    got: list[bytes] = []
    buf = memoryview(bytearray(size))
    try:
        for first, count in ((0, 2), (3, 4)):
            stream.send_request(size, first, count)
            for _ in range(count):
                assert stream.read_into(buf)
                got.append(bytes(buf))
        assert stream_records.receive_blocks(stream, size, 3, buf, first=7) == 3 * size
        assert bytes(buf) == blocks[9 % 5]
    finally:
        stream.close()
        _stop(listener)
    served.join(timeout=10)
    assert not served.is_alive(), "the server kept accepting on a closed listener"
    assert got == [blocks[i % 5] for i in (0, 1, 3, 4, 5, 6)]


def test_a_client_from_another_ca_gets_nothing(pki: Pki, make_pki: PkiFactory, tmp_path: Path) -> None:
    other = make_pki(tmp_path / "other-ca", "client-1")
    block = os.urandom(4096)
    listener, served = _serve({4096: [block]}, pki)
    buf = memoryview(bytearray(4096))
    try:
        with pytest.raises((ssl.SSLError, ConnectionError)):   # refused by an alert, or the socket closed
            refused = stream_records.dial(listener.getsockname()[1], other.credentials("client-1"), "node-a")
            try:
                stream_records.receive_blocks(refused, 4096, 1, buf)   # TLS 1.3: the server's refusal may come now
            finally:
                refused.close()
        # the server refused that one and serves the next client
        stream = stream_records.dial(listener.getsockname()[1], pki.credentials("client-1"), "node-a")
        stream_records.receive_blocks(stream, 4096, 1, buf)
        stream.close()
        assert served.is_alive() and bytes(buf) == block
    finally:
        _stop(listener)
    served.join(timeout=10)
    assert not served.is_alive(), "the server kept accepting on a closed listener"
