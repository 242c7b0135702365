"""Any two (or more) codes or package sets in ``bench overhead``'s jobs, A/B: each arm is
folders put first on ``PYTHONPATH`` (a checkout's ``src``, or a ``pip install --target``
folder holding one other version of a package), empty for this tree as installed. Every
round runs each arm's ``overhead.run`` in a process of its own, the arms' order rotated
round by round; the figures kept per round are each mode's median step, stall, overhead
against its plain job, copy and agents' CPU per GiB, and the ratios against the bare
controls. Each run also records where its ``tierswap`` came from and its ``xxhash``
version (the package this script was first written to compare); the JSON has the
command line, each round's order, each arm's commit where it is a checkout, and the
runs that failed. Exits 1 if any did.

    pip install --no-deps --target /tmp/xx402 xxhash==4.0.2
    pip install --no-deps --target /tmp/xx410 xxhash==4.1.0
    .venv/bin/python bench/arms_ab.py --arm xxhash-4.0.2=/tmp/xx402 \
        --arm xxhash-4.1.0=/tmp/xx410 --modes plain,memcpy,tier0,tier01 --rounds 3 \
        --out bench/xxhash-ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

RUN = (
    "import json, xxhash, tierswap; from tierswap.bench import overhead; "
    "res = overhead.run({size}, 1, modes={modes!r}, pinned={pinned!r}); "
    "res['xxhash'] = xxhash.VERSION; res['tierswap'] = tierswap.__file__; "
    "open({out!r}, 'w').write(json.dumps(res))"
)
FIELDS = ("step_s", "stall_s", "gate_s", "overhead", "copy_cpu_s_per_gib", "copy_vs_bare",
          "agents_cpu_s_per_gib", "agents_vs_bare_stream", "step_vs_stream")  # fmt: skip


def _median(v: Any) -> Any:
    return v["median"] if isinstance(v, dict) and "median" in v else v


def _commit(path: str) -> str | None:
    """The commit of the checkout a folder is in, if it is in one."""
    folder = path.split(os.pathsep)[0] if path else "."
    out = subprocess.run(["git", "-C", folder, "rev-parse", "HEAD"], capture_output=True,
                         text=True, check=False)  # fmt: skip
    return out.stdout.strip() or None if out.returncode == 0 else None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arm", action="append", required=True, metavar="NAME=PATH",
                    help="an arm: PATH first on PYTHONPATH (empty: this tree)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size-mib", type=int, default=384)
    ap.add_argument("--modes", default="plain,memcpy,tier0,tier01")
    ap.add_argument("--unpinned-only", action="store_true")
    ap.add_argument("--out", required=True, help="the JSON file to write")
    args = ap.parse_args()
    arms: dict[str, str] = {}
    for spec in args.arm:
        name, sep, path = spec.partition("=")
        if not sep or not name:
            ap.error(f"--arm {spec!r}: write NAME=PATH (PATH may be empty)")
        folders = [p for p in path.split(os.pathsep) if p]
        if missing := [p for p in folders if not os.path.isdir(p)]:
            ap.error(f"--arm {spec!r}: {missing} not a folder")
        # absolute: the jobs run in folders of their own, where a relative one means else
        arms[name] = os.pathsep.join(os.path.abspath(p) for p in folders)
    modes = tuple(args.modes.split(","))
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    names = list(arms)
    orders: list[list[str]] = []
    failed = 0
    for r in range(args.rounds):
        orders.append(names[r % len(names) :] + names[: r % len(names)])
        for name in orders[-1]:
            env = dict(os.environ)
            if arms[name]:  # first, before any PYTHONPATH this script was given
                env["PYTHONPATH"] = os.pathsep.join(
                    filter(None, (arms[name], env.get("PYTHONPATH")))
                )
            with tempfile.TemporaryDirectory() as tmp:
                path = str(Path(tmp) / "res.json")
                code = RUN.format(size=args.size_mib, modes=modes, out=path,
                                  pinned=not args.unpinned_only)  # fmt: skip
                out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                     text=True, check=False)  # fmt: skip
                if out.returncode != 0:
                    print(name, r, "failed:", out.stderr[-3000:], file=sys.stderr, flush=True)
                    runs[name].append({"round": r, "failed": out.stderr[-3000:]})
                    failed += 1
                    continue
                res = json.loads(Path(path).read_text())
            keep: dict[str, Any] = {"round": r, "xxhash": res["xxhash"],
                                    "tierswap": res["tierswap"]}  # fmt: skip
            for m, v in res.items():
                if isinstance(v, dict) and "step_s" in v:
                    keep[m] = {k: _median(v.get(k)) for k in FIELDS if v.get(k) is not None}
            runs[name].append(keep)
            brief = {m: round(v["overhead"], 3) for m, v in keep.items() if isinstance(v, dict)}
            print(name, r, brief, file=sys.stderr, flush=True)
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for name, rs in runs.items():
        rs = [r for r in rs if "failed" not in r]
        for m in sorted({m for r in rs for m, v in r.items() if isinstance(v, dict)}):
            for k in FIELDS:
                vals = [r[m][k] for r in rs if m in r and r[m].get(k) is not None]
                if vals:
                    summary.setdefault(name, {}).setdefault(m, {})[k] = statistics.median(vals)
    with open(args.out, "w") as f:
        json.dump({"argv": sys.argv, "size_mib": args.size_mib, "modes": modes,
                   "pinned_too": not args.unpinned_only, "arms": arms,
                   "commits": {a: _commit(p) for a, p in arms.items()}, "orders": orders,
                   "failed": failed, "runs": runs, "medians": summary}, f, indent=1)  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
