"""Index: msgpack rows in RocksDB column family `kv`, persistence, locking, reconciliation."""

from __future__ import annotations

import os
from pathlib import Path

import blake3
import msgpack
import pytest
from rocksdict import AccessType, Options, Rdict

from fabric.index import BadRowError, BlockMeta, Index, IndexUnavailableError, reconcile
from fabric.keys import StorageKey
from fabric.tiers.base import Tier, digest_of
from fabric.tiers.ssd import SsdTier, WriteItem


def key(i: int) -> StorageKey:
    return StorageKey(blake3.blake3(b"idx" + i.to_bytes(8, "little")).digest())


def meta(n: int = 100, layer: int = 0, model: str = "llama") -> BlockMeta:
    return BlockMeta(model, layer, n, b"\x07" * 32, 1000.0, 2000.0, Tier.SSD)


def test_rows_survive_reopen(tmp_path: Path) -> None:
    with Index(tmp_path / "idx") as idx:
        idx.put(key(1), meta(layer=5))
        idx.put_many([(key(2), meta()), (key(3), meta())])
        idx.delete_many([key(3)])
    with Index(tmp_path / "idx") as idx:
        assert idx.get(key(1)) == meta(layer=5)
        assert idx.get(key(2)) == meta()
        assert idx.get(key(3)) is None
        assert sorted(k for k, _ in idx.rows()) == sorted([key(1), key(2)])


def test_row_format_is_msgpack_in_column_family_kv(tmp_path: Path) -> None:
    with Index(tmp_path / "idx") as idx:
        idx.put(key(1), meta(n=4096, layer=7, model="m"))
    # Read it back with rocksdict alone, as any other tool would.
    db = Rdict(str(tmp_path / "idx"), options=Options(raw_mode=True),
               column_families={"kv": Options(raw_mode=True)}, access_type=AccessType.read_only())
    cf = db.get_column_family("kv")
    row = msgpack.unpackb(cf[key(1)])
    cf.close()
    db.close()
    del cf, db
    assert row == {"model": "m", "layer": 7, "bytes": 4096, "digest": b"\x07" * 32,
                   "created_unix": 1000.0, "last_seen_unix": 2000.0, "tier": "ssd", "hash": b""}


def test_row_keeps_the_block_hash_and_an_old_row_without_it_loads(tmp_path: Path) -> None:
    with Index(tmp_path / "idx") as idx:
        idx.put(key(1), BlockMeta("m", 1, 10, b"\x07" * 32, 1.0, 2.0, Tier.SSD, b"\x05" * 32))
        got = idx.get(key(1))
        assert got is not None and got.block_hash == b"\x05" * 32
    old = {"model": "m", "layer": 1, "bytes": 10, "digest": b"\x07" * 32, "created_unix": 1.0,
           "last_seen_unix": 2.0, "tier": "ssd"}
    assert BlockMeta.decode(msgpack.packb(old)).block_hash == b""
    with pytest.raises(BadRowError):
        BlockMeta.decode(msgpack.packb({**old, "hash": b"short"}))


def test_a_second_writer_is_refused_while_one_is_open(tmp_path: Path) -> None:
    with Index(tmp_path / "idx"), pytest.raises(IndexUnavailableError, match="cannot open index"):
        Index(tmp_path / "idx")


def test_read_only_sees_rows_and_refuses_writes(tmp_path: Path) -> None:
    with Index(tmp_path / "idx") as idx:
        idx.put(key(1), meta())
    with Index(tmp_path / "idx", read_only=True) as ro:
        assert ro.get(key(1)) == meta()
        with pytest.raises(IndexUnavailableError, match="read-only"):
            ro.put(key(2), meta())


def test_read_only_on_a_missing_index_says_so(tmp_path: Path) -> None:
    with pytest.raises(IndexUnavailableError, match="no index"):
        Index(tmp_path / "nothing-here", read_only=True)


def write_raw_row(path: Path, k: bytes, value: bytes) -> None:
    db = Rdict(str(path), options=Options(raw_mode=True), column_families={"kv": Options(raw_mode=True)})
    cf = db.get_column_family("kv")
    cf[k] = value
    cf.close()
    db.close()


def test_reconcile_removes_and_counts_every_kind_of_disagreement(tmp_path: Path) -> None:
    ssd = SsdTier(tmp_path / "ssd", capacity_bytes=1 << 30)
    for i in (0, 1, 2, 4):
        p = os.urandom(1000)
        ssd.write_file(WriteItem(key(i), 0, memoryview(p), digest_of(p), 1.0))
    with Index(tmp_path / "idx") as idx:
        idx.put(key(0), meta(n=1000))                # good: row + file
        # key(1): file without a row (the put died before its row)
        idx.put(key(2), meta(n=1000))                # size mismatch: file truncated below
        os.truncate(ssd.path_for(key(2), 0), 2000)
        idx.put(key(3), meta(n=1000))                # row without a file
        idx.put_many([(key(4), meta(n=1000))])       # good
    write_raw_row(tmp_path / "idx", key(5), b"\xc1garbage")   # a row that does not decode
    folder = ssd.folder_for(key(0))
    (folder / f".{key(0).hex()[:16]}-0.99.0.tmp").write_bytes(b"torn")
    (folder / "README").write_text("kept")

    with Index(tmp_path / "idx") as idx:
        report = reconcile(idx, ssd)
        assert report.counts == {"file_without_row": 1, "row_without_file": 1, "size_mismatch": 1,
                                 "bad_row": 1, "temp_file": 1}
        assert sorted(k for k, _ in report.kept) == sorted([key(0), key(4)])
        assert sorted(k for k, _ in idx.rows()) == sorted([key(0), key(4)])
        assert set(ssd.scan().files) == {(key(0).hex()[:16], 0), (key(4).hex()[:16], 0)}
        assert (folder / "README").exists()          # never delete what we did not write

        again = reconcile(idx, ssd)
        assert again.num_repaired == 0 and len(again.kept) == 2
