"""``tierswap demo``: a small GPT trains on 2 simulated nodes, a worker is killed mid-run,
the job recovers from memory, and the result is compared bit for bit with a run that had
no failure."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tierswap.examples import differing, job_command, load_final


def _run(console: Console, work: Path, name: str, steps: int, extra: list[str]) -> Path:
    run_dir = work / name
    cmd = job_command(
        run_dir,
        ["--nodes", "2", *extra],
        ["--steps", str(steps), "--out", str(work / f"{name}-final")],
    )
    # the command as run, whole and on one line: pasted into a shell, it runs again
    console.print(f"[bold]$ {escape(shlex.join(cmd))}[/bold]", soft_wrap=True)
    code = subprocess.call(cmd, cwd=work)
    if code != 0:
        raise SystemExit(f"tierswap demo: the {name} run failed with exit code {code}")
    return run_dir


def _events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def main(args: argparse.Namespace) -> int:
    console = Console()
    steps = int(args.steps)
    kill_at = steps * 2 // 3
    with tempfile.TemporaryDirectory(prefix="tierswap-demo-") as tmp:
        work = Path(tmp)
        console.rule("1. a run without failures")
        _run(console, work, "clean", steps, [])
        console.rule(f"2. the same run, rank 1 killed (SIGKILL) after step {kill_at}")
        run_dir = _run(
            console,
            work,
            "failure",
            steps,
            ["--spare-workers", "1", "--inject", f"kill:rank=1:step={kill_at}"],
        )
        console.rule("3. the proof")
        return _report(console, work, run_dir)


def _report(console: Console, work: Path, run_dir: Path) -> int:
    clean, failed = load_final(work / "clean-final"), load_final(work / "failure-final")
    diff = differing(clean, failed)
    failure = _events(run_dir, "failure_detected")[0]
    restored = _events(run_dir, "restored")[0]
    n = sum(len(v) for v in clean.values())
    nbytes = sum(t.numel() * t.element_size() for v in clean.values() for t in v.values())
    table = Table(show_header=False)
    table.add_row("failure", f"{failure['what']} rank(s) {failure['ranks']}: {failure['detail']}")
    tiers = sorted(set(restored["tiers"].values()))
    table.add_row(
        "restored",
        f"step {restored['step']} from tier(s) {tiers} in {restored['seconds'] * 1e3:.0f} ms",
    )
    resumed = _events(run_dir, "resumed")
    if resumed:
        r = resumed[0]
        table.add_row(
            "recovery",
            f"{r['seconds']:.2f} s from the kill to the next step; ranks {r['kept']} kept "
            f"their processes, ranks {r['replaced']} got new ones; {r['redone']} step(s) redone",
        )
    table.add_row("compared", f"{n} tensors, {nbytes:,} bytes: parameters, optimizer, RNG")
    table.add_row(
        "result",
        "[green]bit-for-bit identical[/green]"
        if not diff
        else f"[red]{len(diff)} tensors differ: {diff[:3]}[/red]",
    )
    console.print(table)
    return 0 if not diff else 1
