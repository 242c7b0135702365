"""The command line: tierswap run | ls | verify | export | bench | demo."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from tierswap.config import Config
from tierswap.errors import TierswapError
from tierswap.faults import Injection


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
        env["TIERSWAP_RUN_DIR"] = run_dir
    script = [args.script, *args.args] if args.script else []
    os.execve(sys.executable, [sys.executable, "-m", "tierswap.cluster.agent", *script], env)


def _run(args: argparse.Namespace) -> int:
    from tierswap.cluster.coordinator import Coordinator
    from tierswap.cluster.launch import default_run_dir

    if args.join:
        return _join(args)
    if not args.script:
        raise SystemExit("tierswap run: a SCRIPT to run is needed (or --join HOST:PORT)")
    cfg = Config.from_env(
        nodes=args.nodes,
        nproc_per_node=args.nproc_per_node,
        persist=args.persist,
        persist_every=args.persist_every,
        keep=args.keep,
        run_dir=args.run_dir,
        inject=tuple(Injection.parse(s) for s in args.inject) or None,
        max_restarts=args.max_restarts,
        threads=args.threads,
        replicas=args.replicas,
        max_peer_memory=args.max_peer_memory,
        max_redo=args.max_redo,
        bind=args.bind,
        spares=args.spares,
        spare_workers=args.spare_workers,
        on_no_spare=args.on_no_spare,
        heartbeat=args.heartbeat,
        lease=args.lease,
        collective_timeout=args.collective_timeout,
        backend=args.backend,
        memory_tiers=args.memory_tiers,
        base_every=args.base_every,
        delta_threshold=args.delta_threshold,
        persist_deltas=args.persist_deltas or None,
    )
    import dataclasses

    from tierswap.cluster.address import check_advertised

    # the address checked is the one used (a name is resolved once, here)
    cfg = dataclasses.replace(cfg, bind=check_advertised(cfg.bind, "tierswap run --bind"))
    run_dir = Path(cfg.run_dir) if cfg.run_dir else default_run_dir()
    # SIGTERM unwinds like an exception, so the coordinator stops its agents on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
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
    from tierswap.tiers import durable

    summary = durable.export(args.url, args.step, args.out)
    print(json.dumps(summary))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from tierswap import bench

    return int(bench.main(args))


def _demo(args: argparse.Namespace) -> int:
    from tierswap import demo

    return int(demo.main(args))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tierswap", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a training script as a job of simulated nodes")
    run.add_argument("--nodes", type=int, default=None)
    run.add_argument("--nproc-per-node", type=int, default=None)
    run.add_argument("--persist", default=None, help="durable root (path or fsspec URL)")
    run.add_argument("--persist-every", type=int, default=None)
    run.add_argument("--keep", type=int, default=None)
    run.add_argument("--run-dir", default=None)
    run.add_argument(
        "--inject",
        action="append",
        default=[],
        help="kill:node=I:step=S or kill:rank=R:step=S (repeatable)",
    )
    run.add_argument("--max-restarts", type=int, default=None)
    run.add_argument("--threads", type=int, default=None, help="torch threads per worker")
    run.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="tier-1 copies of each rank in other nodes' memory (default 1)",
    )
    run.add_argument(
        "--max-peer-memory",
        type=int,
        default=None,
        help="bytes one node may hold for others (default: no bound)",
    )
    run.add_argument(
        "--max-redo",
        type=int,
        default=None,
        help="steps a node failure may cost: training waits for tier 1 past this (default "
        "1; 0 never waits)",
    )
    run.add_argument(
        "--bind",
        default=None,
        help="this host's address, where the others reach it (coordinator, store, replicas; "
        "with --join: the joining host's own; default 127.0.0.1, or for --join the address "
        "its connection to the coordinator leaves from)",
    )
    run.add_argument(
        "--spares", type=int, default=None, help="parked spare nodes that take failed ones"
    )
    run.add_argument(
        "--spare-workers",
        type=int,
        default=None,
        help="parked extra workers per node that take a crashed worker's rank at once",
    )
    run.add_argument(
        "--on-no-spare",
        choices=["wait", "fail"],
        default=None,
        help="when no spare is left: wait for a node to join (default) or stop",
    )
    run.add_argument("--heartbeat", type=float, default=None, help="seconds between beats")
    run.add_argument(
        "--lease", type=float, default=None, help="seconds of silence that fail a process"
    )
    run.add_argument(
        "--collective-timeout",
        type=float,
        default=None,
        help="seconds a collective may block (torch's default is 30 minutes)",
    )
    run.add_argument(
        "--backend", choices=["gloo", "nccl"], default=None, help="collectives (default gloo)"
    )
    run.add_argument(
        "--memory-tiers",
        choices=["full", "delta"],
        default=None,
        help="tier-1 replicas as full snapshots (default) or base + delta",
    )
    run.add_argument("--base-every", type=int, default=None, help="delta mode: steps per base")
    run.add_argument(
        "--delta-threshold",
        type=float,
        default=None,
        help="delta mode: a delta past this fraction of full makes the next replica a base",
    )
    run.add_argument(
        "--persist-deltas",
        action="store_true",
        help="tier 2 holds deltas between full steps (every --base-every steps a full one)",
    )
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
    bench.add_argument("--json", default=None, help="also write the results here")
    bench.set_defaults(func=_bench)

    demo = sub.add_parser("demo", help="train a small GPT through a failure, prove the bits")
    demo.add_argument("--steps", type=int, default=40)
    demo.set_defaults(func=_demo)
    return p


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
