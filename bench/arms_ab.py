"""Any two (or more) codes or package sets in ``bench overhead``'s jobs, A/B: each arm is
folders put first on ``PYTHONPATH`` (a checkout's ``src``, or a ``pip install --target``
folder holding one other version of a package), empty for this tree as installed. Every
round runs each arm's ``overhead.run`` in a process of its own, the arms' order rotated
round by round; the figures kept per round are each mode's median step, stall, overhead
against its plain job, copy and agents' CPU per GiB, and the ratios against the bare
controls.

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
    "import json, sys, xxhash; from tierswap.bench import overhead; "
    "import tierswap; print(tierswap.__file__, 'xxhash', xxhash.VERSION, file=sys.stderr); "
    "res = overhead.run({size}, 1, modes={modes!r}, pinned={pinned!r}); "
    "res['xxhash'] = xxhash.VERSION; open({out!r}, 'w').write(json.dumps(res))"
)
FIELDS = ("step_s", "stall_s", "gate_s", "overhead", "copy_cpu_s_per_gib", "copy_vs_bare",
          "agents_cpu_s_per_gib", "agents_vs_bare_stream", "step_vs_stream")  # fmt: skip


def _median(v: Any) -> Any:
    return v["median"] if isinstance(v, dict) and "median" in v else v


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
        if missing := [p for p in path.split(os.pathsep) if p and not os.path.isdir(p)]:
            ap.error(f"--arm {spec!r}: {missing} not a folder")
        arms[name] = path
    modes = tuple(args.modes.split(","))
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    names = list(arms)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            if arms[name]:
                env["PYTHONPATH"] = arms[name]
            with tempfile.TemporaryDirectory() as tmp:
                path = str(Path(tmp) / "res.json")
                code = RUN.format(size=args.size_mib, modes=modes, out=path,
                                  pinned=not args.unpinned_only)  # fmt: skip
                out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                     text=True, check=False)  # fmt: skip
                if out.returncode != 0:
                    print(name, r, "failed:", out.stderr[-3000:], file=sys.stderr, flush=True)
                    continue
                res = json.loads(Path(path).read_text())
            keep: dict[str, Any] = {"xxhash": res["xxhash"]}
            for m, v in res.items():
                if isinstance(v, dict) and "step_s" in v:
                    keep[m] = {k: _median(v.get(k)) for k in FIELDS if v.get(k) is not None}
            runs[name].append(keep)
            brief = {m: round(v["overhead"], 3) for m, v in keep.items() if isinstance(v, dict)}
            print(name, r, brief, file=sys.stderr, flush=True)
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for name, rs in runs.items():
        for m in sorted({m for r in rs for m, v in r.items() if isinstance(v, dict)}):
            for k in FIELDS:
                vals = [r[m][k] for r in rs if m in r and r[m].get(k) is not None]
                if vals:
                    summary.setdefault(name, {}).setdefault(m, {})[k] = statistics.median(vals)
    with open(args.out, "w") as f:
        json.dump({"size_mib": args.size_mib, "modes": modes, "arms": arms, "runs": runs,
                   "medians": summary}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
