"""Which compressor the delta codec (tierswap.delta) should use, measured on training updates.

Builds the snapshot buffer of a few training states (tierswap.state's real layout) before and
after one optimizer step, then encodes the second against the first and decodes it back:

  (a) pretraining: GPT (examples/gpt.py, n_embd 256), fp32 params + AdamW exp_avg/exp_avg_sq
  (b) the same GPT trained in pure bf16 with AdamW: its bf16 parameters only
  (c) fine-tuning the fp32 GPT with ~10% of its tensors trainable: params + AdamW state
  (d) a 200k x 64 fp32 embedding table, one step touching 1% of its rows:
      SGD (no state), SparseAdam (params + state), AdamW (params + state; its weight decay
      moves every row at every step, and its moments move every row that ever had a gradient)

Every variant runs tierswap.delta's chunked pipeline (chunks equal to the base's are
references; changed chunks are XORed, split into byte planes when at least a quarter of their
8-byte words changed, compressed, stored raw if that is not smaller) with zstd level 1, zstd
level 3 or lz4 (frame, default level); two ablations of zstd-1 always ("planes") or never
("flat") split; "delta" is tierswap.delta itself (zstd-1, plus the xxh3-64 of the snapshot on
both sides). Variants are interleaved within each repeat, in a rotating order. Decoding writes
into a buffer that already exists, as a tier-0 slot does. Throughput is the whole snapshot's
bytes over the time (GB/s = 1e9 bytes/s), one thread; ratio is delta bytes / snapshot bytes.

    .venv/bin/python bench/delta_codec.py [--repeats 5] [--chunk 1048576] [--cases a b c d]

The lz4 comparison needs ``pip install lz4`` (not a dependency of tierswap, which uses zstd).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lz4.frame
import numpy as np
import torch
import zstandard

from tierswap import delta
from tierswap.state import flatten, make_layout, tensor_view

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPTConfig, batch, build_model

GPT = GPTConfig(n_embd=256, n_head=4, n_layer=4)
ROWS, DIM, TOUCHED = 200_000, 64, 0.01


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    base: bytes
    new: bytes
    itemsize: int


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    compress: Callable[[memoryview], bytes]
    decompress: Callable[[bytes], bytes]
    planes: bool | None = None
    """Split into byte planes: always, never, or None as tierswap.delta does (when dense)."""


def _zstd(level: int) -> tuple[Callable[[memoryview], bytes], Callable[[bytes], bytes]]:
    return zstandard.ZstdCompressor(level=level).compress, zstandard.ZstdDecompressor().decompress


VARIANTS = (
    Variant("zstd-1", *_zstd(1)),
    Variant("zstd-3", *_zstd(3)),
    Variant("lz4", lz4.frame.compress, lz4.frame.decompress),
    Variant("zstd-1 planes", *_zstd(1), planes=True),
    Variant("zstd-1 flat", *_zstd(1), planes=False),
)
REAL = "delta"


# ---------------------------------------------------------------- the pipeline, per variant


Chunks = list[tuple[delta.Kind, bytes | None]]


def encode(v: Variant, base: bytes, new: bytes, chunk: int, itemsize: int) -> Chunks:
    """Each chunk's kind and payload, as tierswap.delta.encode makes them, less the checksum."""
    b, n = np.frombuffer(base, np.uint8), np.frombuffer(new, np.uint8)
    xor, planes = np.empty(min(chunk, len(n)), np.uint8), np.empty(min(chunk, len(n)), np.uint8)
    out: Chunks = []
    for start in range(0, len(n), chunk):
        nc = n[start : start + chunk]
        x, p = xor[: len(nc)], planes[: len(nc)]
        np.bitwise_xor(b[start : start + chunk], nc, out=x)
        dense = delta.use_planes(x)
        if dense is None:
            out.append((delta.Kind.SAME, None))
            continue
        split = dense if v.planes is None else v.planes
        if split:
            delta.split_planes(x, itemsize, p)
        packed = v.compress((p if split else x).data)
        kind = delta.Kind.PLANES if split else delta.Kind.XOR
        out.append((kind, packed) if len(packed) < len(nc) else (delta.Kind.RAW, nc.tobytes()))
    return out


