"""``tierswap bench delta``: what the delta codec (:mod:`tierswap.delta`) costs and saves on
training updates, and whether sending deltas would speed up replication on this machine.

Builds the snapshot buffer of a few training states (tierswap.state's real layout) before and
after one optimizer step, then encodes the second against the first and decodes it back:

  (a) pretraining: GPT (tierswap.examples.gpt, n_embd 256), fp32 params + AdamW exp_avg/exp_avg_sq
  (b) the same GPT trained in pure bf16 with AdamW: its bf16 parameters only
  (c) fine-tuning the fp32 GPT with ~10% of its tensors trainable: params + AdamW state
  (d) a 200k x 64 fp32 embedding table, one step touching 1% of its rows:
      SGD (no state), SparseAdam (params + state), AdamW (params + state; its weight decay
      moves every row at every step, and its moments move every row that ever had a gradient)

Every variant runs tierswap.delta's chunked pipeline (chunks equal to the base's are
references; changed chunks are XORed, split into byte planes when at least a quarter of their
8-byte words changed, compressed, stored raw if that is not smaller) with zstd level 1, zstd
level 3 or lz4 (frame, default level); two ablations of zstd-1 always ("planes") or never
("flat") split; "tierswap.delta" is the codec itself (zstd-1, plus the xxh3-64 of the snapshot
on both sides). Variants are interleaved within each repeat, in a rotating order. Decoding writes
into a buffer that already exists, as a tier-0 slot does. Throughput is the whole snapshot's
bytes over the time (GB/s = 1e9 bytes/s), one thread; ratio is delta bytes / snapshot bytes.

In the same run, interleaved (one frame before each repeat, after one warm-up frame): a plain
loopback TCP stream to another process, as ``tierswap bench replication`` measures it
(:mod:`tierswap.bench.peerserver`'s sink), in frames of the largest snapshot's size. For each
case and codec, the effective replication throughput with deltas is
``min(encode, decode, network / ratio)`` (medians), in snapshot bytes per second: what one
thread on each side could carry if replication sent deltas instead of snapshots. Deltas pay
where that beats the network's own throughput.

lz4 is not a dependency of tierswap (the codec uses zstd): its rows are measured when the
``lz4`` package is installed, and left out, saying so, when it is not. The sizes are the ones
the codec was chosen with: at ``--repeats 5`` a run takes about a minute on 2 cores, most of it
the two 154 MB embedding states.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
import zstandard

from tierswap import delta
from tierswap.bench.common import Stats, stats
from tierswap.bench.peerserver import PeerServer
from tierswap.bench.replication import _stream_once
from tierswap.state import flatten, make_layout, tensor_view

GPT_SIZE = {"n_embd": 256, "n_head": 4, "n_layer": 4}
ROWS, DIM, TOUCHED = 200_000, 64, 0.01
EMBEDDING_OPTIMIZERS = ("SGD", "SparseAdam", "AdamW")
REAL = "tierswap.delta"
"""The row of tierswap.delta itself."""


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    base: bytes
    new: bytes
    itemsize: int
    note: str = ""


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    compress: Callable[[memoryview], bytes]
    decompress: Callable[[bytes], bytes]
    planes: bool | None = None
    """Split into byte planes: always, never, or None as tierswap.delta does (when dense)."""


def _zstd(level: int) -> tuple[Callable[[memoryview], bytes], Callable[[bytes], bytes]]:
    return zstandard.ZstdCompressor(level=level).compress, zstandard.ZstdDecompressor().decompress


def variants() -> tuple[list[Variant], bool]:
    """The variants compared with tierswap.delta, and whether lz4 is among them (only when
    the optional ``lz4`` package is installed)."""
    out = [Variant("zstd-1", *_zstd(1)), Variant("zstd-3", *_zstd(3))]
    try:
        lz4 = importlib.import_module("lz4.frame")
    except ImportError:
        have_lz4 = False  # reported in the output and the JSON ("lz4": false)
    else:
        out.append(Variant("lz4", lz4.compress, lz4.decompress))
        have_lz4 = True
    out += [Variant("zstd-1 planes", *_zstd(1), planes=True)]
    out += [Variant("zstd-1 flat", *_zstd(1), planes=False)]
    return out, have_lz4


# ---------------------------------------------------------------- the pipeline, per variant


Chunks = list[tuple[delta.Kind, bytes | None]]
Run = tuple[float, float, int]
"""Encode seconds, decode seconds, delta bytes."""


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


def measure_once(v: Variant | None, case: Case, chunk: int, out: bytearray) -> Run:
    """Encode and decode seconds, and delta bytes, of one variant (None: tierswap.delta) on one
    case. Decoding writes into ``out``, a buffer of the snapshot's size that already exists."""
    out[:] = bytes(len(out))
    if v is None:
        start = time.perf_counter()
        d = delta.encode(case.base, case.new, chunk=chunk, itemsize=case.itemsize)
        mid = time.perf_counter()
        delta.decode_into(case.base, d, memoryview(out))
        size = d.nbytes
    else:
        start = time.perf_counter()
        chunks = encode(v, case.base, case.new, chunk, case.itemsize)
        mid = time.perf_counter()
        decode(v, case.base, chunks, chunk, case.itemsize, out)
        size = _wire_size(chunks)
    end = time.perf_counter()
    if out != case.new:
        raise RuntimeError(f"{v.name if v else REAL} did not round-trip {case.name}")
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


