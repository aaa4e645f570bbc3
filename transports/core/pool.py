"""The clients' connection pool and retry rule, shared by TLS-TCP (and RDMA over it) and QUIC.

    pull(peer) ─► pool.connection(peer, dial) ─► (the pooled connection, reused=True)
                         │ none open to that node at that address
                         ▼ under the node's dial lock (concurrent pulls wait for one dial)
                  drop(the stale one, if any) ─► dial(peer) ─► (new connection or None, reused=False)

One connection per peer node: a pooled connection that closed, or that reaches the node at an
address it no longer has, is dropped (the client's `drop` closes it and takes it out with
`discard`) before a new one is dialled. A pull on a reused connection that was already gone (peer
restarted, idle close) and answered nothing is made again, `STALE_RETRIES` times, on a new
connection: PULL is idempotent (`may_redial`). Dials of a node are serialised by a lock that is
forgotten once no dial waits on it, so the lock table stays as small as the set of dials in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Generic, Protocol, TypeVar

from transports.core.base import Peer

STALE_RETRIES = 1   # a pull whose reused connection was gone before answering is made again this often


def may_redial(reused: bool, answered: bool, attempt: int) -> bool:
    """Whether a pull that ended on a reused connection before the server answered anything is made
    again on a new one (`attempt`: the redials made so far)."""
    return reused and not answered and attempt < STALE_RETRIES


class Pooled(Protocol):
    """What the pool needs of a connection: the peer it reaches, and whether it is closed."""

    @property
    def peer(self) -> Peer: ...

    @property
    def closed(self) -> bool: ...


C = TypeVar("C", bound=Pooled)


class ConnectionPool(Generic[C]):
    """One open connection per peer node, dialled once however many pulls ask for it at once."""

    def __init__(self, drop: Callable[[C], Awaitable[None]]) -> None:
        """`drop(conn)`: close a stale pooled connection and `discard` it (called under the dial lock)."""
        self._drop = drop
        self._open: dict[str, C] = {}               # peer node -> its pooled connection
        self._dialing: dict[str, asyncio.Lock] = {}

    def get(self, peer: Peer) -> C | None:
        """The pooled connection to `peer`'s node at `peer`'s address, when it is open."""
        conn = self._open.get(peer.node)
        return conn if conn is not None and not conn.closed and conn.peer == peer else None

    def entry(self, node: str) -> C | None:
        """The connection pooled for `node`, open or not."""
        return self._open.get(node)

    async def connection(self, peer: Peer, dial: Callable[[Peer], Awaitable[C | None]]) -> tuple[C | None, bool]:
        """(the pooled connection to `peer` or a new one from `dial`, None when none can be had;
        whether it was reused). `dial` adds what it made with `add`."""
        found = self.get(peer)
        if found is not None:
            return found, True
        lock = self._dialing.setdefault(peer.node, asyncio.Lock())
        try:
            async with lock:
                found = self.get(peer)
                if found is not None:
                    return found, True
                stale = self._open.get(peer.node)
                if stale is not None:
                    await self._drop(stale)
                    self.discard(stale)
                return await dial(peer), False
        finally:
            if not lock.locked() and self._dialing.get(peer.node) is lock:
                del self._dialing[peer.node]   # no dial of this node waits: forget its lock

    def add(self, conn: C) -> None:
        self._open[conn.peer.node] = conn

    def discard(self, conn: C) -> bool:
        """Take `conn` out of the pool; False when it was not the pooled one (already replaced)."""
        if self._open.get(conn.peer.node) is conn:
            del self._open[conn.peer.node]
            return True
        return False

    def __iter__(self) -> Iterator[C]:
        return iter(list(self._open.values()))

    def __len__(self) -> int:
        return len(self._open)
