"""The command line: tierswap run | ls | verify | export | bench | demo."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import typing
from pathlib import Path
from typing import Any

from tierswap.config import Config, field_docs
from tierswap.errors import TierswapError
from tierswap.faults import FORMS, Injection


def _join(args: argparse.Namespace) -> int:
    """Join a running job as a spare node: this process becomes the node's agent."""
    import os

    secret = os.environ.get("TIERSWAP_SECRET")
    run_dir = args.run_dir or os.environ.get("TIERSWAP_RUN_DIR")
    if secret is None and run_dir:
        ticket = Path(run_dir) / "join.json"
        if ticket.is_file():
            secret = json.loads(ticket.read_text())["secret"]
    if secret is None:
        raise SystemExit(
            "tierswap run --join: the job's secret is needed: set TIERSWAP_SECRET, or give "
            "--run-dir of the job (its join.json holds it; readable by its owner only)"
        )
    if ":" not in args.join:
        raise SystemExit(f"tierswap run --join {args.join!r}: expected HOST:PORT")
    env = dict(os.environ, TIERSWAP_COORD=args.join, TIERSWAP_SECRET=secret)
    env.pop("TIERSWAP_HOST", None)
    env.pop("TIERSWAP_HOST_ADDRESS", None)  # a stale one from the environment is not ours
    if args.bind:
        from tierswap.cluster.address import check_advertised

        env["TIERSWAP_HOST_ADDRESS"] = check_advertised(args.bind, "tierswap run --join --bind")
    if run_dir:
        from tierswap.cluster.launch import check_socket_folder

        check_socket_folder(Path(run_dir), "tierswap run --join --run-dir")
        env["TIERSWAP_RUN_DIR"] = run_dir
    script = [args.script, *args.args] if args.script else []
    os.execve(sys.executable, [sys.executable, "-m", "tierswap.cluster.agent", *script], env)


def _run(args: argparse.Namespace) -> int:
    from tierswap.cluster.coordinator import Coordinator
    from tierswap.cluster.launch import check_shared, check_socket_folder, default_run_dir

    if args.join:
        return _join(args)
    if not args.script:
        raise SystemExit("tierswap run: a SCRIPT to run is needed (or --join HOST:PORT)")
    cfg = Config.from_env(**_config_args(args))
    import dataclasses

    from tierswap.cluster.address import check_advertised

    # the address checked is the one used (a name is resolved once, here)
    cfg = dataclasses.replace(cfg, bind=check_advertised(cfg.bind, "tierswap run --bind"))
    run_dir = Path(cfg.run_dir) if cfg.run_dir else default_run_dir()
    check_socket_folder(run_dir, "tierswap run --run-dir")
    if cfg.persist is not None:
        check_shared(cfg.persist)
    # SIGTERM unwinds like an exception, so the coordinator stops its agents on the way out;
    # SIGINT is Ctrl-C even where the launcher was started with it ignored (a background
    # job of a script inherits SIG_IGN, and Python then never raises KeyboardInterrupt)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    script = [args.script, *args.args]
    if not Path(args.script).is_file():
        raise SystemExit(f"tierswap run: script {args.script!r} not found")
    return Coordinator(cfg, script, run_dir).run()


