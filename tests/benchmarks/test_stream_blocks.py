"""The bare stream baseline of the transfer benchmarks (benchmarks/lib/stream_blocks.py) over a real
loopback TCP connection: a request from block `first` on gets those blocks, in order, cycling through
the server's distinct blocks, so that the baseline reads as many distinct bytes as kvfabric's pulls."""

from __future__ import annotations

import os
import socket
import threading

from benchmarks.lib.stream_blocks import answer_requests, receive_blocks


def test_each_request_gets_its_blocks_from_the_first_it_names_cycling_through_the_distinct_ones() -> None:
    size = 4096
    blocks = [os.urandom(size) for _ in range(5)]
    listener = socket.create_server(("127.0.0.1", 0))
    served = threading.Thread(target=lambda: answer_requests(listener.accept()[0], {size: blocks}), daemon=True)
    served.start()
    conn = socket.create_connection(listener.getsockname())
    got: list[bytes] = []
    buf = memoryview(bytearray(size))
    try:
        for first, count in ((0, 2), (3, 4), (7, 1)):
            assert receive_blocks(conn, size, count, buf, lambda b: got.append(bytes(b)), first=first) == size * count
    finally:
        conn.close()
        served.join(timeout=10)
        listener.close()
    assert not served.is_alive(), "the server kept serving a closed connection"
    assert got == [blocks[i % 5] for i in (0, 1, 3, 4, 5, 6, 7)]
