"""Differential snapshots: a snapshot buffer encoded against a base buffer of the same length.

Training changes some bytes of a snapshot a little from one step to the next (parameters and
optimizer state under small updates) and others not at all (frozen layers, optimizer state of
frozen parameters, embedding rows no batch touched). A delta stores only the difference. The
buffer is cut into chunks of ``chunk`` bytes, and each chunk is one of four kinds:

- ``SAME``: equal to the base's chunk; stored as a reference, no bytes.
- ``PLANES``: XORed with the base's chunk, split into byte planes (byte *i* of every
  ``itemsize``-wide element together), then compressed with zstd. A small change of a float
  flips low mantissa bits and leaves sign and exponent alone, so the planes of high bytes are
  nearly all zeros and compress to almost nothing.
- ``XOR``: XORed and compressed without the split, when few elements changed (fewer than a
  quarter of the chunk's 8-byte words differ): then the changed bytes of an element are better
  kept together, and skipping the split is faster too (`tierswap bench delta`).
- ``RAW``: the snapshot's bytes as they are, when the XOR does not compress.

``itemsize`` only affects the ratio: it is stored in the delta, so a buffer of mixed dtypes, or
one encoded with the "wrong" itemsize, still decodes bit for bit.

Wire format (little-endian), written by :meth:`Delta.to_bytes`::

    magic "TSDL" | version u8 | codec u8 (1 = zstd) | itemsize u8 | reserved u8 (0)
    length u64 | chunk u32 | snapshot xxh3-64 u64
    kind u8 per chunk                      (ceil(length / chunk) of them)
    size u32 per chunk that is not SAME    (bytes of its payload)
    payloads, in chunk order
    xxh3-64 u64 of everything above

The trailing checksum makes a corrupt delta fail in :meth:`Delta.from_bytes`; the snapshot's
checksum makes a delta applied to another base fail in :func:`decode`. Both raise
:class:`~tierswap.errors.CorruptPartError`; neither ever returns wrong bytes.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import xxhash
import zstandard

from tierswap.errors import CorruptPartError

Buffer = bytes | bytearray | memoryview
Bytes = npt.NDArray[np.uint8]

VERSION = 1
MAGIC = b"TSDL"
DEFAULT_CHUNK = 1 << 20
DEFAULT_LEVEL = 1
"""zstd level 1: see ``tierswap bench delta`` for the measurements behind it."""
_CODEC_ZSTD = 1
_HEADER = struct.Struct("<4sBBBBQIQ")
_TRAILER = struct.Struct("<Q")
_SIZE = np.dtype("<u4")
_MAX_CHUNK = (1 << 32) - 1


class Kind(enum.IntEnum):
    """How one chunk of the snapshot is stored."""

    SAME = 0
    """Equal to the base's chunk: no bytes."""
    XOR = 1
    """XOR with the base's chunk, zstd-compressed (few elements changed)."""
    PLANES = 2
    """XOR with the base's chunk, split into byte planes, zstd-compressed."""
    RAW = 3
    """The snapshot's own bytes (the XOR did not compress)."""


DENSE = 0.25
"""Byte planes are used when at least this fraction of a chunk's 8-byte words changed."""


@dataclass(frozen=True, slots=True)
class Delta:
    """A snapshot of ``length`` bytes, as the difference from a base of the same length."""

    length: int
    """Bytes of the snapshot (and of the base it was made against)."""
    chunk: int
    """Bytes per chunk; the last chunk may be shorter."""
    itemsize: int
    """Width in bytes of the elements whose byte planes were split."""
    checksum: int
    """xxh3-64 of the snapshot: what decoding must rebuild."""
    kinds: bytes
    """One :class:`Kind` per chunk."""
    payloads: tuple[Buffer, ...]
    """One per chunk that is not ``SAME``, in chunk order. After :meth:`from_bytes` these are
    views of its input, which must not change while the delta is in use."""

    @property
    def nbytes(self) -> int:
        """Size of :meth:`to_bytes`, without building it."""
        index = len(self.kinds) + _SIZE.itemsize * len(self.payloads)
        return _HEADER.size + index + sum(len(p) for p in self.payloads) + _TRAILER.size

    def counts(self) -> dict[Kind, int]:
        """Number of chunks of each kind."""
        kinds = np.frombuffer(self.kinds, dtype=np.uint8)
        return {k: int(np.count_nonzero(kinds == k)) for k in Kind}

    def to_bytes(self) -> bytes:
        """The wire format described in the module docstring."""
        header = _HEADER.pack(
            MAGIC, VERSION, _CODEC_ZSTD, self.itemsize, 0, self.length, self.chunk, self.checksum
        )
        sizes = np.array([len(p) for p in self.payloads], dtype=_SIZE).tobytes()
        body = b"".join([header, self.kinds, sizes, *self.payloads])
        return body + _TRAILER.pack(xxhash.xxh3_64_intdigest(body))

    @staticmethod
    def from_bytes(data: Buffer, *, where: str = "delta") -> Delta:
        """Parse :meth:`to_bytes`'s output; CorruptPartError(where, ...) if it is damaged."""
        view = memoryview(data).cast("B")
        if len(view) < _HEADER.size + _TRAILER.size:
            raise CorruptPartError(where, f"truncated: {len(view)} bytes, less than a header")
        body = view[: -_TRAILER.size]
        (want,) = _TRAILER.unpack(view[-_TRAILER.size :])
        got = xxhash.xxh3_64_intdigest(body)
        if got != want:
            raise CorruptPartError(
                where, f"the delta's bytes are corrupt: xxh3-64 {got:016x}, stored {want:016x}"
            )
        return _parse(body, where)


