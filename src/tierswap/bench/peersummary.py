"""``tierswap bench peers``' summaries: each system's checkpoint costs and recovery seconds
over the rounds, its ratios to tierswap's round by round, and the tables that print them.

The summaries are pure functions of what the rounds collected (:mod:`tierswap.bench.peers`),
so that one can be checked on runs built by hand, failed rounds among them; the tables
print a run's result as ``bench peers --json`` writes it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from tierswap.bench import overhead
from tierswap.bench.common import Stats, stats

R = TypeVar("R")

BASE_CKPT, BASE_RECOVERY = "tier0", "tierswap-worker-spare"
"""The tierswap systems the peers' ratios are taken against."""


def exactness(flags: Sequence[bool]) -> str:
    """``k/n`` of the runs that ended bit for bit equal to the uninterrupted one."""
    return f"{sum(flags)}/{len(flags)}"


def ratios(ours: Sequence[float], theirs: Sequence[float]) -> Stats | None:
    """Stats of ``theirs / ours`` round by round; ours is taken as at least a microsecond
    (a stall that rounds to 0 is not left out, which would keep only our worst rounds)."""
    rs = [t / max(o, 1e-6) for o, t in zip(ours, theirs, strict=False)]
    return stats(rs) if rs else None


def _ran(
    runs: Mapping[str, list[R | None]], out: dict[str, Any]
) -> Iterator[tuple[str, list[R | None], list[R]]]:
    """Each system with its rounds and those that ran; one whose every round failed gets
    ``{"failed": n}`` in ``out`` instead."""
    for system, rs in runs.items():
        ok = [r for r in rs if r is not None]
        if ok:
            yield system, rs, ok
        else:
            out[system] = {"failed": len(rs)}


def summarize_checkpoint(runs: dict[str, list[dict[str, float] | None]]) -> dict[str, Any]:
    """Per system the stats of its step and stall, its overhead against the plain run of
    the same round, and its ratios to tierswap's ``BASE_CKPT`` round by round."""
    out: dict[str, Any] = {}
    plain = runs.get("plain", [])
    base = runs.get(BASE_CKPT, [])
    for system, rs, ok in _ran(runs, out):
        entry: dict[str, Any] = {k: stats([r[k] for r in ok]) for k in ("step_s", "stall_s")}
        pairs = [(r, p) for r, p in zip(rs, plain, strict=False) if r is not None and p is not None]
        if pairs and system != "plain":
            entry["overhead"] = stats([r["step_s"] / p["step_s"] - 1 for r, p in pairs])
        both = [(b, r) for b, r in zip(base, rs, strict=False) if b is not None and r is not None]
        if both and system not in ("plain", BASE_CKPT):  # memcpy too: the floor's stall
            entry[f"step_vs_{BASE_CKPT}"] = ratios(*_cols(both, "step_s"))
            entry[f"stall_vs_{BASE_CKPT}"] = ratios(*_cols(both, "stall_s"))
        entry["failed"] = len(rs) - len(ok)
        out[system] = entry
    return out


def _cols(
    pairs: Iterable[tuple[dict[str, Any], dict[str, Any]]], key: str
) -> tuple[list[float], list[float]]:
    a, b = zip(*((x[key], y[key]) for x, y in pairs), strict=True)
    return list(a), list(b)


def summarize_recovery(runs: dict[str, list[dict[str, Any] | None]]) -> dict[str, Any]:
    """Per system the stats of its recovery seconds, its bit-exactness per run, and the
    ratio of its seconds to tierswap's ``BASE_RECOVERY`` round by round."""
    out: dict[str, Any] = {}
    base = runs.get(BASE_RECOVERY, [])
    for system, rs, ok in _ran(runs, out):
        entry: dict[str, Any] = {
            "seconds": stats([r["seconds"] for r in ok]),
            "exact": [r["exact"] for r in ok],
            "differing": next((r["differing"] for r in ok if r["differing"]), []),
            "rng_differing": next((r["rng_differing"] for r in ok if r["rng_differing"]), []),
            "kill_from": sorted({r["kill_from"] for r in ok}),
            "failed": len(rs) - len(ok),
        }
        both = [(b, r) for b, r in zip(base, rs, strict=False) if b is not None and r is not None]
        if both and system != BASE_RECOVERY:
            entry[f"vs_{BASE_RECOVERY}"] = ratios(*_cols(both, "seconds"))
        out[system] = entry
    return out


def _fmt_s(s: Stats | None, scale: float = 1.0, unit: str = "") -> str:
    if s is None:
        return ""
    m, lo, hi = (_num(s[k] * scale) for k in ("median", "min", "max"))
    return f"{m}{unit} ({lo}–{hi})"


def _num(x: float) -> str:
    """Three significant digits, without an exponent below a million."""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def report(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    cfg = res["config"]
    console = Console(width=200)
    t = Table(
        title=f"a checkpoint every step, {cfg['size_mib']} MiB per rank, 2 ranks, "
        f"{cfg['repeats']} rounds: median (min–max)"
    )
    for col in (
        "system",
        "step",
        "overhead vs plain",
        "stall / checkpoint",
        f"step vs {BASE_CKPT}",
        f"stall vs {BASE_CKPT}",
        "failed",
    ):
        t.add_column(col)
    for system, e in res["checkpoint"].items():
        if "step_s" not in e:
            t.add_row(system, "failed", "", "", "", "", str(e["failed"]))
            continue
        o = e.get("overhead")
        t.add_row(
            system,
            _fmt_s(e["step_s"], 1e3, " ms"),
            "" if o is None else _fmt_s(o, 100, " %"),
            _fmt_s(e["stall_s"], 1e3, " ms"),
            _fmt_s(e.get(f"step_vs_{BASE_CKPT}"), 1, "x"),
            _fmt_s(e.get(f"stall_vs_{BASE_CKPT}"), 1, "x"),
            str(e["failed"]),
        )
    console.print(t)
    t = Table(
        title=f"recovery: rank {cfg['victim_rank']} killed after step {cfg['kill_step']}, "
        "to every rank's next step (s)"
    )
    for col in ("system", "recovery", "bit-exact", f"vs {BASE_RECOVERY}", "failed"):
        t.add_column(col)
    for system, e in res["recovery"].items():
        if "seconds" not in e:
            t.add_row(system, "failed", "", "", str(e["failed"]))
            continue
        exact = [x for x in e["exact"] if x is not None]
        t.add_row(
            system,
            _fmt_s(e["seconds"]),
            exactness(exact) if exact else "no reference",
            _fmt_s(e.get(f"vs_{BASE_RECOVERY}"), 1, "x"),
            str(e["failed"]),
        )
    console.print(t)
    if "overhead" in res:
        overhead.report(res["overhead"])
    for system, why in res["not_run"].items():
        console.print(f"not run: {system}: {why}")
    for f in res["failures"]:
        console.print(f"failed: {f[:400]}")
    console.print(f"took {cfg['seconds']:.0f} s")
