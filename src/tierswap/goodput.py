"""``tierswap simulate``: the goodput of a month of training at cluster scale, projected
from per-node costs and a failure model, for tierswap and the two ways users keep jobs
alive today.

Goodput is the share of all GPU-hours paid for that trained the model: time lost to
checkpoint stalls, step overhead, recoveries, work redone after a failure and GPUs held
as spares all count against it. Three strategies run over the *same* failure trace
(one seeded Monte Carlo trace per run, shared, so their differences are theirs):

- ``restart``: checkpoint-restart (``torchrun --max-restarts`` + DCP) every K minutes:
  each checkpoint blocks for ``ckpt_block_s``; a failure loses the work since the last
  checkpoint and restarts the job (``restart_s`` plus reading the state back), after a
  replacement node comes from the cluster when the failure was a node's.
- ``memory``: in-memory checkpoints every M steps without spares (DLRover's flash
  checkpoint): each blocks for the state's copy into host memory (``mem_gbps``); a process
  failure restarts in place from memory (the steps since the last copy lost); a node
  failure waits for a replacement, restarts the job and reads the newest checkpoint
  persisted every K minutes (the lost node's memory is gone).
- ``tierswap``: a snapshot every step (``ts_stall_s`` and ``ts_overhead``); a process
  failure is a worker restart in place, a node failure a hot-swap to a parked spare
  (``ts_swap_s``, at most one step redone); a failed node is repaired (``repair_h``) and
  parks as a spare again. With no spare free the job waits for a node from the cluster
  or the next repaired one. A failure during a recovery is taken by the same stop (the
  recovery lasts until the later of the two is done). The spares' GPUs are paid for and
  train nothing.

Each strategy's free parameters are optimised per configuration by a grid search: K for
the first (next to Young's formula ``sqrt(2 C M)``), M and K for the second, the spare
count for tierswap.

The failure model's default: Meta's Llama 3 report, 419 unexpected interruptions in 54
days on 16,384 GPUs (about 78 % attributed to hardware, the rest to software and
unknown causes), as a rate per GPU; ``--mtbf-hours`` sets a node's instead.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

LLAMA3_RATE = 419 / (54 * 24 * 16384)
"""Interruptions per GPU-hour in the Llama 3 report (419 in 54 days on 16,384 GPUs)."""
LLAMA3_HARDWARE = 0.78
"""The share of those attributed to hardware (GPUs, memory, network, hosts)."""
MONTH_H = 30 * 24.0


@dataclass(frozen=True)
class Model:
    """The cluster, its failures and what each strategy pays (seconds unless named)."""

    gpus: int = 16384
    gpus_per_node: int = 8
    mtbf_hours: float | None = None
    """A node's mean time between failures; None takes the Llama 3 rate per GPU."""
    hardware: float = LLAMA3_HARDWARE
    """Share of failures that take the node away (the rest restart processes in place)."""
    hours: float = MONTH_H
    step_s: float = 10.0
    state_gb: float = 20.0
    """Checkpointed state per GPU (GB): weights, optimizer moments."""
    read_gbps: float = 2.0
    """Per-GPU read bandwidth from durable storage when a job restarts from it."""
    ckpt_block_s: float = 30.0
    """Training blocked per durable checkpoint (``restart``; ``memory`` pays it in the
    background)."""
    restart_s: float = 600.0
    """A whole job's restart: scheduling, process starts, imports, rendezvous, warm-up."""
    replace_s: float = 900.0
    """Waiting for a replacement node from the cluster after a node failure."""
    mem_gbps: float = 5.0
    """``memory``: the blocking copy into host memory, GB/s per GPU (DLRover's save to
    memory took 80 ms for 384 MiB a rank here: 5 GB/s)."""
    mem_restart_s: float = 120.0
    """``memory``: processes restarted in place, state read back from memory."""
    ts_stall_s: float = 0.004
    """tierswap: the trainer's stall per step."""
    ts_overhead: float = 0.02
    """tierswap: step time added by the background copy, checksums and replication."""
    ts_swap_s: float = 5.0
    """tierswap: a node failure to the next completed step, with a spare parked."""
    ts_worker_s: float = 2.0
    """tierswap: a process failure to the next completed step (a worker restarted)."""
    repair_h: float = 24.0
    """Hours until a failed node is back as a spare (tierswap's pool)."""

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    @property
    def node_rate(self) -> float:
        """Failures per node-hour."""
        if self.mtbf_hours is not None:
            return 1.0 / self.mtbf_hours
        return LLAMA3_RATE * self.gpus_per_node