def _parse(body: memoryview, where: str) -> Delta:
    magic, version, codec, itemsize, reserved, length, chunk, checksum = _HEADER.unpack(
        body[: _HEADER.size]
    )
    if magic != MAGIC:
        raise CorruptPartError(where, f"not a tierswap delta (magic {bytes(magic)!r})")
    if version != VERSION:
        raise CorruptPartError(where, f"delta format version {version}; this reads {VERSION}")
    if codec != _CODEC_ZSTD or reserved != 0 or itemsize == 0 or chunk == 0:
        raise CorruptPartError(
            where, f"bad header: codec {codec}, itemsize {itemsize}, chunk {chunk}"
        )
    nchunks = -(-length // chunk)
    kinds_end = _HEADER.size + nchunks
    if len(body) < kinds_end:
        raise CorruptPartError(where, f"truncated: {nchunks} chunks need a longer index")
    kinds = bytes(body[_HEADER.size : kinds_end])
    stored = len(kinds) - kinds.count(Kind.SAME)
    sizes_end = kinds_end + _SIZE.itemsize * stored
    if len(body) < sizes_end:
        raise CorruptPartError(where, f"truncated: {stored} stored chunks need a longer index")
    sizes = np.frombuffer(body[kinds_end:sizes_end], dtype=_SIZE).astype(np.int64)
    if int(sizes.sum()) != len(body) - sizes_end:
        raise CorruptPartError(
            where, f"payloads are {len(body) - sizes_end} bytes, the index says {sizes.sum()}"
        )
    ends = (sizes_end + np.cumsum(sizes)).tolist()
    starts = [sizes_end, *ends][: len(ends)]
    payloads = tuple(body[s:e] for s, e in zip(starts, ends, strict=True))
    return Delta(length, chunk, itemsize, checksum, kinds, payloads)


# ---------------------------------------------------------------- byte planes


def use_planes(xor: Bytes) -> bool | None:
    """None if ``xor`` is all zeros (the chunk did not change), else whether to split it into
    byte planes before compressing: only when many elements changed (see :data:`DENSE`)."""
    whole = len(xor) - len(xor) % 8
    changed = int(np.count_nonzero(xor[:whole].view(np.uint64)))
    changed += int(np.count_nonzero(xor[whole:]))
    if not changed:
        return None
    return changed >= DENSE * -(-len(xor) // 8)


def split_planes(data: Bytes, itemsize: int, out: Bytes) -> None:
    """Write ``data``'s byte planes to ``out``: byte 0 of every element, then byte 1, ...

    A tail shorter than ``itemsize`` is copied as it is, after the planes. One strided copy
    per plane: numpy's transposing copy of an (n, itemsize) array is several times slower.
    """
    whole = len(data) - len(data) % itemsize
    n = whole // itemsize
    if itemsize == 2:  # bf16, fp16: two vectorized passes over 16-bit words are faster still
        words = data[:whole].view("<u2")
        np.copyto(out[:n], words, casting="unsafe")  # keeps the low byte
        np.copyto(out[n:whole], words >> 8, casting="unsafe")
    else:
        elements = data[:whole].reshape(n, itemsize)
        for i in range(itemsize):
            out[i * n : (i + 1) * n] = elements[:, i]
    out[whole:] = data[whole:]


def join_planes(planes: Bytes, itemsize: int, out: Bytes) -> None:
    """Inverse of :func:`split_planes`."""
    whole = len(planes) - len(planes) % itemsize
    n = whole // itemsize
    if itemsize == 2:
        words = out[:whole].view("<u2")
        np.copyto(words, planes[n:whole])
        words <<= 8
        words |= planes[:n]
    else:
        elements = out[:whole].reshape(n, itemsize)
        for i in range(itemsize):
            elements[:, i] = planes[i * n : (i + 1) * n]
    out[whole:] = planes[whole:]


# ---------------------------------------------------------------- encode, decode


def encode(
    base: Buffer,
    new: Buffer,
    *,
    chunk: int = DEFAULT_CHUNK,
    itemsize: int = 4,
    level: int = DEFAULT_LEVEL,
) -> Delta:
    """The delta that turns ``base`` into ``new`` (same length). It owns its bytes: both
    buffers may change as soon as this returns.

    ``itemsize`` is the width of the buffer's elements (2 for bf16/fp16, 4 for fp32/int32,
    8 for int64); a wrong one costs ratio, never correctness. ``level`` is zstd's.
    """
    b, n = _as_bytes(base), _as_bytes(new)
    if len(b) != len(n):
        raise ValueError(
            f"base has {len(b)} bytes and new has {len(n)}: a delta is made against a base "
            "of the same layout; encode a full snapshot when the layout changed"
        )
    _check_params(chunk, itemsize, level)
    compressor = zstandard.ZstdCompressor(level=level)
    scratch = np.empty((2, min(chunk, len(n))), dtype=np.uint8)
    kinds = bytearray(-(-len(n) // chunk))
    payloads: list[Buffer] = []
    for i, start in enumerate(range(0, len(n), chunk)):
        nc = n[start : start + chunk]
        kind, payload = _encode_chunk(b[start : start + chunk], nc, itemsize, compressor, scratch)
        kinds[i] = kind
        if payload is not None:
            payloads.append(payload)
    checksum = xxhash.xxh3_64_intdigest(n.data)
    return Delta(len(n), chunk, itemsize, checksum, bytes(kinds), tuple(payloads))


def decode(base: Buffer, delta: Delta, *, where: str = "delta") -> bytearray:
    """The snapshot ``delta`` was made from, rebuilt from ``base``.

    Raises CorruptPartError(where, ...) if the delta is damaged or ``base`` is not the buffer
    it was made against.
    """
    out = bytearray(delta.length)
    decode_into(base, delta, memoryview(out), where=where)
    return out


def decode_into(base: Buffer, delta: Delta, out: memoryview, *, where: str = "delta") -> None:
    """:func:`decode` into ``out`` (``delta.length`` writable bytes that do not overlap
    ``base``). On CorruptPartError ``out`` holds garbage."""
    b, o = _as_bytes(base), _as_bytes(out)
    if len(o) != delta.length or not o.flags.writeable:
        raise ValueError(f"out must be {delta.length} writable bytes, it is {len(o)}")
    if np.may_share_memory(b, o):
        raise ValueError("out overlaps base: decode into another buffer")
    if len(b) != delta.length:
        raise CorruptPartError(
            where, f"made against a base of {delta.length} bytes, this base has {len(b)}"
        )
    _check_index(delta, where)
    decompressor = zstandard.ZstdDecompressor()
    payloads = iter(delta.payloads)
    for i, kind in enumerate(delta.kinds):
        s = slice(i * delta.chunk, (i + 1) * delta.chunk)
        if kind == Kind.SAME:
            o[s] = b[s]
        else:
            _decode_chunk(b[s], o[s], kind, next(payloads), delta.itemsize, decompressor, where, i)
    got = xxhash.xxh3_64_intdigest(o.data)
    if got != delta.checksum:
        raise CorruptPartError(
            where,
            f"rebuilt snapshot has xxh3-64 {got:016x}, the delta says {delta.checksum:016x}: "
            "the base is not the one the delta was made against, or the delta was damaged "
            "after it was read",
        )


def _encode_chunk(
    base: Bytes, new: Bytes, itemsize: int, compressor: zstandard.ZstdCompressor, scratch: Bytes
) -> tuple[Kind, bytes | None]:
    """One chunk's kind and payload; ``scratch`` is two rows of at least ``len(new)`` bytes."""
    xor, planes = scratch[0, : len(new)], scratch[1, : len(new)]
    np.bitwise_xor(base, new, out=xor)
    dense = use_planes(xor)
    if dense is None:
        return Kind.SAME, None
    if dense:
        split_planes(xor, itemsize, planes)
    packed = compressor.compress((planes if dense else xor).data)
    if len(packed) < len(new):
        return Kind.PLANES if dense else Kind.XOR, packed
    return Kind.RAW, new.tobytes()


def _decode_chunk(
    base: Bytes,
    out: Bytes,
    kind: int,
    payload: Buffer,
    itemsize: int,
    decompressor: zstandard.ZstdDecompressor,
    where: str,
    index: int,
) -> None:
    """Write one chunk that is not SAME into ``out``."""
    if kind == Kind.RAW:
        if len(payload) != len(out):
            raise CorruptPartError(
                where, f"chunk {index}: {len(payload)} raw bytes, not {len(out)}"
            )
        out[:] = np.frombuffer(payload, dtype=np.uint8)
        return
    try:
        # Checked before decompressing, which would allocate what the frame claims.
        declared = zstandard.frame_content_size(payload)
        if declared != len(out):
            raise CorruptPartError(where, f"chunk {index}: {declared} bytes, not {len(out)}")
        raw = decompressor.decompress(payload, max_output_size=len(out), allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise CorruptPartError(where, f"chunk {index}: zstd: {e}") from e
    if len(raw) != len(out):
        raise CorruptPartError(where, f"chunk {index}: {len(raw)} bytes, not {len(out)}")
    if kind == Kind.PLANES:
        join_planes(np.frombuffer(raw, dtype=np.uint8), itemsize, out)
    else:
        out[:] = np.frombuffer(raw, dtype=np.uint8)
    np.bitwise_xor(out, base, out=out)


# ---------------------------------------------------------------- statistics


@dataclass(frozen=True, slots=True)
class Change:
    """How much of a snapshot differs from its base."""

    chunks: float
    """Fraction of the bytes that lie in chunks that differ (what a delta must store)."""
    elements: float
    """Fraction of ``itemsize``-wide elements that differ (a short tail counts as one)."""


def changed_fraction(
    base: Buffer, new: Buffer, *, chunk: int = DEFAULT_CHUNK, itemsize: int = 4
) -> Change:
    """How much of ``new`` differs from ``base`` (same length), by chunk and by element."""
    b, n = _as_bytes(base), _as_bytes(new)
    if len(b) != len(n):
        raise ValueError(f"base has {len(b)} bytes and new has {len(n)}: they must be equal")
    _check_params(chunk, itemsize, DEFAULT_LEVEL)
    changed_bytes = changed_elements = 0
    for start in range(0, len(n), chunk):
        differs = _differing_elements(b[start : start + chunk], n[start : start + chunk], itemsize)
        changed_elements += differs
        changed_bytes += len(n[start : start + chunk]) if differs else 0
    elements = -(-len(n) // itemsize)
    return Change(changed_bytes / max(len(n), 1), changed_elements / max(elements, 1))


def _differing_elements(b: Bytes, n: Bytes, itemsize: int) -> int:
    whole = len(n) - len(n) % itemsize
    rows = (b[:whole] != n[:whole]).reshape(-1, itemsize).any(axis=1)
    return int(np.count_nonzero(rows)) + int(not np.array_equal(b[whole:], n[whole:]))


# ---------------------------------------------------------------- helpers


def _as_bytes(buf: Buffer) -> Bytes:
    """A flat uint8 array over ``buf``'s bytes (no copy)."""
    return np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)


def _check_params(chunk: int, itemsize: int, level: int) -> None:
    if not 1 <= itemsize <= 255:
        raise ValueError(f"itemsize={itemsize}: give the element width in bytes (1 to 255)")
    if not 0 < chunk <= _MAX_CHUNK or chunk % itemsize:
        raise ValueError(
            f"chunk={chunk}: it must be a positive multiple of itemsize={itemsize} "
            f"below 4 GiB (the default is {DEFAULT_CHUNK})"
        )
    if not 1 <= level <= zstandard.MAX_COMPRESSION_LEVEL:
        raise ValueError(
            f"level={level}: zstd levels go from 1 to {zstandard.MAX_COMPRESSION_LEVEL}"
        )


def _check_index(delta: Delta, where: str) -> None:
    """Structural checks of a delta that did not come through from_bytes."""
    if delta.chunk <= 0 or delta.itemsize <= 0:
        raise CorruptPartError(where, f"chunk {delta.chunk}, itemsize {delta.itemsize}")
    nchunks = -(-delta.length // delta.chunk)
    if len(delta.kinds) != nchunks or max(delta.kinds, default=Kind.SAME) > Kind.RAW:
        raise CorruptPartError(where, f"the index does not describe {nchunks} chunks")
    stored = nchunks - delta.kinds.count(Kind.SAME)
    if stored != len(delta.payloads):
        raise CorruptPartError(where, f"{len(delta.payloads)} payloads for {stored} chunks")
