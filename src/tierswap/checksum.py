"""Checksums of every byte that leaves a process: xxh3-64, streamed, hex-encoded."""

from __future__ import annotations

from collections.abc import Iterable

import xxhash

ALGO = "xxh3_64"


def checksum_bytes(data: bytes | bytearray | memoryview) -> str:
    """Checksum of one buffer."""
    return xxhash.xxh3_64_hexdigest(data)


def hasher() -> xxhash.xxh3_64:
    """A streaming checksum: ``update`` it with the bytes in order, then ``hexdigest``."""
    return xxhash.xxh3_64()


def checksum_chunks(chunks: Iterable[bytes | bytearray | memoryview]) -> str:
    """Checksum of the concatenation of ``chunks``, without concatenating them."""
    h = xxhash.xxh3_64()
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()
