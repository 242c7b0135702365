"""``tierswap bench memory``: host memory a node holds per byte of its ranks' state, for
each way of keeping the memory tiers.

One real job per mode (3 nodes, one rank each, the example GPT). Two readings per node:

- what the agents allocated, from the job's ``memory`` events: tier 0's ring of each of
  its ranks (``--slots`` snapshots), and tier 1's replicas of the ranks it protects (a ring
  of ``--peer-slots`` full snapshots each, or in delta mode the peak of bases and deltas);
- what ``/dev/shm`` held for the job at its peak, polled while it runs (tier 0 and full
  replicas live there; delta replicas are the agent's private memory, so only the first
  reading sees them).

Each is divided by the state of the node's own ranks (one snapshot of each).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from tierswap.bench.common import ring_slots, run_bounded
from tierswap.config import AUTO_PARITY, Config
from tierswap.examples import job_command
from tierswap.shm import PREFIX, SHM_DIR

_DEFAULT = Config(nodes=3)  # (its modes run 3 nodes)
PARITY_3X = "--peer-parity 3 --slots 2 --peer-slots 2"
"""The mode that held 3x before it was the default (12-05); read in older results."""
OLD = "--slots 3 --peer-slots 3 --peer-parity 0"
MODES: dict[str, list[str]] = {
    f"default: --slots {_DEFAULT.tier0_slots}, --peer-slots {_DEFAULT.peer_slots}, tier 1 as "
    f"parity over groups of {AUTO_PARITY} (3 nodes)": [],
    "--peer-parity 0 (full copies)": ["--peer-parity", "0"],
    f"{OLD} (the defaults before 12-05)": OLD.split(),
    "--slots 4 --peer-slots 4 --peer-parity 0 (the defaults before 12-03)": [
        "--slots", "4", "--peer-slots", "4", "--peer-parity", "0"
    ],
    "--replicas 2 (full copies)": ["--replicas", "2"],
    "--memory-tiers delta": ["--memory-tiers", "delta"],
    "--peer-parity 3 --slots 3 --peer-slots 3": ["--peer-parity", "3", "--slots", "3",
                                                 "--peer-slots", "3"],
}  # fmt: skip


def node_memory(evs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per node: bytes of tier 0 and tier 1, and each as a multiple of the node's own
    state, from the ``memory`` events (the largest report of each; a rank's state is its
    tier-0 ring's bytes over the ring's slots, both in the event)."""
    largest: dict[tuple[int, int, int], dict[str, Any]] = {}
    node_peak: dict[int, int] = defaultdict(int)
    for e in evs:
        if e["event"] != "memory" or e.get("node") is None:
            continue
        if e.get("scope") == "node":
            node_peak[e["node"]] = max(node_peak[e["node"]], e["bytes"])
            continue
        key = (e["node"], e["tier"], e["rank"])
        if key not in largest or e["bytes"] > largest[key]["bytes"]:
            largest[key] = e
    out: dict[str, Any] = {}
    for n in sorted({n for n, _, _ in largest}):
        rings = [e for (m, t, _), e in largest.items() if m == n and t == 0]
        tier0 = sum(e["bytes"] for e in rings)
        tier1 = sum(e["bytes"] for (m, t, _), e in largest.items() if m == n and t == 1)
        tier1 = max(tier1, node_peak.get(n, 0))
        state = sum(e["bytes"] / ring_slots(e) for e in rings)
        out[str(n)] = {
            "state": state, "tier0": tier0, "tier1": tier1,
            "tier0_x": tier0 / state, "tier1_x": tier1 / state,
            "total_x": (tier0 + tier1) / state,
        }  # fmt: skip
    return out


def _job_id(run_dir: Path) -> str | None:
    events = run_dir / "events.jsonl"
    if events.exists():
        for line in events.read_text().splitlines():
            if '"job_started"' in line:
                return str(json.loads(line)["job_id"])
    return None


def _shm_peak(run_dir: Path, stop: threading.Event, peak: list[int]) -> None:
    """Poll the job's segments in /dev/shm (its id from its first event) until ``stop``."""
    job_id = None
    while not stop.is_set():
        job_id = job_id or _job_id(run_dir)
        if job_id is not None:
            total = 0
            for p in SHM_DIR.glob(f"{PREFIX}{job_id}-*"):
                try:
                    total += p.stat().st_blocks * 512  # what is held, not what may be
                except FileNotFoundError:
                    pass
            peak[0] = max(peak[0], total)
        time.sleep(0.05)


def measure_mode(tmp: Path, name: str, extra: list[str], nodes: int, steps: int) -> dict[str, Any]:
    run_dir = tmp / name
    cmd = job_command(run_dir, ["--nodes", str(nodes), *extra],
                      ["--steps", str(steps), "--sleep", "0.05"])  # fmt: skip
    peak, stop = [0], threading.Event()
    poll = threading.Thread(target=_shm_peak, args=(run_dir, stop, peak), daemon=True)
    poll.start()
    try:
        code = run_bounded(cmd, tmp / f"{name}.log", tmp, 300, run_dir)
    finally:
        stop.set()
        poll.join()
    if code != 0:
        tail = (tmp / f"{name}.log").read_text()[-1500:]
        raise RuntimeError(f"{name}: exit code {code}: {tail}")
    evs = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    per_node = node_memory(evs)
    state = sum(n["state"] for n in per_node.values())
    return {"args": extra, "nodes": per_node, "shm_peak": peak[0],
            "shm_x": peak[0] / state if state else None}  # fmt: skip


def run(
    nodes: int = 3, steps: int = 10, modes: dict[str, list[str]] | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tierswap-mem-") as tmp_s:
        for i, (label, extra) in enumerate((modes or MODES).items()):
            out[label] = measure_mode(Path(tmp_s), f"mode{i}", extra, nodes, steps)
    return out


def report(res: dict[str, Any]) -> str:
    lines = ["| mode | tier 0 | tier 1 | per node, allocated | /dev/shm at its peak |",
             "|---|---|---|---|---|"]  # fmt: skip
    for label, r in res.items():
        worst = max(r["nodes"].values(), key=lambda n: n["total_x"])
        shm = "-" if r["shm_x"] is None else f"{r['shm_x']:.1f}x the job's state"
        lines.append(f"| {label} | {worst['tier0_x']:.1f}x | {worst['tier1_x']:.1f}x | "
                     f"**{worst['total_x']:.2f}x** its ranks' state | {shm} |")  # fmt: skip
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    res = run()
    print(report(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0
