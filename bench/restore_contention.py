"""Where a worker kill's restore work goes at 384 MiB per rank: the lost rank's tier-0
restore (map and verify the slot, load it into a model built with ``init=False``, as
``train_mlp.py`` does; or, "reserved", read and hash the slot into memory made while the
worker was parked, which the state adopts) timed alone, and with a second rank restoring
its own slot at the same moment, as the survivor of a 2-node job on this 2-core machine
does; beside the byte-moving floor ``bench recovery`` uses (memcpy + xxh3 of the same
bytes, one core).

    .venv/bin/python bench/restore_contention.py --rounds 5 > bench/restore-contention-<date>.json

Each restore runs in a fresh process of its own (1 torch thread, the workers' THP
setting), so its model's memory is as new as a parked spare's; rounds interleave alone
and paired, order flipped every round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CHILD = "--child"


def _state(size_mib: float) -> dict[str, Any]:
    import torch

    from tierswap.examples.mlp import batch, build, hidden_for, optimizer

    model = build(hidden_for(size_mib))
    opt = optimizer(model)
    x, y = batch(0, 0, 32)
    torch.nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
    opt.step()
    return {"model": model, "optim": opt}


def _write_slot(name: str, size_mib: float) -> dict[str, Any]:
    """A tier-0 slot holding one step of the reference model, as the agent would."""
    from tierswap.checksum import checksum_chunks
    from tierswap.shm import Segment
    from tierswap.state import flatten, make_layout, tensor_view

    flat = flatten(_state(size_mib), with_rng=False)
    layout = make_layout(flat)
    seg = Segment.create(name, layout.nbytes)
    for e, t in zip(layout.entries, flat.tensors, strict=True):
        tensor_view(seg.buf, e).copy_(t)
    out = {
        "segment": name,
        "layout": layout.to_json(),
        "tree": flat.tree,
        "checksum": checksum_chunks(layout.chunks(seg.buf)),
    }
    seg.close()
    return out


def _child(spec_path: str, at: float, reserved: bool) -> None:
    """One restore, as a parked spare's: fetch (map + verify, or with ``reserved`` memory
    made while it waited, read + hash in one pass) and load, timed."""
    import torch

    torch.set_num_threads(1)
    from tierswap.control import protocol as p
    from tierswap.examples.mlp import build, hidden_for, optimizer
    from tierswap.fetch import fetch
    from tierswap.layout import Layout
    from tierswap.reserve import Reserve
    from tierswap.state import load

    spec = json.loads(Path(spec_path).read_text())
    layout = Layout.from_json(spec["layout"])
    source = p.FromSlot(segment=spec["segment"], layout=layout, tree=spec["tree"],
                        checksum=spec["checksum"])  # fmt: skip
    model = build(hidden_for(spec["size_mib"]), init=False)
    state = {"model": model, "optim": optimizer(model)}
    reserve = None
    if reserved:  # made while it is parked, before the restore is asked for
        reserve = Reserve()
        reserve.want(layout.nbytes)
        while reserve.held() < layout.nbytes and time.time() < at:
            time.sleep(0.01)
    time.sleep(max(0.0, at - time.time()))  # paired runs start together
    timeline: dict[str, float] = {}
    got = fetch(p.PlanReply(step=7, source=source), 0, b"", "", timeline, reserve)
    t = time.monotonic()
    assert got.layout is not None
    load(state, got.tree, got.views, got.layout, adopt=got.private)
    timeline["load"] = time.monotonic() - t
    got.release()
    print(json.dumps(timeline))


def _run(specs: list[Path], reserved: bool) -> list[dict[str, float]]:
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "1", "OMP_NUM_THREADS": "1"}
    at = time.time() + 6.0  # after both processes imported torch and built their models
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, CHILD, str(s), str(at), str(int(reserved))],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for s in specs
    ]
    outs = [proc.communicate(timeout=300)[0] for proc in procs]
    if any(proc.returncode for proc in procs):
        raise RuntimeError(f"a restore process failed: {[proc.returncode for proc in procs]}")
    return [json.loads(out.strip().splitlines()[-1]) for out in outs]


def _floor(nbytes: int, rounds: int) -> dict[str, float]:
    import torch

    from tierswap.checksum import checksum_bytes
    from tierswap.shm import populated

    torch.set_num_threads(1)
    a, b = populated(nbytes), populated(nbytes)
    ta, tb = torch.frombuffer(a, dtype=torch.uint8), torch.frombuffer(b, dtype=torch.uint8)
    copies, hashes = [], []
    for _ in range(rounds):
        t = time.monotonic()
        tb.copy_(ta)
        copies.append(time.monotonic() - t)
        t = time.monotonic()
        checksum_bytes(b)
        hashes.append(time.monotonic() - t)
    return {"memcpy": statistics.median(copies), "xxh3": statistics.median(hashes)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=float, default=384.0)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from tierswap.shm import SHM_DIR

    names = [f"tierswap-contention-{os.getpid()}-{i}" for i in range(2)]
    with tempfile.TemporaryDirectory() as tmp:
        specs = []
        try:
            for i, name in enumerate(names):
                spec = {**_write_slot(name, args.size_mib), "size_mib": args.size_mib}
                specs.append(Path(tmp) / f"slot{i}.json")
                specs[-1].write_text(json.dumps(spec))
            nbytes = int(json.loads(specs[0].read_text())["layout"]["nbytes"])
            modes = ("alone", "paired", "alone, reserved", "paired, reserved")
            runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
            for r in range(args.rounds):
                for mode in modes[:: -1 if r % 2 else 1]:
                    pair = mode.startswith("paired")
                    got = _run(specs if pair else specs[:1], reserved="reserved" in mode)
                    runs[mode].append(got[0])  # the lost rank's; the other is the survivor
                    print(f"round {r} {mode}: {got}", file=sys.stderr)
            floor = _floor(nbytes, args.rounds)
        finally:
            for name in names:
                (SHM_DIR / name).unlink(missing_ok=True)
    floor_s = floor["memcpy"] + floor["xxh3"]
    out: dict[str, Any] = {"what": (__doc__ or "").split("\n\n")[0], "bytes": nbytes,
                           "floor_s": floor, "rounds": args.rounds}  # fmt: skip
    for mode, rs in runs.items():
        work = [t["fetch"] + t["verify"] + t["load"] for t in rs]
        out[mode] = {
            "parts_median_s": {k: statistics.median(t[k] for t in rs) for k in rs[0]},
            "work_s": {"median": statistics.median(work), "min": min(work), "max": max(work)},
            "vs_floor": statistics.median(work) / floor_s,
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == CHILD:
        _child(sys.argv[2], float(sys.argv[3]), sys.argv[4] == "1")
    else:
        main()
