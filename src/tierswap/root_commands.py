"""The commands that read a durable root: ``tierswap ls``, ``verify`` and ``export``.

Each takes the root's URL (a path or an fsspec URL, as ``--persist`` does); a root that is
not there, or holds no such step, is a ``UsageError`` that names it and what it holds.
"""

from __future__ import annotations

import argparse
import json

from tierswap.errors import UsageError, listed


def list_root(args: argparse.Namespace) -> int:
    """``tierswap ls URL``: every step of a durable root, committed or not, with its parts."""
    from rich.console import Console
    from rich.table import Table

    from tierswap.tiers import catalog

    steps = catalog.list_steps(args.url)
    if not steps:
        check_root(args.url)
        print(f"{args.url}: no steps")
        return 0
    table = Table("step", "state", "world size", "parts", "bytes")
    table.columns[1].no_wrap = True  # a step's state is read (and grepped) whole
    for s in steps:
        state = "committed" if s.committed else "not committed"
        if s.bases:
            state += f", deltas of step {'/'.join(map(str, sorted(s.bases)))}"
        if s.missing_bases:
            state += f"; NOT restorable: base {'/'.join(map(str, s.missing_bases))} is gone"
        if s.problem:
            state = f"BAD: {s.problem}"
        ws = "" if s.world_size is None else str(s.world_size)
        table.add_row(str(s.step), state, ws, str(len(s.present_ranks)), f"{s.nbytes:,}")
    console = Console()
    if not console.is_terminal:  # piped: no terminal width to fit, keep rows whole
        console = Console(width=160)
    console.print(table)
    return 0


def check_root(url: str) -> None:
    """Refuse a durable root that is not there (a typo would read as an empty one)."""
    from tierswap.tiers.files import url_fs

    fs, base = url_fs(url)
    if not fs.exists(base):
        raise UsageError(f"{url} does not exist: give a durable root a job wrote (its --persist)")


def committed_step(url: str, step: int | None) -> int:
    """``step``, or the newest restorable step where None; a ``UsageError`` listing the
    root's steps where it holds no such step."""
    from tierswap.tiers import catalog

    if step is None:
        steps = catalog.restorable_steps(url)
        if not steps:
            check_root(url)
            raise UsageError(f"{url} holds no committed step to export (tierswap ls {url})")
        return steps[-1]
    steps = catalog.committed_steps(url)
    if step not in steps:
        check_root(url)
        newest = listed([str(s) for s in reversed(steps)]) if steps else "none"
        raise UsageError(
            f"--step {step}: {url} holds no committed step {step}; its committed steps, "
            f"newest first: {newest} (tierswap ls {url})"
        )
    return step


def verify_root(args: argparse.Namespace) -> int:
    """``tierswap verify URL [--step S]``: every checksum; 1 naming each bad part."""
    from tierswap.tiers import catalog

    problems = catalog.verify(args.url, args.step)
    for p in problems:
        print(f"BAD {p}")
    if problems:
        return 1
    steps = catalog.list_steps(args.url)
    checked = 1 if args.step is not None else sum(s.committed for s in steps)
    open_ = sum(not s.committed for s in steps) if args.step is None else 0
    left = f"; {open_} uncommitted left out (tierswap ls)" if open_ else ""
    print(f"{args.url}: every checksum matches ({checked} committed step(s) checked{left})")
    return 0


def export_step(args: argparse.Namespace) -> int:
    """``tierswap export URL [--step S] [--format merged|dcp|hf] OUT``."""
    from tierswap.tiers.export import check_new, export, export_hf, parse_size

    if args.format != "merged":  # a folder, never overwritten: refused before any reading
        check_new(args.out)
    step = committed_step(args.url, args.step)
    if args.format == "merged":
        summary = export(args.url, step, args.out)
    elif args.format == "hf":
        size = parse_size(args.max_shard_size)
        summary = export_hf(args.url, step, args.out, size, args.model)
    else:
        from tierswap.dcp import export_dcp

        summary = export_dcp(args.url, step, args.out)
    print(json.dumps(summary))
    return 0