def _examples() -> ModuleType:
    """The example GPT (``tierswap/examples/gpt.py``)."""
    return importlib.import_module("tierswap.examples.gpt")


def _gpt_model(gpt: ModuleType) -> torch.nn.Module:
    model: torch.nn.Module = gpt.build_model(gpt.GPTConfig(**GPT_SIZE))
    return model


def _gpt_step(
    gpt: ModuleType, model: torch.nn.Module, opt: torch.optim.Optimizer
) -> Callable[[int], None]:
    cfg = gpt.GPTConfig(**GPT_SIZE)

    def step(i: int) -> None:
        model(*gpt.batch(i, 0, 1, cfg)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def gpt_pretrain(gpt: ModuleType) -> Case:
    model = _gpt_model(gpt)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    state = {"model": model, "optim": opt}
    return Case("a fp32 AdamW", *_before_after(state, _gpt_step(gpt, model, opt)), itemsize=4)


def gpt_bf16(gpt: ModuleType) -> Case:
    model = _gpt_model(gpt).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    base, new = _before_after({"model": model}, _gpt_step(gpt, model, opt))
    return Case("b bf16 params", base, new, itemsize=2)


def gpt_finetune(gpt: ModuleType) -> Case:
    model = _gpt_model(gpt)
    named = dict(model.named_parameters())
    trainable = [k for k in named if k.startswith(("blocks.3.attn.", "ln_f."))]
    for k, p in named.items():
        p.requires_grad_(k in trainable)
    opt = torch.optim.AdamW([named[k] for k in trainable], lr=1e-4, weight_decay=0.0)
    state = {"model": model, "optim": opt}
    note = f"{len(trainable)} of {len(named)} tensors trainable ({len(trainable) / len(named):.0%})"
    base, new = _before_after(state, _gpt_step(gpt, model, opt))
    return Case("c finetune 10%", base, new, itemsize=4, note=note)


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


def build_cases() -> list[Case]:
    gpt = _examples()
    cases = [gpt_pretrain(gpt), gpt_bf16(gpt), gpt_finetune(gpt)]
    return cases + [embedding(k) for k in EMBEDDING_OPTIMIZERS]


# ---------------------------------------------------------------- the run


def _measure(
    cases: list[Case],
    codecs: list[Variant | None],
    repeats: int,
    chunk: int,
    stream: Callable[[], float],
) -> tuple[dict[tuple[str, int], list[Run]], list[float]]:
    """``repeats`` rounds of one network frame, then every codec on every case (codecs in a
    rotating order); the codecs' runs by (case, codec index) and the network's bytes/s."""
    results: dict[tuple[str, int], list[Run]] = {}
    outs = {case.name: bytearray(len(case.new)) for case in cases}
    network: list[float] = []
    stream()  # warm-up: the sink touches its buffer
    for r in range(repeats):
        network.append(stream())
        for case in cases:
            for k in range(len(codecs)):
                i = (k + r) % len(codecs)
                runs = results.setdefault((case.name, i), [])
                runs.append(measure_once(codecs[i], case, chunk, outs[case.name]))
    return results, network


def _summary(nbytes: int, runs: list[Run], network_bps: float) -> dict[str, Any]:
    """One codec on one case: ratio, throughputs, and what replication with deltas gets."""
    ratio = runs[0][2] / nbytes
    enc, dec = stats([nbytes / e for e, _, _ in runs]), stats([nbytes / d for _, d, _ in runs])
    effective = min(enc["median"], dec["median"], network_bps / ratio)
    return {"delta_bytes": runs[0][2], "ratio": ratio, "encode_bps": enc, "decode_bps": dec,
            "effective_bps": effective, "effective_over_network": effective / network_bps,
            "pays": effective > network_bps}  # fmt: skip


def _case(
    case: Case, chunk: int, codecs: dict[str, list[Run]], network_bps: float
) -> dict[str, Any]:
    change = delta.changed_fraction(case.base, case.new, chunk=chunk, itemsize=case.itemsize)
    n = len(case.new)
    summaries = {k: _summary(n, runs, network_bps) for k, runs in codecs.items()}
    return {"nbytes": n, "itemsize": case.itemsize, "note": case.note,
            "changed_chunks": change.chunks, "changed_elements": change.elements,
            "codecs": summaries}  # fmt: skip


def run(repeats: int, chunk: int = delta.DEFAULT_CHUNK) -> dict[str, Any]:
    """Build the cases, measure every codec on each and the loopback stream, interleaved; the
    server process and its segments are gone when it returns."""
    found, have_lz4 = variants()
    codecs: list[Variant | None] = [*found, None]
    names = [v.name if v else REAL for v in codecs]
    cases = build_cases()
    frame = memoryview(max(cases, key=lambda c: len(c.new)).new)
    with contextlib.ExitStack() as stack:
        server = PeerServer(f"bench-delta-{secrets.token_hex(4)}")
        stack.callback(server.close)
        sock = stack.enter_context(socket.create_connection(server.stream, timeout=300))

        def stream() -> float:
            return _stream_once(server, sock, frame)["bps"]

        results, net = _measure(cases, codecs, repeats, chunk, stream)
    network = stats(net)
    out = {c.name: _case(c, chunk, {n: results[(c.name, i)] for i, n in enumerate(names)},
                         network["median"]) for c in cases}  # fmt: skip
    machine = {"cpu_count": os.cpu_count(), "torch": torch.__version__,
               "python": platform.python_version(), "platform": platform.platform()}  # fmt: skip
    config = {"repeats": repeats, "chunk": chunk, "threads": 1, "lz4": have_lz4, "codecs": names}
    return {"machine": machine, "config": config,
            "network": {"frame_bytes": len(frame), "bps": network}, "cases": out}  # fmt: skip


# ---------------------------------------------------------------- the report


def _gbps(s: Stats) -> str:
    return f"{s['median'] / 1e9:.2f} ({s['min'] / 1e9:.2f}–{s['max'] / 1e9:.2f})"


def _rows(res: Mapping[str, Any]) -> list[tuple[list[str], bool]]:
    """The table's rows, and whether each ends a case's section."""
    rows: list[tuple[list[str], bool]] = []
    for name, c in res["cases"].items():
        for i, (codec, s) in enumerate(c["codecs"].items()):
            left = [name, f"{c['nbytes'] / 1e6:.1f}", f"{c['changed_chunks']:.1%}",
                    f"{c['changed_elements']:.2%}"] if i == 0 else ["", "", "", ""]  # fmt: skip
            right = [codec, f"{s['ratio']:.3f}", _gbps(s["encode_bps"]), _gbps(s["decode_bps"]),
                     f"{s['effective_bps'] / 1e9:.2f}", f"{s['effective_over_network']:.2f}x",
                     "yes" if s["pays"] else "no"]  # fmt: skip
            rows.append((left + right, i == len(c["codecs"]) - 1))
    return rows


COLUMNS = ("case", "MB", "changed\nchunks", "changed\nelems", "codec", "delta/\nfull",
           "encode GB/s", "decode GB/s", "effective\nGB/s", "vs\nnetwork", "pays")  # fmt: skip


def _verdict(res: Mapping[str, Any]) -> str:
    """Which cases tierswap.delta itself speeds replication up for."""
    real = {name: c["codecs"][REAL] for name, c in res["cases"].items()}
    paying = [name for name, s in real.items() if s["pays"]]
    best = max(real, key=lambda name: real[name]["effective_over_network"])
    return (f"tierswap.delta beats the network in {len(paying)} of {len(real)} cases"
            f"{': ' + ', '.join(paying) if paying else ''} (best: {best}, "
            f"{real[best]['effective_over_network']:.2f}x the network).")  # fmt: skip


def report(res: Mapping[str, Any]) -> None:
    """Print one table of every codec on every case, the network, and what the columns mean."""
    from rich.console import Console
    from rich.table import Table

    m, c, net = res["machine"], res["config"], res["network"]
    title = (f"tierswap bench delta: chunk {c['chunk']} bytes, {c['repeats']} repeats, "
             f"medians (min–max), {c['threads']} thread, {m['cpu_count']} CPUs, "
             f"torch {m['torch']}")  # fmt: skip
    table = Table(title=title)
    for header in COLUMNS:
        table.add_column(header, justify="left" if header in ("case", "codec") else "right")
    for row, last in _rows(res):
        table.add_row(*row, end_section=last)
    notes = [
        f"Network: plain loopback TCP stream to another process, "
        f"{net['frame_bytes'] / 1e6:.1f} MB frames: {_gbps(net['bps'])} GB/s.",
        "Effective = min(encode, decode, network / ratio), medians, in snapshot bytes/s: "
        "replication sending deltas, one thread a side; it pays when above the network.",
        _verdict(res),
    ]
    notes += [f"{name}: {case['note']}." for name, case in res["cases"].items() if case["note"]]
    if not c["lz4"]:
        notes.append("lz4 rows left out: the optional lz4 package is not installed.")
    Console(width=160).print(table, "\n".join(notes))


def main(args: argparse.Namespace) -> int:
    """``tierswap bench delta [--repeats N] [--json PATH]``."""
    if args.repeats < 1:
        raise ValueError(f"--repeats {args.repeats}: use >= 1")
    if getattr(args, "size_mib", None) is not None:
        raise ValueError("--size-mib does not apply to bench delta: its training states are fixed")
    torch.set_num_threads(1)
    res = run(args.repeats)
    report(res)
    from tierswap.bench import deltajobs

    res["jobs"] = deltajobs.run(args.repeats)
    deltajobs.report(res["jobs"])
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0
