"""The chain of every block a node's KV events announced, kept on disk beside the store's index.

A KV event for a stored block says its parent and its tokens (cluster/events/log.py). The store keeps
payloads, not prompts, so after a restart the blocks found on SSD would be re-announced bare. This
table keeps, per block hash, what its first announcement said (a packed `ChainHint`: parent, token
ids, block size, extra keys), written when the block is announced and deleted when it leaves the
node; a restart re-announces from it and drops rows of blocks that did not survive.

One RocksDB under its own folder (rocksdict, raw bytes). Not thread-safe: the events' owner calls it.
Serving KV never depends on it: a missing row makes a bare announcement, never a wrong block.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from rocksdict import Options, Rdict

from fabric.keys import BlockHash


class Packable(Protocol):
    def pack(self) -> bytes: ...


T = TypeVar("T", bound=Packable)


class EventChains(Generic[T]):
    """block hash -> a record packed by `T.pack`, read back by `unpack`."""

    def __init__(self, path: str | Path, unpack: Callable[[bytes], T]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        self._db: Rdict | None = Rdict(str(self.path), options=opts)
        self._unpack = unpack

    def put(self, block_hash: BlockHash, record: T) -> None:
        assert self._db is not None
        self._db[bytes(block_hash)] = record.pack()

    def get(self, block_hash: BlockHash) -> T | None:
        assert self._db is not None
        raw = self._db.get(bytes(block_hash))
        if raw is None:
            return None
        try:
            return self._unpack(raw)
        except (ValueError, TypeError):     # a row from another version: announce the block bare
            return None

    def delete(self, block_hash: BlockHash) -> None:
        assert self._db is not None
        self._db.delete(bytes(block_hash))

    def keep_only(self, held: set[BlockHash]) -> None:
        """Drop the rows of blocks not in `held` (those that did not outlive the process)."""
        assert self._db is not None
        stale = [k for k in self._db.keys() if k not in held]  # noqa: SIM118
        for key in stale:
            self._db.delete(key)

    def __len__(self) -> int:
        assert self._db is not None
        return sum(1 for _ in self._db.keys())  # noqa: SIM118

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
