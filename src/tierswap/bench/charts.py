"""The plots of ``BENCHMARKS.md`` (PNG, beside the results' JSON): recovery against state
size with its floors, the peers' recovery and stall per checkpoint, and the goodput
projection. matplotlib is a bench extra, never a runtime dependency: without it there
are no plots and the report says so (:mod:`tierswap.bench.writeup`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tierswap.bench.peerjobs import CONTROLS


def plots(folder: Path, res: dict[str, Any]) -> dict[str, Path]:
    """Draw what the results allow; {name: path}. Empty without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    out: dict[str, Path] = {}
    curve = res.get("recovery", {}).get("sizes", {})
    if curve:
        fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=110)
        for kind in ("worker", "node"):
            pts = sorted(
                (float(m), e[kind]) for m, e in curve.items() if "seconds" in e.get(kind, {})
            )
            if not pts:
                continue
            xs = [m for m, _ in pts]
            ax.errorbar(xs, *_spread([s["seconds"] for _, s in pts]), marker="o", capsize=3,
                        label=f"{kind} killed")  # fmt: skip
            ax.plot(xs, [s["floors"]["restore"] for _, s in pts], ls=":",
                    label=f"{kind}: restore floor")  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("state per rank (MiB)")
        ax.set_ylabel("kill to next completed step (s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        out["recovery"] = _save(fig, plt, folder / "recovery.png")
    peers = res.get("peers", {})
    rec = {k: s for k, s in peers.get("recovery", {}).items() if "seconds" in s}
    if rec:
        fig, ax = plt.subplots(figsize=(7, 3.8), dpi=110)
        names = list(rec)
        mids, err = _spread([rec[n]["seconds"] for n in names])
        ax.barh(names, mids, xerr=err, capsize=3)
        ax.set_xlabel("kill to next completed step (s), median, min – max")
        ax.grid(True, axis="x", alpha=0.3)
        out["peers_recovery"] = _save(fig, plt, folder / "peers-recovery.png")
    ck = {k: s for k, s in peers.get("checkpoint", {}).items()
          if s.get("stall_s") and k not in CONTROLS}  # fmt: skip
    if ck:
        fig, ax = plt.subplots(figsize=(7, 3.4), dpi=110)
        names = list(ck)
        ax.barh(names, [1e3 * ck[n]["stall_s"]["median"] for n in names])
        ax.set_xscale("log")
        ax.set_xlabel("training blocked per checkpoint (ms, median, log scale)")
        ax.grid(True, axis="x", which="both", alpha=0.3)
        out["peers_stall"] = _save(fig, plt, folder / "peers-stall.png")
    if res.get("simulate"):
        from tierswap import goodput

        goodput.plot(res["simulate"], str(folder / "goodput.png"))
        out["simulate"] = folder / "goodput.png"
    return out


def _spread(ss: list[dict[str, Any]]) -> tuple[list[float], list[list[float]]]:
    """Medians, and their distances down to the min and up to the max (error bars)."""
    mids = [s["median"] for s in ss]
    lows = [m - s["min"] for m, s in zip(mids, ss, strict=True)]
    return mids, [lows, [s["max"] - m for m, s in zip(mids, ss, strict=True)]]


def _save(fig: Any, plt: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
