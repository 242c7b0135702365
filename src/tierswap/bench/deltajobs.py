"""``tierswap bench delta``, second part: real 2-node jobs with tier 1 as full replicas and as
base + deltas, against tier 0 alone, interleaved.

Workloads (``tierswap/examples/``):

- ``pretrain``: the example GPT (4 blocks, width 128) trained from scratch with AdamW;
- ``finetune``: the same GPT with 8 blocks of which only the last one and the final norm
  train (AdamW state for those only);
- ``embedding``: a 50k x 64 embedding table with SparseAdam, each step touching 1% of the
  rows, and a dense head with Adam (tierswap/examples/train_embedding.py).

For each, ``tierswap run --nodes 2`` with ``--replicas 0`` (tier 0 only), ``--memory-tiers
full`` and ``--memory-tiers delta`` (defaults: a base every 50 steps or after a delta of
more than half a snapshot), in a rotating order within each repeat. Read from each run's
event log:

- step time: the gaps between rank 0's consecutive ``report`` events after the first
  ``WARMUP_STEPS``, median per run; the overhead is each run's median over the tier-0 run's
  of the same repeat;
- peer memory per node: what a node holds for its peers at its peak (full: the slot rings it
  reserved, ``memory`` events of tier 1; delta: the bases and deltas held, ``scope: node``);
- bytes per snapshot: ``replica_traffic`` (delta mode), bytes sent over bytes of the full
  snapshots they stand for, bases included; and the agent's encode throughput;
- tier-1 commits per step: the steps that reached peer memory on every rank over the steps
  trained. Replication sends each rank's newest snapshot when its previous transfer ends,
  so a slower transfer (or encode) protects fewer steps, and a failure redoes more.

Every run trains the same steps, so the job's own work is the same in each mode.
"""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tierswap.bench.common import ring_slots, stats
from tierswap.examples import EXAMPLE, job_command

WARMUP_STEPS = 5
STEPS = 30
MODES = ("tier0", "full", "delta")
WORKLOADS: dict[str, tuple[str, list[str]]] = {
    "pretrain": ("train_gpt.py", ["--layers", "4"]),
    "finetune": ("train_gpt.py", ["--layers", "8", "--train-last", "1"]),
    "embedding": ("train_embedding.py", ["--rows", "50000", "--dim", "64"]),
}


def _events(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _step_s(evs: list[dict[str, Any]]) -> float:
    times = [e["time"] for e in evs if e["event"] == "report"]
    gaps = [b - a for a, b in itertools.pairwise(times)][WARMUP_STEPS:]
    return float(statistics.median(gaps))


def peer_memory(evs: list[dict[str, Any]]) -> int:
    """The most any node held for its peers (tier 1), in bytes."""
    reserved: dict[int, dict[int, int]] = {}
    peak: dict[int, int] = {}
    for e in evs:
        if e["event"] != "memory" or e["tier"] != 1:
            continue
        if e.get("scope") == "node":
            peak[e["node"]] = max(peak.get(e["node"], 0), e["bytes"])
        else:
            reserved.setdefault(e["node"], {})[e["rank"]] = e["bytes"]
    totals = [sum(r.values()) for r in reserved.values()] + list(peak.values())
    return max(totals, default=0)


def _run(work: Path, name: str, workload: str, mode: str) -> dict[str, Any]:
    script, args = WORKLOADS[workload]
    run_dir = work / name
    tiers = ["--replicas", "0"] if mode == "tier0" else ["--memory-tiers", mode]
    cmd = job_command(
        run_dir, ["--nodes", "2", *tiers], ["--steps", str(STEPS), *args], EXAMPLE.parent / script
    )
    done = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"benchmark job {name} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    evs = _events(run_dir)
    out: dict[str, Any] = {"step_s": _step_s(evs), "peer_bytes": peer_memory(evs)}
    commits = [e for e in evs if e["event"] == "snapshot_committed" and e["tier"] == 1]
    out["tier1_per_step"] = len(commits) / STEPS
    snap = [e for e in evs if e["event"] == "memory" and e["tier"] == 0]
    out["snapshot_bytes"] = snap[0]["bytes"] // ring_slots(snap[0]) if snap else 0
    traffic = [e for e in evs if e["event"] == "replica_traffic"]
    if traffic:
        t = traffic[-1]
        out.update(
            ratio=t["ratio"],
            deltas=t["deltas"],
            bases=t["bases"],
            encode_bps=t["bytes_full"] * t["deltas"] / (t["deltas"] + t["bases"]) / t["encode_s"]
            if t["encode_s"]
            else None,
        )
    return out


def run(repeats: int) -> dict[str, Any]:
    """Every workload in every mode, ``repeats`` times, modes rotating within a repeat."""
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="tierswap-bench-deltajobs-") as tmp:
        for i in range(repeats):
            for workload in WORKLOADS:
                order = MODES[i % 3 :] + MODES[: i % 3]
                for mode in order:
                    got = _run(Path(tmp), f"{workload}-{mode}-{i}", workload, mode)
                    runs.setdefault((workload, mode), []).append(got)
    return {w: _summary(runs, w, repeats) for w in WORKLOADS}


def _summary(
    runs: Mapping[tuple[str, str], list[dict[str, Any]]], workload: str, repeats: int
) -> dict[str, Any]:
    base = [r["step_s"] for r in runs[(workload, "tier0")]]
    out: dict[str, Any] = {"snapshot_bytes": runs[(workload, "full")][0]["snapshot_bytes"]}
    for mode in ("full", "delta"):
        rs = runs[(workload, mode)]
        out[mode] = {
            "step_s": stats([r["step_s"] for r in rs]),
            "overhead": stats([r["step_s"] / b - 1 for r, b in zip(rs, base, strict=True)]),
            "peer_bytes": max(r["peer_bytes"] for r in rs),
            "tier1_per_step": stats([r["tier1_per_step"] for r in rs]),
        }
    d = runs[(workload, "delta")]
    out["delta"].update(
        ratio=stats([r["ratio"] for r in d]),
        bases=[r["bases"] for r in d],
        deltas=[r["deltas"] for r in d],
    )
    encode = [r["encode_bps"] for r in d if r.get("encode_bps")]
    out["delta"].update(
        encode_bps=stats(encode) if encode else None,
    )
    out["tier0_step_s"] = stats(base)
    return out


def report(res: Mapping[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"2-node jobs, {STEPS} steps, medians (min–max) over repeats")
    for col in ("workload", "snapshot MB", "tier 1", "step ms", "vs tier 0", "peer MB/node",
                "bytes/full", "encode GB/s", "tier-1 commits/step"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("workload", "tier 1") else "right")
    for name, w in res.items():
        for mode in ("full", "delta"):
            m = w[mode]
            o = m["overhead"]
            ratio = m.get("ratio")
            enc = m.get("encode_bps")
            table.add_row(
                name if mode == "full" else "",
                f"{w['snapshot_bytes'] / 1e6:.1f}" if mode == "full" else "",
                mode,
                f"{m['step_s']['median'] * 1e3:.1f}",
                f"{o['median']:+.1%} ({o['min']:+.1%}–{o['max']:+.1%})",
                f"{m['peer_bytes'] / 1e6:.1f}",
                f"{ratio['median']:.3f}" if ratio else "1",
                f"{enc['median'] / 1e9:.2f}" if enc and enc.get("median") else "",
                f"{m['tier1_per_step']['median']:.2f}",
                end_section=mode == "delta",
            )
    Console(width=160).print(table)
