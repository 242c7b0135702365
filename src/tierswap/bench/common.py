"""What every measurement shares: rounds of the methods in turn, warm-up left out, the
stats of what they return, and the width of a state of a given size."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

WARMUP = 1  # rounds of each measurement run first and left out

Sample = dict[str, float]
Stats = dict[str, Any]


def stats(xs: Sequence[float]) -> Stats:
    """Median, quartiles (q1, q3), min, max and the samples themselves."""
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0],) * 3
    return {"median": statistics.median(xs), "q1": q1, "q3": q3, "min": min(xs),
            "max": max(xs), "samples": list(xs)}  # fmt: skip


def interleave(
    methods: Mapping[str, Callable[[], Sample]],
    repeats: int,
    between: Callable[[], None],
    *,
    alternate: bool = False,
) -> dict[str, dict[str, Stats]]:
    """``WARMUP + repeats`` rounds of the methods in turn (order reversed every other round
    with ``alternate``); the stats of every number they return, warm-up left out."""
    samples: dict[str, list[Sample]] = {name: [] for name in methods}
    for r in range(WARMUP + repeats):
        order = list(methods)[:: -1 if alternate and r % 2 else 1]
        for name in order:
            between()
            sample = methods[name]()
            if r >= WARMUP:
                samples[name].append(sample)
    return {n: {k: stats([s[k] for s in ss]) for k in ss[0]} for n, ss in samples.items()}


def width(size_mib: float, depth: int) -> int:
    """Width of ``depth`` square layers holding ``size_mib`` MiB with AdamW (12 B/param)."""
    return max(8, int(math.sqrt(size_mib * 2**20 / 12 / depth)))


def run_and_report(
    args: Any,
    default_mib: int,
    run: Callable[[int, int], dict[str, Any]],
    report: Callable[[dict[str, Any]], None],
) -> int:
    """Validate ``--size-mib``/``--repeats``, measure, print, and write ``--json``."""
    import json
    from pathlib import Path

    size = default_mib if args.size_mib is None else args.size_mib
    if size < 1 or args.repeats < 1:
        raise ValueError(f"--size-mib {size}, --repeats {args.repeats}: use >= 1 each")
    res = run(size, args.repeats)
    report(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0