def decode(
    v: Variant, base: bytes, chunks: Chunks, chunk: int, itemsize: int, out: bytearray
) -> None:
    b, o = np.frombuffer(base, np.uint8), np.frombuffer(out, np.uint8)
    for i, (kind, payload) in enumerate(chunks):
        s = slice(i * chunk, (i + 1) * chunk)
        if payload is None:
            o[s] = b[s]
        elif kind == delta.Kind.RAW:
            o[s] = np.frombuffer(payload, np.uint8)
        else:
            raw = np.frombuffer(v.decompress(payload), np.uint8)
            if kind == delta.Kind.PLANES:
                delta.join_planes(raw, itemsize, o[s])
            else:
                o[s] = raw
            np.bitwise_xor(o[s], b[s], out=o[s])


def _wire_size(chunks: Chunks) -> int:
    """Bytes of the same wire format as tierswap.delta: header, index, payloads, trailer."""
    stored = [p for _, p in chunks if p is not None]
    return 28 + len(chunks) + 4 * len(stored) + sum(map(len, stored)) + 8


def measure_once(name: str, case: Case, chunk: int, out: bytearray) -> tuple[float, float, int]:
    """Encode and decode seconds, and delta bytes, of one variant on one case. Decoding writes
    into ``out``, a buffer of the snapshot's size that already exists (as a tier-0 slot does)."""
    out[:] = bytes(len(out))
    if name == REAL:
        start = time.perf_counter()
        d = delta.encode(case.base, case.new, chunk=chunk, itemsize=case.itemsize)
        mid = time.perf_counter()
        delta.decode_into(case.base, d, memoryview(out))
        size = d.nbytes
    else:
        v = next(v for v in VARIANTS if v.name == name)
        start = time.perf_counter()
        chunks = encode(v, case.base, case.new, chunk, case.itemsize)
        mid = time.perf_counter()
        decode(v, case.base, chunks, chunk, case.itemsize, out)
        size = _wire_size(chunks)
    end = time.perf_counter()
    assert out == case.new, f"{name} did not round-trip {case.name}"
    return mid - start, end - mid, size


# ---------------------------------------------------------------- the training states


def snapshot(state: Mapping[str, Any]) -> bytes:
    """The bytes of ``state`` as tierswap lays them out in a tier-0 slot."""
    flat = flatten(state, with_rng=False)
    layout = make_layout(flat)
    buf = bytearray(layout.nbytes)
    for t, e in zip(flat.tensors, layout.entries, strict=True):
        tensor_view(memoryview(buf), e).copy_(t.detach())
    return bytes(buf)


def _before_after(
    state: Mapping[str, Any], step: Callable[[int], None], warmup: int = 5
) -> tuple[bytes, bytes]:
    for i in range(warmup):
        step(i)
    base = snapshot(state)
    step(warmup)
    return base, snapshot(state)