@dataclass(frozen=True)
class Failure:
    at_h: float
    node: int
    hardware: bool


def trace(model: Model, nodes: int, seed: int) -> list[Failure]:
    """Failures of ``nodes`` nodes over ``model.hours``: Poisson in time, uniform over
    nodes, each hardware with probability ``model.hardware``."""
    rng = random.Random(seed)
    rate = model.node_rate * nodes
    out: list[Failure] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= model.hours:
            return out
        out.append(Failure(t, rng.randrange(nodes), rng.random() < model.hardware))


@dataclass
class Outcome:
    """One strategy over one trace."""

    goodput: float
    useful_h: float
    failures: int
    lost_h: dict[str, float] = field(default_factory=dict)
    """Wall hours lost, by cause."""
    wall_h: float | None = None
    """With a fixed amount of work: when it was done."""


def _useful(
    model: Model, trained_h: float, paid_nodes: int, lost: dict[str, float], failures: int
) -> Outcome:
    return Outcome(
        goodput=trained_h * model.nodes / (model.hours * paid_nodes),
        useful_h=trained_h,
        failures=failures,
        lost_h=dict(lost),
    )


def _roll_back(
    model: Model,
    failures: Sequence[Failure],
    rate: float,
    back: Callable[[Failure, float], tuple[float, float]],
    steady: str,
) -> Outcome:
    """A job that goes back on each failure: ``back(failure, trained since the last one)``
    gives (what of that is kept, hours down); between failures it trains at ``rate``,
    the rest of the time lost as ``steady`` (checkpoint blocking, copy stalls). A failure
    during an outage is part of that outage."""
    trained, t = 0.0, 0.0
    lost = {steady: 0.0, "redone": 0.0, "restarts": 0.0}
    for f in failures:
        if f.at_h < t:
            continue
        run = f.at_h - t
        done = run * rate
        kept, down = back(f, done)
        trained += kept
        lost[steady] += run - done
        lost["redone"] += done - kept
        lost["restarts"] += min(down, model.hours - f.at_h)
        t = f.at_h + down
    if t < model.hours:
        trained += (model.hours - t) * rate
        lost[steady] += (model.hours - t) * (1 - rate)
    return _useful(model, trained, model.nodes, lost, len(failures))


def restart(model: Model, failures: Sequence[Failure], every_min: float) -> Outcome:
    """Checkpoint-restart every ``every_min`` minutes of training."""
    interval = every_min / 60.0
    block = model.ckpt_block_s / 3600.0
    load = model.state_gb / model.read_gbps / 3600.0

    def back(f: Failure, done: float) -> tuple[float, float]:  # to the last checkpoint
        replace = model.replace_s / 3600.0 if f.hardware else 0.0
        return math.floor(done / interval) * interval, model.restart_s / 3600.0 + load + replace

    return _roll_back(model, failures, interval / (interval + block), back, "checkpoints")


def memory(
    model: Model, failures: Sequence[Failure], every_min: float, mem_every: int = 1
) -> Outcome:
    """In-memory checkpoints every ``mem_every`` steps, persisted every ``every_min``
    minutes, no spares."""
    interval = every_min / 60.0
    copy_s = model.state_gb / model.mem_gbps
    rate = model.step_s * mem_every / (model.step_s * mem_every + copy_s)
    mem_h = model.step_s * mem_every / 3600.0  # training between two in-memory copies
    load = model.state_gb / model.read_gbps / 3600.0

    def back(f: Failure, done: float) -> tuple[float, float]:
        if f.hardware:  # the node's memory is gone: back to the newest persisted step
            down = (model.replace_s + model.restart_s) / 3600.0 + load
            return math.floor(done / interval) * interval, down
        return math.floor(done / mem_h) * mem_h, model.mem_restart_s / 3600.0

    return _roll_back(model, failures, rate, back, "stalls")


