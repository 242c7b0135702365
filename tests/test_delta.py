"""The delta codec: a snapshot rebuilt bit for bit from a base plus a delta, and a damaged
delta or a wrong base refused with CorruptPartError, never decoded into wrong bytes."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from tierswap import delta
from tierswap.errors import CorruptPartError

pytestmark = pytest.mark.timeout(60)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8]
CHUNK_ELEMENTS = 64
"""Small chunks in tests, so that a few hundred elements span several of them."""
# Header, one kind byte per chunk, trailer: what a delta of an unchanged buffer is made of.
OVERHEAD = struct.calcsize("<4sBBBBQIQ") + struct.calcsize("<Q")


def _tensor(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=gen) * 0.02).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**31)), min(info.max, 2**31 - 1), (n,), generator=gen).to(
        dtype
    )


def _perturb(t: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """``t`` with about ``fraction`` of its elements changed by a small amount."""
    gen = torch.Generator().manual_seed(seed + 1)
    picked = torch.rand(t.numel(), generator=gen) < fraction
    out = t.clone()
    if t.dtype.is_floating_point:
        step = 1 + 1e-3 * torch.randn(t.numel(), generator=gen)
        out[picked] = (t.float() * step).to(t.dtype)[picked]
    else:
        out[picked] = (t.long() + torch.randint(-3, 4, (t.numel(),), generator=gen)).to(t.dtype)[
            picked
        ]
    return out


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _chunk(itemsize: int) -> int:
    return CHUNK_ELEMENTS * itemsize


def _round_trip(base: bytes, new: bytes, itemsize: int, chunk: int) -> delta.Delta:
    d = delta.encode(base, new, chunk=chunk, itemsize=itemsize)
    wire = d.to_bytes()
    assert len(wire) == d.nbytes
    assert bytes(delta.decode(base, delta.Delta.from_bytes(wire))) == new
    assert bytes(delta.decode(base, d)) == new
    return d


sizes = st.sampled_from([0, 1, 3, CHUNK_ELEMENTS - 1, CHUNK_ELEMENTS, CHUNK_ELEMENTS + 1, 1000])


@settings(max_examples=150, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    n=sizes | st.integers(0, 3 * CHUNK_ELEMENTS),
    fraction=st.sampled_from([0.0, 0.01, 0.1, 0.5, 1.0]),
    seed=st.integers(0, 2**16),
    tail=st.integers(0, 7),
)
def test_round_trip_is_bit_exact(
    dtype: torch.dtype, n: int, fraction: float, seed: int, tail: int
) -> None:
    """Any dtype, any length (a tail that is not a whole element), any amount of change."""
    base_t = _tensor(dtype, n, seed)
    extra = bytes(range(tail))
    base = _bytes(base_t) + extra
    new = _bytes(_perturb(base_t, fraction, seed)) + extra[::-1]
    _round_trip(base, new, dtype.itemsize, _chunk(dtype.itemsize))


@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(max_size=600),
    flips=st.lists(st.tuples(st.integers(0, 599), st.integers(1, 255)), max_size=20),
    itemsize=st.sampled_from([1, 2, 3, 4, 8]),
    chunk_items=st.integers(1, 70),
)
def test_a_wrong_itemsize_or_mixed_dtypes_still_decode(
    data: bytes, flips: list[tuple[int, int]], itemsize: int, chunk_items: int
) -> None:
    """itemsize only affects the ratio: arbitrary bytes decode whatever it is set to."""
    new = bytearray(data)
    for pos, bit in flips:
        if pos < len(new):
            new[pos] ^= bit
    _round_trip(data, bytes(new), itemsize, chunk_items * itemsize)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 3, CHUNK_ELEMENTS - 1, CHUNK_ELEMENTS + 1, 5000])
def test_identical_inputs_give_only_headers(dtype: torch.dtype, n: int) -> None:
    base = _bytes(_tensor(dtype, n, seed=n))
    d = _round_trip(base, base, dtype.itemsize, _chunk(dtype.itemsize))
    assert d.payloads == ()
    assert d.nbytes == OVERHEAD + -(-len(base) // _chunk(dtype.itemsize))


@pytest.mark.parametrize("dtype", DTYPES)
def test_entirely_different_inputs_cost_little_more_than_raw(dtype: torch.dtype) -> None:
    n = 10_000
    base = np.random.default_rng(1).bytes(n * dtype.itemsize)
    new = np.random.default_rng(2).bytes(n * dtype.itemsize)
    chunk = _chunk(dtype.itemsize)
    d = _round_trip(base, new, dtype.itemsize, chunk)
    nchunks = -(-len(new) // chunk)
    assert d.counts()[delta.Kind.RAW] == nchunks
    assert d.nbytes <= len(new) + OVERHEAD + 5 * nchunks  # a kind byte and a size per chunk


@pytest.mark.parametrize(
    ("dtype", "bound"), [(torch.float32, 0.15), (torch.bfloat16, 0.15), (torch.int64, 0.05)]
)
def test_small_perturbations_compress(dtype: torch.dtype, bound: float) -> None:
    """10% of the elements changed by ~0.1%: the delta is a small part of the snapshot."""
    base_t = _tensor(dtype, 100_000, seed=3)
    base, new = _bytes(base_t), _bytes(_perturb(base_t, 0.1, seed=3))
    d = _round_trip(base, new, dtype.itemsize, delta.DEFAULT_CHUNK)
    assert d.nbytes < bound * len(new)


def test_each_chunk_gets_the_kind_that_fits_its_change() -> None:
    """Unchanged: a reference. One element: XOR. Every element a little: byte planes.
    Every element replaced by noise: raw."""
    base_t = _tensor(torch.float32, 10 * CHUNK_ELEMENTS, seed=4)
    new_t = base_t.clone()
    new_t[3 * CHUNK_ELEMENTS + 5] += 1.0
    new_t[5 * CHUNK_ELEMENTS : 6 * CHUNK_ELEMENTS] *= 1.001
    new_t[7 * CHUNK_ELEMENTS : 8 * CHUNK_ELEMENTS] = torch.randn(CHUNK_ELEMENTS)
    d = _round_trip(_bytes(base_t), _bytes(new_t), 4, _chunk(4))
    same, xor, planes, raw = delta.Kind
    assert list(d.kinds) == [same] * 3 + [xor, same, planes, same, raw] + [same] * 2


# ---------------------------------------------------------------- damage is detected


def _sample() -> tuple[bytes, bytes, bytes]:
    """A base, a snapshot, and the wire delta between them, with every kind of chunk."""
    base_t = _tensor(torch.float32, 6 * CHUNK_ELEMENTS + 7, seed=5)
    new_t = _perturb(base_t, 0.5, seed=5)
    new_t[:CHUNK_ELEMENTS] = base_t[:CHUNK_ELEMENTS]
    new_t[CHUNK_ELEMENTS : 2 * CHUNK_ELEMENTS] = torch.randn(CHUNK_ELEMENTS)
    new_t[2 * CHUNK_ELEMENTS : 3 * CHUNK_ELEMENTS] = base_t[2 * CHUNK_ELEMENTS : 3 * CHUNK_ELEMENTS]
    new_t[2 * CHUNK_ELEMENTS] += 1.0
    base, new = _bytes(base_t), _bytes(new_t)
    d = delta.encode(base, new, chunk=_chunk(4), itemsize=4)
    assert all(d.counts()[k] > 0 for k in delta.Kind)
    return base, new, d.to_bytes()


SAMPLE = _sample()


@settings(max_examples=200, deadline=None)
@given(pos=st.integers(0, len(SAMPLE[2]) - 1), bits=st.integers(1, 255))
def test_a_flipped_byte_is_detected(pos: int, bits: int) -> None:
    base, _, wire = SAMPLE
    damaged = bytearray(wire)
    damaged[pos] ^= bits
    with pytest.raises(CorruptPartError) as info:
        delta.decode(base, delta.Delta.from_bytes(damaged, where="rank-3.delta"))
    assert info.value.where == "rank-3.delta"


@settings(max_examples=30, deadline=None)
@given(cut=st.integers(0, len(SAMPLE[2]) - 1))
def test_a_truncated_delta_is_detected(cut: int) -> None:
    with pytest.raises(CorruptPartError):
        delta.Delta.from_bytes(SAMPLE[2][:cut])


@settings(max_examples=100, deadline=None)
@given(pos=st.integers(0, len(SAMPLE[0]) - 1), bits=st.integers(1, 255))
def test_a_wrong_base_is_refused_or_irrelevant(pos: int, bits: int) -> None:
    """A base that differs in a chunk stored raw does not matter; anywhere else it is refused."""
    base, new, wire = SAMPLE
    d = delta.Delta.from_bytes(wire)
    other = bytearray(base)
    other[pos] ^= bits
    if d.kinds[pos // d.chunk] == delta.Kind.RAW:
        assert bytes(delta.decode(other, d)) == new
    else:
        with pytest.raises(CorruptPartError, match="not the one"):
            delta.decode(other, d)


def test_a_base_of_another_length_is_refused() -> None:
    base, _, wire = SAMPLE
    with pytest.raises(CorruptPartError, match="base of"):
        delta.decode(base + b"\0", delta.Delta.from_bytes(wire))


def _reseal(body: bytes) -> bytes:
    """A crafted delta: damaged body, valid trailing checksum."""
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


@pytest.mark.parametrize(
    ("offset", "value", "why"),
    [(0, b"XSDL", "not a tierswap delta"), (4, b"\x02", "version 2"), (5, b"\x07", "codec 7")],
)
def test_a_crafted_header_is_refused(offset: int, value: bytes, why: str) -> None:
    body = bytearray(SAMPLE[2][:-8])
    body[offset : offset + len(value)] = value
    with pytest.raises(CorruptPartError, match=why):
        delta.Delta.from_bytes(_reseal(bytes(body)))


def test_a_crafted_index_is_refused() -> None:
    base, _, wire = SAMPLE
    d = delta.Delta.from_bytes(wire)
    bad_kind = dataclasses.replace(d, kinds=b"\x09" + d.kinds[1:])
    too_few = dataclasses.replace(d, payloads=d.payloads[1:])
    for crafted in (bad_kind, too_few):
        with pytest.raises(CorruptPartError, match=r"index|payloads"):
            delta.decode(base, crafted)


def test_a_crafted_payload_is_refused() -> None:
    base, _, wire = SAMPLE
    d = delta.Delta.from_bytes(wire)
    swapped = tuple(reversed(d.payloads))  # raw and compressed chunks in the wrong places
    with pytest.raises(CorruptPartError, match="chunk"):
        delta.decode(base, dataclasses.replace(d, payloads=swapped))


# ---------------------------------------------------------------- input checks, helpers


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"chunk": 6, "itemsize": 4}, "multiple of itemsize"),
        ({"chunk": 0}, "chunk=0"),
        ({"itemsize": 0}, "itemsize=0"),
        ({"level": 0}, "level=0"),
    ],
)
def test_bad_parameters_are_refused(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        delta.encode(b"abcd", b"abcd", **kwargs)


def test_buffers_of_different_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="same layout"):
        delta.encode(b"abcd", b"abc")


def test_decode_into_checks_its_output() -> None:
    base, new, wire = SAMPLE
    d = delta.Delta.from_bytes(wire)
    out = bytearray(len(new))
    delta.decode_into(base, d, memoryview(out))
    assert bytes(out) == new
    with pytest.raises(ValueError, match="overlaps"):
        shared = bytearray(base)
        delta.decode_into(memoryview(shared), d, memoryview(shared))
    with pytest.raises(ValueError, match="writable"):
        delta.decode_into(base, d, memoryview(new))


@settings(max_examples=50, deadline=None)
@given(data=st.binary(max_size=200), itemsize=st.integers(1, 9))
def test_planes_split_and_join_back(data: bytes, itemsize: int) -> None:
    src = np.frombuffer(data, dtype=np.uint8)
    planes, back = np.empty_like(src), np.empty_like(src)
    delta.split_planes(src, itemsize, planes)
    delta.join_planes(planes, itemsize, back)
    assert back.tobytes() == data
    whole = len(data) - len(data) % itemsize
    assert planes[: whole // itemsize].tobytes() == data[:whole:itemsize]


def test_changed_fraction() -> None:
    base_t = torch.zeros(10 * CHUNK_ELEMENTS)
    new_t = base_t.clone()
    new_t[[3, 5, CHUNK_ELEMENTS * 4]] = 1.0
    base, new = _bytes(base_t), _bytes(new_t)
    change = delta.changed_fraction(base, new, chunk=_chunk(4), itemsize=4)
    assert change == delta.Change(chunks=0.2, elements=3 / len(base_t))
    assert delta.changed_fraction(base, base, chunk=_chunk(4)) == delta.Change(0.0, 0.0)
    assert delta.changed_fraction(b"", b"") == delta.Change(0.0, 0.0)