def _ls(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from tierswap.tiers import durable

    steps = durable.list_steps(args.url)
    if not steps:
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


def _verify(args: argparse.Namespace) -> int:
    from tierswap.tiers import durable

    problems = durable.verify(args.url, args.step)
    for p in problems:
        print(f"BAD {p}")
    if problems:
        return 1
    print(f"{args.url}: every checksum matches")
    return 0


def _export(args: argparse.Namespace) -> int:
    from tierswap.tiers.export import export

    summary = export(args.url, args.step, args.out)
    print(json.dumps(summary))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from tierswap import bench

    return int(bench.main(args))


def _demo(args: argparse.Namespace) -> int:
    from tierswap import demo

    return int(demo.main(args))


CLI_NAMES = {"nproc_per_node": "--nproc-per-node"}


def _config_options(run: argparse.ArgumentParser) -> None:
    """One option per ``Config`` field: its flag, type, choices and default from the field,
    its help from the field's sentence. An option is added to Config, not here."""
    docs = field_docs()
    hints = typing.get_type_hints(Config)
    group = run.add_argument_group("job options (each also settable as TIERSWAP_<NAME>)")
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        shown = "none" if default in (None, ()) else str(default)
        text = f"{docs[f.name]} (default: {shown})".replace("%", "%%")
        tp = hints[f.name]
        if f.name == "inject":
            text = f"{docs[f.name]} Repeatable; one of: " + ", ".join(FORMS)
            group.add_argument(flag, action="append", default=None, metavar="SPEC", help=text)
        elif tp is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        elif typing.get_origin(tp) is typing.Literal:
            group.add_argument(flag, choices=typing.get_args(tp), default=None, help=text)
        else:
            kind = next((t for t in (int, float) if tp is t), str)
            group.add_argument(flag, type=kind, default=None, metavar=f.name.upper(), help=text)


def _config_args(args: argparse.Namespace) -> dict[str, Any]:
    """The Config fields given on the command line (the others come from TIERSWAP_* or
    their defaults)."""
    out = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(Config)}
    if out["inject"] is not None:
        out["inject"] = tuple(Injection.parse(s) for s in out["inject"])
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tierswap", description=__doc__)
    p.add_argument("--version", action="version", version=f"tierswap {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run",
        help="run a training script as a job of simulated nodes",
        description="Run SCRIPT as a job: on one machine, --nodes simulated nodes of "
        "--nproc-per-node workers each; or, with --join, one more host for a running job.",
    )
    _config_options(run)
    run.add_argument(
        "--join",
        default=None,
        metavar="HOST:PORT",
        help="join the running job at this coordinator address as a spare node",
    )
    run.add_argument("script", nargs="?")
    run.add_argument("args", nargs=argparse.REMAINDER)
    run.set_defaults(func=_run)

    ls = sub.add_parser("ls", help="list the steps of a durable root")
    ls.add_argument("url")
    ls.set_defaults(func=_ls)

    verify = sub.add_parser("verify", help="check every checksum of a durable root")
    verify.add_argument("url")
    verify.add_argument("--step", type=int, default=None)
    verify.set_defaults(func=_verify)

    export = sub.add_parser("export", help="write one rank-merged safetensors file")
    export.add_argument("url")
    export.add_argument("--step", type=int, required=True)
    export.add_argument("out")
    export.set_defaults(func=_export)

    bench = sub.add_parser("bench", help="measure snapshot costs against alternatives")
    bench.add_argument(
        "what",
        choices=[
            "snapshot",
            "replication",
            "job-replication",
            "recovery",
            "delta",
            "control-plane",
            "soak",
        ],
    )
    bench.add_argument(
        "--size-mib",
        type=int,
        default=None,
        help="state size (default: 1024 for snapshot, 256 for replication)",
    )
    bench.add_argument("--repeats", type=int, default=5)
    bench.add_argument(
        "--nodes",
        type=int,
        nargs="+",
        default=None,
        help="control-plane: simulated node counts (default 256 2048 12500)",
    )
    bench.add_argument(
        "--ranks-per-node", type=int, default=8, help="control-plane: ranks per node (default 8)"
    )
    bench.add_argument(
        "--failures", type=int, default=100, help="soak: random failures in all (default 100)"
    )
    bench.add_argument("--json", default=None, help="also write the results here")
    bench.set_defaults(func=_bench)

    demo = sub.add_parser("demo", help="train a small GPT through a failure, prove the bits")
    demo.add_argument("--steps", type=int, default=40)
    demo.set_defaults(func=_demo)
    return p


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tierswap")
    except PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        code = int(args.func(args))
    except (TierswapError, ValueError) as e:
        print(f"tierswap {args.command}: {e}", file=sys.stderr)
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main()
