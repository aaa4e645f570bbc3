"""The clients' shared connection pool and retry rule (transports/core/pool.py), sans sockets."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from transports.core.base import Peer
from transports.core.pool import STALE_RETRIES, ConnectionPool, may_redial


@dataclass
class Conn:
    peer: Peer
    closed: bool = False


class Dialer:
    def __init__(self) -> None:
        self.dials: list[Peer] = []
        self.dropped: list[Conn] = []
        self.pool: ConnectionPool[Conn] = ConnectionPool(self.drop)

    async def drop(self, conn: Conn) -> None:
        self.dropped.append(conn)
        conn.closed = True

    async def dial(self, peer: Peer) -> Conn | None:
        self.dials.append(peer)
        await asyncio.sleep(0)   # other pulls of the node arrive meanwhile
        if peer.host == "unreachable":
            return None
        conn = Conn(peer)
        self.pool.add(conn)
        return conn


def test_pulls_arriving_together_share_one_dial_and_later_ones_reuse_it() -> None:
    async def go() -> None:
        d = Dialer()
        peer = Peer("node-a", "127.0.0.1", 7000)
        got = await asyncio.gather(*(d.pool.connection(peer, d.dial) for _ in range(5)))
        assert len(d.dials) == 1 and len({id(conn) for conn, _ in got}) == 1
        assert [reused for _, reused in got] == [False, True, True, True, True]
        assert d.pool.get(peer) is got[0][0]
    asyncio.run(go())


def test_a_closed_or_moved_connection_is_dropped_before_the_node_is_dialled_again() -> None:
    async def go() -> None:
        d = Dialer()
        old = Peer("node-a", "127.0.0.1", 7000)
        first, _ = await d.pool.connection(old, d.dial)
        assert first is not None
        moved = Peer("node-a", "127.0.0.1", 7001)          # restarted on another port
        second, reused = await d.pool.connection(moved, d.dial)
        assert second is not None and second.peer == moved and not reused
        assert d.dropped == [first] and first.closed and len(d.pool) == 1
        second.closed = True                                # e.g. an idle close
        third, reused = await d.pool.connection(moved, d.dial)
        assert third is not second and not reused and d.dropped == [first, second]
    asyncio.run(go())


def test_an_unreachable_peer_gives_none_and_pools_nothing() -> None:
    async def go() -> None:
        d = Dialer()
        conn, reused = await d.pool.connection(Peer("node-b", "unreachable", 1), d.dial)
        assert conn is None and not reused and len(d.pool) == 0
    asyncio.run(go())


def test_only_a_reused_connection_that_answered_nothing_is_redialled_and_only_so_often() -> None:
    assert may_redial(reused=True, answered=False, attempt=0)
    assert not may_redial(reused=False, answered=False, attempt=0)       # a fresh dial that failed: a miss
    assert not may_redial(reused=True, answered=True, attempt=0)         # something came back: no replay
    assert not may_redial(reused=True, answered=False, attempt=STALE_RETRIES)
