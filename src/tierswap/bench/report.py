"""The bench's report: the measurements and the ratios as two tables, against the targets,
and ``tierswap bench snapshot``'s entry point, which also writes them as JSON."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from tierswap.bench.common import Stats, run_and_report
from tierswap.bench.measure import run

TARGETS: dict[str, tuple[str, float]] = {
    "tierswap/torch_save": ("<=", 0.01),
    "snapshot/copy_": (">=", 0.8),
    "write_part/sequential": (">=", 0.8),
    "step_overhead/threads_1": ("<=", 0.02),
    "step_overhead/threads_all": ("<=", 0.02),
}

_ROWS = (  # section, measure, path to its stats, unit
    ("blocking", "tierswap: take + fence", "blocking/tierswap/blocking", "ms"),
    ("", "  in take", "blocking/tierswap/take", "ms"),
    ("", "  at the fence", "blocking/tierswap/fence", "ms"),
    ("", "  (copy, overlapping compute)", "blocking/tierswap/copy", "ms"),
    ("", "torch.save + fsync", "blocking/torch_save/blocking", "ms"),
    ("", "dcp.save", "blocking/dcp_save/blocking", "ms"),
    ("", "dcp.async_save, until it returns", "blocking/dcp_async_save/blocking", "ms"),
    ("", "  (until its future is done)", "blocking/dcp_async_save/total", "ms"),
    ("copy", "snapshot copy", "copy/snapshot/bps", "GiB/s"),
    ("", "plain copy_", "copy/copy_/bps", "GiB/s"),
    ("write", "durable.write_part", "write/write_part/bps", "GiB/s"),
    ("", "sequential write + fsync", "write/sequential/bps", "GiB/s"),
    ("step", "{n} thread(s), snapshot every step", "step/{k}/with_snapshot/step_s", "ms"),
    ("", "  stall per step (take + fence)", "step/{k}/with_snapshot/stall_s", "ms"),
    ("", "  (its copy, in the background)", "step/{k}/with_snapshot/copy_s", "ms"),
    ("", "{n} thread(s), no snapshot", "step/{k}/without/step_s", "ms"),
)


def _cells(stats: Stats, unit: str) -> tuple[str, str]:
    scale = 1e3 if unit == "ms" else 1 / (1 << 30)
    lo, mid, hi = (scale * stats[k] for k in ("min", "median", "max"))
    digits = 1 if unit == "ms" else 2
    return f"{mid:.{digits}f} {unit}", f"{lo:.{digits}f} – {hi:.{digits}f}"


def _rows(res: Mapping[str, Any]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for k in ("", "threads_1", "threads_all"):
        for section, measure, path, unit in _ROWS:
            if ("{k}" in path) != bool(k):
                continue
            node: Any = res
            for part in path.format(k=k).split("/"):
                node = node[part]
            n = res["step"][k]["threads"] if k else 0
            rows.append((section, measure.format(n=n), *_cells(node, unit)))
    return rows


def report(res: Mapping[str, Any]) -> None:
    """Print the measurements and the ratios as two tables."""
    from rich.console import Console
    from rich.table import Table

    m, c = res["machine"], res["config"]
    title = (f"tierswap bench snapshot: {res['copy']['nbytes'] / 2**20:.0f} MiB of state, "
             f"{c['repeats']} repeats (+{c['warmup']} warm-up), {m['cpu_count']} CPUs, "
             f"torch {m['torch']}")  # fmt: skip
    table = Table("section", "measure", "median", "min – max", title=title)
    for row in _rows(res):
        table.add_row(*row)
    ratios = Table("ratio", "median", "target", "met")
    for name, value in res["ratios"].items():
        op, goal = TARGETS.get(name, ("", 0.0))
        met = value <= goal if op == "<=" else value >= goal
        ratios.add_row(name, f"{100 * value:.2f} %", f"{op} {100 * goal:g} %" if op else "",
                       ("yes" if met else "NO") if op else "")  # fmt: skip
    Console().print(table, ratios)
    for key in ("threads_1", "threads_all"):
        step = res["step"][key]
        o = step["overhead"]
        print(f"step overhead, {step['threads']} thread(s): median {100 * o['median']:+.1f} %, "
              f"quartiles {100 * o['q1']:+.1f} – {100 * o['q3']:+.1f} % over "
              f"{len(o['samples'])} interleaved pairs")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    """``tierswap bench snapshot|replication|job-replication|recovery|delta [--size-mib M]
    [--repeats N] [--json PATH]``."""
    if args.what == "replication":
        from tierswap.bench import replication

        return replication.main(args)
    if args.what == "job-replication":
        from tierswap.bench import jobstep

        return jobstep.main(args)
    if args.what == "recovery":
        from tierswap.bench import recovery

        return recovery.main(args)
    if args.what == "delta":
        from tierswap.bench import delta

        return delta.main(args)
    if args.what == "soak":
        from tierswap.bench import soak

        return soak.main(args)
    if args.what == "hosts":
        from tierswap.bench import hosts

        return hosts.main(args)
    if args.what == "dcp":
        from tierswap.bench import convert

        return convert.main(args)
    if args.what == "memory":
        from tierswap.bench import hostmem

        return hostmem.main(args)
    if args.what == "overhead":
        from tierswap.bench import overhead

        return overhead.main(args)
    if args.what == "goodput":
        from tierswap.bench import projection

        return projection.main(args)
    if args.what == "gpu-check":
        from tierswap.bench import gpu

        return gpu.main(args)
    if args.what == "control-plane":
        from tierswap.bench import controlplane

        return controlplane.main(args)
    if args.what == "peers":
        from tierswap.bench import peers

        return peers.main(args)
    if args.what in ("all", "report"):
        from tierswap.bench import suite

        return suite.main(args)
    if args.what != "snapshot":
        raise ValueError(f"bench {args.what!r}: not a benchmark of this version")
    return run_and_report(args, 1024, run, report)