def tierswap(
    model: Model, failures: Sequence[Failure], spares: int, work_h: float | None = None
) -> Outcome:
    """Snapshots every step, hot-swap to ``spares`` parked nodes, repaired nodes back;
    with no spare free, a node from the cluster (``replace_s``) or the next repaired one,
    whichever comes first. With ``work_h``, the run ends once that much is trained and
    ``wall_h`` says when (the validation's question); else at ``model.hours``."""
    rate = model.step_s / (model.step_s * (1 + model.ts_overhead) + model.ts_stall_s)
    step_h = model.step_s / 3600.0
    free_at = [0.0] * spares  # when each spare is (back) in the pool
    trained, t = 0.0, 0.0
    lost = {"overhead": 0.0, "redone": 0.0, "recoveries": 0.0, "waiting": 0.0}
    horizon = math.inf if work_h is not None else model.hours
    for f in failures:
        if f.at_h >= horizon:
            break
        if f.node >= model.nodes:  # a spare failed: out of the pool until repaired
            k = f.node - model.nodes
            free_at[k] = max(free_at[k], f.at_h) + model.repair_h
            continue
        during = f.at_h < t  # the job is recovering: the same stop takes this one too
        start = f.at_h
        run = max(0.0, f.at_h - t)
        if work_h is not None and trained + run * rate >= work_h:
            break  # done before this failure
        trained += run * rate
        lost["overhead"] += run * (1 - rate)
        wait = 0.0
        if f.hardware:
            replaced = start + model.replace_s / 3600.0
            k = min(range(spares), key=lambda i: free_at[i]) if spares else -1
            ready = max(start, free_at[k]) if spares else math.inf
            if ready <= replaced:  # a parked spare, now or once one is repaired
                wait = ready - start
                free_at[k] = start + model.repair_h  # the failed node, parked again
            else:  # a node from the cluster comes first; the pool stays as it is
                wait = replaced - start
            down = model.ts_swap_s / 3600.0
        else:
            down = model.ts_worker_s / 3600.0
        end = start + wait + down
        if during:  # recovered together: until the later of the two is done, no step lost
            lost["recoveries"] += max(0.0, end - t)
            t = max(t, end)
            continue
        lost["waiting"] += wait
        lost["recoveries"] += down
        lost["redone"] += step_h  # at most one step (the one in flight)
        trained -= min(trained, step_h)
        t = end
    if work_h is not None:
        wall = t + max(0.0, work_h - trained) / rate
        lost["overhead"] += (wall - t) * (1 - rate)
        out = _useful(model, work_h, model.nodes + spares, lost, len(failures))
        out.wall_h = wall
    else:
        if t < model.hours:
            trained += (model.hours - t) * rate
            lost["overhead"] += (model.hours - t) * (1 - rate)
        out = _useful(model, trained, model.nodes + spares, lost, len(failures))
    return out


EVERY_MIN = (1, 2, 5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 240)
SPARES = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)
MEM_EVERY = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
"""Steps between two in-memory copies (``memory``)."""


def young_minutes(model: Model, block_s: float) -> float:
    """Young's optimal checkpoint interval, sqrt(2 C M), for the job's MTBF M."""
    mtbf_h = 1.0 / (model.node_rate * model.nodes)
    return math.sqrt(2 * block_s / 3600.0 * mtbf_h) * 60.0