def _gpt_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable[[int], None]:
    def step(i: int) -> None:
        model(*batch(i, 0, 1, GPT)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def gpt_pretrain() -> Case:
    model = build_model(GPT)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    state = {"model": model, "optim": opt}
    return Case("a fp32 AdamW", *_before_after(state, _gpt_step(model, opt)), itemsize=4)


def gpt_bf16() -> Case:
    model = build_model(GPT).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    base, new = _before_after({"model": model}, _gpt_step(model, opt))
    return Case("b bf16 params", base, new, itemsize=2)


def gpt_finetune() -> Case:
    model = build_model(GPT)
    named = dict(model.named_parameters())
    trainable = [k for k in named if k.startswith(("blocks.3.attn.", "ln_f."))]
    for k, p in named.items():
        p.requires_grad_(k in trainable)
    opt = torch.optim.AdamW([named[k] for k in trainable], lr=1e-4, weight_decay=0.0)
    state = {"model": model, "optim": opt}
    share = len(trainable) / len(named)
    print(f"(c) trainable: {len(trainable)} of {len(named)} tensors ({share:.0%})")
    return Case("c finetune 10%", *_before_after(state, _gpt_step(model, opt)), itemsize=4)


def embedding(kind: str) -> Case:
    """A 200k x 64 table; each step's batch touches 1% of the rows, a different 1% each."""
    torch.manual_seed(0)
    table = torch.nn.Embedding(ROWS, DIM, sparse=kind == "SparseAdam")
    head = torch.randn(DIM)
    opt: torch.optim.Optimizer
    if kind == "SGD":
        opt = torch.optim.SGD(table.parameters(), lr=0.1)
    elif kind == "SparseAdam":
        opt = torch.optim.SparseAdam(list(table.parameters()), lr=1e-3)
    else:
        opt = torch.optim.AdamW(table.parameters(), lr=1e-3, weight_decay=0.01)

    def step(i: int) -> None:
        gen = torch.Generator().manual_seed(i)
        ids = torch.randperm(ROWS, generator=gen)[: int(ROWS * TOUCHED)]
        target = torch.randn(len(ids), generator=gen)
        ((table(ids) @ head - target) ** 2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    state = {"model": table} if kind == "SGD" else {"model": table, "optim": opt}
    return Case(f"d emb {kind}", *_before_after(state, step), itemsize=4)


CASES: dict[str, Callable[[], list[Case]]] = {
    "a": lambda: [gpt_pretrain()],
    "b": lambda: [gpt_bf16()],
    "c": lambda: [gpt_finetune()],
    "d": lambda: [embedding(k) for k in ("SGD", "SparseAdam", "AdamW")],
}


# ---------------------------------------------------------------- report


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):5.2f} [{min(values):.2f}-{max(values):.2f}]"


def run(cases: list[Case], repeats: int, chunk: int) -> None:
    names = [v.name for v in VARIANTS] + [REAL]
    results: dict[tuple[str, str], list[tuple[float, float, int]]] = {}
    outs = {case.name: bytearray(len(case.new)) for case in cases}
    for r in range(repeats):
        for case in cases:
            for k in range(len(names)):
                name = names[(k + r) % len(names)]
                runs = results.setdefault((case.name, name), [])
                runs.append(measure_once(name, case, chunk, outs[case.name]))
    head = f"{'case':<16} {'MB':>6} {'chunks%':>7} {'elems%':>7}  {'codec':<13} {'ratio':>6}"
    print(f"\n{head}  {'encode GB/s':>18}  {'decode GB/s':>18}")
    for case in cases:
        change = delta.changed_fraction(case.base, case.new, chunk=chunk, itemsize=case.itemsize)
        gb = len(case.new) / 1e9
        for i, name in enumerate(names):
            runs = results[(case.name, name)]
            enc = _spread([gb / e for e, _, _ in runs])
            dec = _spread([gb / d for _, d, _ in runs])
            ratio = runs[0][2] / len(case.new)
            left = (
                f"{case.name:<16} {len(case.new) / 1e6:6.1f} {change.chunks:7.1%} "
                f"{change.elements:7.2%}"
                if i == 0
                else " " * 39
            )
            print(f"{left}  {name:<13} {ratio:6.3f}  {enc:>18}  {dec:>18}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=delta.DEFAULT_CHUNK)
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=sorted(CASES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases = [c for key in args.cases for c in CASES[key]()]
    print(f"chunk {args.chunk} bytes, {args.repeats} repeats, medians [min-max], 1 thread")
    run(cases, args.repeats, args.chunk)


if __name__ == "__main__":
    main()
