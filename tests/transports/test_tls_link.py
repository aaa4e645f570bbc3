"""TlsLink over a real mutual-TLS loopback connection: frames queued while the peer does not read
(their tails then share TLS records with the next frame's head) all arrive intact and in order."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

from support import creds

from fabric.keys import BlockAddress, BlockHash
from transports.core.base import Peer
from transports.core.codec import Block, End, Frame, FrameDecoder, Miss, MissReason
from transports.core.metrics import TransportMetrics
from transports.tls.handshake import accept_tls, open_tls
from transports.tls.link import TLS_RECORD, TlsLink


def _frames() -> list[Frame]:
    """Payload sizes around the record size and the 113-byte head, with payload-less frames between."""
    out: list[Frame] = []
    sizes = [64 << 10, 1, 0, TLS_RECORD - 113, TLS_RECORD - 112, TLS_RECORD, 3 * TLS_RECORD + 5, 1 << 20]
    for i, size in enumerate(sizes * 6):
        address = BlockAddress(BlockHash(os.urandom(32)), i)
        out.append(Block(i, address, os.urandom(32), os.urandom(size)))
        if i % 3 == 0:
            out.append(Miss(i, address, MissReason.NOT_FOUND))
    return [*out, End(7)]


def test_frames_queued_behind_a_peer_that_does_not_read_arrive_intact(cert_dir: Path) -> None:
    sent = _frames()
    received: list[Frame] = []
    closed: list[MissReason] = []

    async def main() -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        listener.setblocking(False)
        loop = asyncio.get_running_loop()
        dial = asyncio.ensure_future(open_tls(Peer("node-a", "127.0.0.1", listener.getsockname()[1]),
                                              creds(cert_dir, "client-1"), 5))
        raw, _ = await loop.sock_accept(listener)
        server_sock = await accept_tls(raw, creds(cert_dir, "node-a"), 5)
        client_sock = await dial
        metrics = TransportMetrics()
        sender = TlsLink(server_sock, FrameDecoder(), lambda frames: None, closed.append, 5.0, metrics, "test")
        receiver = TlsLink(client_sock, FrameDecoder(max_payload=2 << 20), received.extend, closed.append, 5.0,
                           metrics, "test", batch_frames=True)
        try:
            sender.start()
            for frame in sent:        # the receiver is not reading yet: the queue backs up
                sender.send(frame)
            assert sender.write_pending
            receiver.start()
            async with asyncio.timeout(10):
                while len(received) < len(sent):
                    await asyncio.sleep(0.01)
        finally:
            sender.close(MissReason.PEER_GONE, "test over")
            receiver.close(MissReason.PEER_GONE, "test over")
            listener.close()

    asyncio.run(main())
    assert len(received) == len(sent)
    for got, want in zip(received, sent, strict=True):
        if isinstance(want, Block):
            assert isinstance(got, Block)
            assert (got.request_id, got.address, got.digest, bytes(got.payload)) == (
                want.request_id, want.address, want.digest, bytes(want.payload))
        else:
            assert got == want