def project(model: Model, seeds: int = 5) -> dict[str, Any]:
    """Each strategy at its best parameter, goodput averaged over ``seeds`` traces (each
    trace shared by all strategies)."""
    extra = max(SPARES)
    traces = [trace(model, model.nodes + extra, seed) for seed in range(seeds)]

    def mean(fn: Any, arg: float, nodes: int) -> tuple[float, Outcome]:
        outs = [fn(model, [f for f in tr if f.node < nodes], arg) for tr in traces]
        return sum(o.goodput for o in outs) / len(outs), outs[0]

    out: dict[str, Any] = {"model": asdict(model), "nodes": model.nodes, "seeds": seeds}
    out["failures_per_month"] = model.node_rate * model.nodes * MONTH_H
    out["failures"] = model.node_rate * model.nodes * model.hours
    # over model.hours (the table's column); each lost_h below is seed 0's breakdown
    best = max(EVERY_MIN, key=lambda k: mean(restart, k, model.nodes)[0])
    g, one = mean(restart, best, model.nodes)
    out["restart"] = {"goodput": g, "every_min": best, "lost_h": one.lost_h}
    pairs = [(k, m) for k in EVERY_MIN for m in MEM_EVERY]

    def in_memory(k: float, m: int) -> float:
        return mean(lambda mo, fs, a: memory(mo, fs, a, m), k, model.nodes)[0]

    k, m = max(pairs, key=lambda km: in_memory(*km))
    _, one = mean(lambda mo, fs, a: memory(mo, fs, a, m), k, model.nodes)
    out["memory"] = {"goodput": in_memory(k, m), "every_min": k, "mem_every": m,
                     "lost_h": one.lost_h}  # fmt: skip
    out["restart"]["young_min"] = young_minutes(model, model.ckpt_block_s)
    scored = {s: mean(tierswap, s, model.nodes + s)[0] for s in SPARES}
    best_s = max(scored, key=lambda s: scored[s])
    _, one = mean(tierswap, best_s, model.nodes + best_s)
    out["tierswap"] = {"goodput": scored[best_s], "spares": best_s, "lost_h": one.lost_h,
                       "by_spares": scored}  # fmt: skip
    return out


def sweep(model: Model, gpus: Sequence[int], seeds: int = 3) -> list[dict[str, Any]]:
    return [project(replace(model, gpus=g), seeds) for g in gpus]


def table(rows: Sequence[dict[str, Any]]) -> str:
    head = (
        f"{'GPUs':>7} {'failures':>8}  {'restart (K min)':>16}  {'memory (M, K min)':>20}  "
        f"{'tierswap (spares)':>18}"
    )
    lines = [head]
    for r in rows:
        rs, mem, ts = r["restart"], r["memory"], r["tierswap"]
        lines.append(
            f"{r['model']['gpus']:>7} {r['failures']:>8.0f}  "
            f"{rs['goodput']:>9.1%} ({rs['every_min']:>3})  "
            f"{mem['goodput']:>9.1%} ({mem['mem_every']:>3}, {mem['every_min']:>3})  "
            f"{ts['goodput']:>10.1%} ({ts['spares']:>4})"
        )
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], path: str) -> None:
    """Goodput against GPU count, one line per strategy at its best parameter (PNG;
    matplotlib comes with ``pip install 'tierswap[bench]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "tierswap simulate --plot needs matplotlib: pip install 'tierswap[bench]'"
        ) from None
    gpus = [r["model"]["gpus"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    names = {
        "tierswap": "tierswap (best spare count)",
        "memory": "in-memory checkpoint, no spares (best persist interval)",
        "restart": "checkpoint-restart (best interval)",
    }
    for key, label in names.items():
        ax.plot(gpus, [100 * r[key]["goodput"] for r in rows], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("goodput over a month (%)")
    ax.set_ylim(0, 100)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower left", fontsize=8)
    m = rows[0]["model"]
    rate = "Llama 3's rate" if m["mtbf_hours"] is None else f"node MTBF {m['mtbf_hours']:g} h"
    ax.set_title(f"step {m['step_s']:g} s, {m['state_gb']:g} GB/GPU, failures at {rate}",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    defaults = Model()
    for name, value in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        kind = int if isinstance(value, int) and not isinstance(value, bool) else float
        p.add_argument(flag, type=kind, default=value)
    p.add_argument("--sweep", type=int, nargs="*", default=None,
                   help="GPU counts to project (default: just --gpus)")  # fmt: skip
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the projection here")
    p.add_argument("--plot", default=None, help="also draw goodput against GPUs (a PNG)")


def main(args: argparse.Namespace) -> int:
    fields = {k: getattr(args, k) for k in asdict(Model())}
    model = Model(**fields)
    bad = [k for k, v in fields.items() if v is not None and v <= 0 and k != "hardware"]
    if args.seeds < 1:
        bad.append("seeds")
    if any(n <= 0 for n in args.sweep or []):
        bad.append("sweep")
    if bad or not 0 <= model.hardware <= 1:
        names = ", ".join("--" + k.replace("_", "-") for k in bad) or "--hardware"
        raise SystemExit(f"tierswap simulate: {names} must be positive (--hardware in [0, 1])")
    rows = sweep(model, args.sweep or [model.gpus], args.seeds)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        plot(rows, args.plot)
    return 0
