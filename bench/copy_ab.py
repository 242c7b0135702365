"""The snapshot copy before 12-05 (torch's ``copy_`` in 1 MiB chunks, each hashed from the
slot) against since (libc's memmove in 1 MiB chunks, each hashed from the source while it
is in cache, with glibc's non-temporal threshold at 1 MiB in the workers), and since
without that threshold (``GLIBC_TUNABLES`` set by hand to glibc's largest threshold, so
that no chunk is written around the cache): ``bench overhead``'s jobs, plain and tier 0
(and tiers 0+1), unpinned and pinned, each arm's runs back to back, the arms' order
rotated every round. The old code runs from a checkout of it (``--old``, put first on
``PYTHONPATH`` for the bench and its jobs alike).

    git worktree add /tmp/old-476d667 476d667
    .venv/bin/python bench/copy_ab.py --old /tmp/old-476d667 --rounds 2 > bench/copy-ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

RUN = (
    "import json, sys; from tierswap.bench import overhead; "
    "import tierswap; print(tierswap.__file__, file=sys.stderr); "
    "res = overhead.run({size}, 1, modes={modes!r}, pinned=True); "
    "open({out!r}, 'w').write(json.dumps(res))"
)
NO_NT = "glibc.cpu.x86_non_temporal_threshold=0xffffffffffff"
FIELDS = ("step_s", "stall_s", "overhead", "stall_of_step", "copy_cpu_s_per_gib",
          "copy_vs_memcpy", "agents_cpu_s_per_gib", "gate_of_step", "agent_core_s")  # fmt: skip


def arm_env(name: str, old: Path) -> dict[str, str]:
    """``since`` and ``since-no-nt`` run this checkout; any other arm the one at ``--old``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GLIBC_TUNABLES")}
    if name == "since-no-nt":
        env["GLIBC_TUNABLES"] = NO_NT
    elif name != "since":
        env["PYTHONPATH"] = str(old / "src")
    return env


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--size-mib", type=int, default=384)
    ap.add_argument("--modes", default="plain,tier0,tier01")
    ap.add_argument("--arms", default="before-12-05,since,since-no-nt",
                    help="arms in the order of the first round (any but since and "
                    "since-no-nt runs --old)")  # fmt: skip
    args = ap.parse_args()
    modes = tuple(args.modes.split(","))
    arms = args.arms.split(",")
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    for r in range(args.rounds):
        order = arms[r % len(arms) :] + arms[: r % len(arms)]
        for name in order:
            with tempfile.TemporaryDirectory() as tmp:
                path = str(Path(tmp) / "res.json")
                code = RUN.format(size=args.size_mib, modes=modes, out=path)
                out = subprocess.run([sys.executable, "-c", code], env=arm_env(name, args.old),
                                     capture_output=True, text=True, check=False)  # fmt: skip
                if out.returncode != 0:
                    print(name, r, "failed:", out.stderr[-3000:], file=sys.stderr, flush=True)
                    continue
                res = json.loads(Path(path).read_text())
            keep = {m: {k: res[m].get(k) for k in FIELDS} for m in res if isinstance(res[m], dict)
                    and "step_s" in res[m]}  # fmt: skip
            keep["memcpy_cpu_s_per_gib"] = res.get("memcpy_cpu_s_per_gib")
            runs[name].append(keep)
            brief = {m: (round(v["overhead"]["median"], 3),
                         round(v["copy_cpu_s_per_gib"]["median"], 3))
                     for m, v in keep.items() if isinstance(v, dict)}  # fmt: skip
            print(name, r, brief, file=sys.stderr, flush=True)
    json.dump({"size_mib": args.size_mib, "modes": modes, "runs": runs}, sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
