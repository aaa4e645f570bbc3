"""The SSD tier's on-disk file format: one self-describing, digest-checked file per (block, layer).

Layout on disk::

    <root>/<2 hex = key[0]>/<16 hex of key>-<layer>.kvb          a committed block
    <root>/<2 hex>/.<16 hex>-<layer>.<pid>.<n>.tmp               a write in progress (never read)

    file = header (HEADER_SIZE = 4096 bytes, so the payload starts page-aligned for O_DIRECT)
         + payload (length bytes)

    header  offset size
            0      4    magic b"KVFB"
            4      2    version (1)
            6      2    header size / 16   (256)
            8      4    flags (0)
            12     32   storage key
            44     4    layer (u32)
            48     8    payload length (u64)
            56     32   BLAKE3-256 digest of the payload
            88     8    created (unix seconds, f64)
            96     32   BLAKE3-256 of header bytes [0, 96)
            128    ...  zero padding up to 4096 (checked: any other byte there makes the block corrupt)

16 hex digits of the key name a file: two distinct keys of the same layer collide with
probability ~n^2 / 2^65; a collision is caught by the key check on read and served as a miss.
The tier that writes and reads these files is `fabric.tiers.ssd`.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import blake3

from fabric.keys import StorageKey
from fabric.tiers.base import CorruptBlockError

__all__ = ["HEADER_SIZE", "MAGIC", "VERSION", "Header", "ScannedFile", "SsdScan", "decode_header", "encode_header",
           "file_name", "scan_folder"]

MAGIC = b"KVFB"
VERSION = 1
HEADER_SIZE = 4096
_FIELDS = struct.Struct("<4sHHI32sIQ32sd")          # 96 bytes, followed by their BLAKE3 digest
_CHECKED = _FIELDS.size + 32
_PADDING = bytes(HEADER_SIZE - _CHECKED)
_NAME_RE = re.compile(r"^([0-9a-f]{16})-(\d+)\.kvb$")
_TEMP_RE = re.compile(r"^\.[0-9a-f]{16}-\d+\..*\.tmp$")


@dataclass(frozen=True, slots=True)
class ScannedFile:
    path: Path
    size: int


@dataclass(slots=True)
class SsdScan:
    """Every file under the root: committed blocks by (16-hex key prefix, layer), temp and foreign files."""

    files: dict[tuple[str, int], ScannedFile] = field(default_factory=dict)
    temp_files: list[Path] = field(default_factory=list)
    foreign_files: list[Path] = field(default_factory=list)


def file_name(key: bytes, layer: int) -> str:
    return f"{key.hex()[:16]}-{layer}.kvb"


def encode_header(key: bytes, layer: int, length: int, digest: bytes, created_unix: float) -> bytes:
    fields = _FIELDS.pack(MAGIC, VERSION, HEADER_SIZE // 16, 0, key, layer, length, digest, created_unix)
    return (fields + blake3.blake3(fields).digest()).ljust(HEADER_SIZE, b"\0")


@dataclass(frozen=True, slots=True)
class Header:
    key: bytes
    layer: int
    length: int
    digest: bytes
    created_unix: float


def decode_header(buf: bytes | memoryview, key: StorageKey) -> Header:
    """Parse and self-check a header; `key` names the block in errors. Raises CorruptBlockError."""
    if len(buf) < _CHECKED:
        raise CorruptBlockError(key, f"file shorter than its header ({len(buf)} bytes)")
    fields = bytes(buf[:_FIELDS.size])
    if blake3.blake3(fields).digest() != bytes(buf[_FIELDS.size:_CHECKED]):
        raise CorruptBlockError(key, "header checksum mismatch")
    if len(buf) >= HEADER_SIZE and buf[_CHECKED:HEADER_SIZE] != _PADDING:
        raise CorruptBlockError(key, "header padding is not zero")
    magic, version, size16, _flags, hkey, layer, length, digest, created = _FIELDS.unpack(fields)
    if magic != MAGIC or version != VERSION or size16 * 16 != HEADER_SIZE:
        raise CorruptBlockError(key, f"unknown format (magic {magic!r}, version {version})")
    return Header(hkey, layer, length, digest, created)


def scan_folder(root: Path) -> SsdScan:
    """Classify every file in the fan-out folders under `root`; changes nothing."""
    out = SsdScan()
    for i in range(256):
        folder = root / f"{i:02x}"
        if not folder.is_dir():
            continue
        with os.scandir(folder) as it:
            for de in it:
                if not de.is_file(follow_symlinks=False):
                    continue
                match = _NAME_RE.match(de.name)
                if match:
                    out.files[(match[1], int(match[2]))] = ScannedFile(Path(de.path), de.stat().st_size)
                elif _TEMP_RE.match(de.name):
                    out.temp_files.append(Path(de.path))
                else:
                    out.foreign_files.append(Path(de.path))
    return out
