"""The command line: tierswap run | ls | verify | export | bench | demo."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import typing
from pathlib import Path
from typing import Any

from tierswap.affinity import (
    AGENT_ENV,
    MACHINE_ENV,
    WORKER_ENV,
    check_cpus_here,
    machine_cpus,
    parse_cpus,
    pin_process,
)
from tierswap.cluster.multihost import DEFAULT_PORT
from tierswap.config import Config, field_docs
from tierswap.errors import TierswapError, UsageError
from tierswap.faults import FORMS, Injection
from tierswap.root_commands import export_step, list_root, verify_root


def _join(args: argparse.Namespace) -> int:
    """Join a running job as a spare node: this process becomes the node's agent."""
    from tierswap.cluster.multihost import JOIN_CPUS_ENV, KEY_ENV, inherited, job_key, read_secret

    run_dir = args.run_dir or os.environ.get("TIERSWAP_RUN_DIR")
    ticket = Path(run_dir) / "join.json" if run_dir else None
    key = None
    if args.run_dir and ticket is not None and ticket.is_file():  # named on this line: first
        key = json.loads(ticket.read_text())["key"]
    elif os.environ.get("TIERSWAP_SECRET"):  # the secret the job was started with
        key = job_key(read_secret(None, os.environ, "tierswap run --join")).hex()
    elif ticket is not None and ticket.is_file():
        key = json.loads(ticket.read_text())["key"]
    if key is None:
        raise SystemExit(
            "tierswap run --join: the job's key is needed: give --run-dir of the job (its "
            "join.json holds it; readable by its owner only), or set TIERSWAP_SECRET to the "
            "secret the job was started with"
        )
    if ":" not in args.join:
        raise SystemExit(f"tierswap run --join {args.join!r}: expected HOST:PORT")
    env = inherited(os.environ)
    env.update(TIERSWAP_COORD=args.join, TIERSWAP_SPARE="1", **{KEY_ENV: key})
    if args.bind:
        from tierswap.cluster.address import check_advertised

        env["TIERSWAP_HOST_ADDRESS"] = check_advertised(args.bind, "tierswap run --join --bind")
    # this host's own CPU lists (its line's, else its TIERSWAP_* ones; none: not pinned)
    own = {
        name: getattr(args, name) or os.environ.get(variable) or None
        for name, variable in (("agent_cpus", AGENT_ENV), ("worker_cpus", WORKER_ENV))
    }
    try:
        check_cpus_here(own["agent_cpus"], own["worker_cpus"], "tierswap run --join")
    except ValueError as e:
        raise SystemExit(str(e)) from None
    env[JOIN_CPUS_ENV] = json.dumps(own)
    if run_dir:
        from tierswap.cluster.coordinator import make_run_dir
        from tierswap.cluster.launch import check_socket_folder

        check_socket_folder(Path(run_dir), "tierswap run --join --run-dir")
        make_run_dir(Path(run_dir))  # the agent's socket goes there
        env["TIERSWAP_RUN_DIR"] = run_dir
    script = [args.script, *args.args] if args.script else []
    print(f"tierswap run --join: joining the job at {args.join} as a spare host", flush=True)
    os.execve(sys.executable, [sys.executable, "-m", "tierswap.cluster.agent", *script], env)


def _run_hosts(args: argparse.Namespace) -> int:
    """One host of a multi-host launch (``--rdzv-endpoint``): the coordinator's host runs
    the coordinator and an agent; every other host becomes its agent."""
    from tierswap.cluster import multihost as mh
    from tierswap.cluster.launch import check_shared, check_socket_folder, default_run_dir

    what = "tierswap run --rdzv-endpoint"
    if args.join:
        raise UsageError(f"{what} and --join: a host of a multi-host launch joins by itself")
    if args.nodes is not None:
        raise UsageError(
            f"{what} takes --nnodes (the hosts of the job); --nodes simulates nodes on one machine"
        )
    if args.nnodes is None:
        raise UsageError(f"{what}: give --nnodes N, the hosts that serve the job's nodes")
    if args.bind is not None:
        raise UsageError(
            f"{what} and --bind: the coordinator listens on the endpoint's address, and each "
            "host on the address it reaches the coordinator from"
        )
    if not args.script:
        raise UsageError(f"{what}: a SCRIPT to run is needed")
    cfg = Config.from_env(**dict(_config_args(args), nodes=args.nnodes))
    launch = mh.HostLaunch(
        nnodes=cfg.nodes,
        nproc_per_node=cfg.nproc_per_node,  # as the coordinator's config has it
        node_rank=args.node_rank,
        spare=args.spare,
        job=args.rdzv_id,
        agent_cpus=cfg.agent_cpus,
        worker_cpus=cfg.worker_cpus,
    )
    launch.check()
    _refuse_simulation_options(cfg)
    try:  # this host's own lists: its agent pins by them (cluster.agent.own_cpus)
        check_cpus_here(cfg.agent_cpus, cfg.worker_cpus, what)
    except ValueError as e:
        raise UsageError(str(e)) from None
    key = mh.job_key(mh.read_secret(args.secret_file, os.environ, what))
    endpoint = args.rdzv_endpoint
    if args.rdzv_backend == "etcd" and ":" not in endpoint:
        endpoint += ":2379"  # etcd's client port
    ip, port = mh.parse_endpoint(endpoint, wait=cfg.startup_timeout)
    name = args.rdzv_endpoint.rpartition(":")[0] or args.rdzv_endpoint
    if ip.startswith("127.") and name not in (ip, "localhost"):
        print(
            f"tierswap run: warning: --rdzv-endpoint {name} is {ip}, a loopback address on "
            "this host (an /etc/hosts entry for its own name?): hosts on other machines "
            "cannot reach it; give the address they reach this host at",
            file=sys.stderr,
        )
    run_dir = Path(cfg.run_dir) if cfg.run_dir else default_run_dir()
    check_socket_folder(run_dir, "tierswap run --run-dir")
    if not Path(args.script).is_file():
        raise UsageError(f"script {args.script!r} not found")
    from tierswap.cluster.coordinator import make_run_dir

    make_run_dir(run_dir)  # its agent's sockets and the job's log go there
    script = [args.script, *args.args]
    if args.rdzv_backend == "etcd":  # the endpoint is etcd's: every host is a candidate
        from tierswap.cluster import candidate

        if cfg.persist is not None:
            check_shared(cfg.persist)
        _stop_on_signals()
        _pin_launcher(cfg)  # it may lead: the coordinator then runs beside the agents
        return candidate.run(cfg, launch, key, script, run_dir, (ip, port))
    listener = mh.listen_here(ip, port, key)
    if listener is None:  # another host holds the endpoint: this one is a host of the job
        env = mh.agent_env(os.environ, (ip, port), key, launch, run_dir)
        env["TIERSWAP_STARTUP_TIMEOUT"] = str(cfg.startup_timeout)
        agent = [sys.executable, "-m", "tierswap.cluster.agent", *script]
        os.execve(sys.executable, agent, env)
    cfg = dataclasses.replace(cfg, bind=ip, job_name=cfg.job_name or launch.job)
    if cfg.persist is not None:
        check_shared(cfg.persist)
    _stop_on_signals()
    _pin_launcher(cfg)
    from tierswap.cluster.coordinator import Coordinator

    return Coordinator(cfg, script, run_dir, hosts=launch, key=key, listener=listener).run()


def _pin_launcher(cfg: Config) -> None:
    """A launcher that runs the coordinator (or may, as a candidate) onto ``--agent-cpus``,
    off the trainers' cores; the agents it starts take the workers' CPUs from what it could
    use before (a host that joins from elsewhere takes its own machine's)."""
    if not cfg.agent_cpus:
        return
    os.environ[MACHINE_ENV] = ",".join(map(str, sorted(machine_cpus())))
    pin_process(parse_cpus(cfg.agent_cpus), "--agent-cpus")


def _refuse_simulation_options(cfg: Config) -> None:
    """Options of the one-machine simulation that a multi-host launch cannot honour:
    refused, rather than accepted and doing nothing."""
    if cfg.spares:
        raise UsageError(
            "--spares with --rdzv-endpoint: a spare is a host of its own here; start one "
            "more host than --nnodes (or one with --spare)"
        )
    if cfg.chaos:
        raise UsageError("--chaos kills simulated nodes: run it with --nodes N on one machine")
    nodes = [str(i) for i in cfg.inject if i.target == "node"]
    if nodes:
        raise UsageError(
            f"--inject {nodes[0]}: node faults are injected into simulated nodes; with "
            "--rdzv-endpoint kill the host itself (rank faults work)"
        )


def _stop_on_signals() -> None:
    # SIGTERM unwinds like an exception, so the coordinator stops its agents on the way out;
    # SIGINT is Ctrl-C even where the launcher was started with it ignored (a background
    # job of a script inherits SIG_IGN, and Python then never raises KeyboardInterrupt)
    # (SIGHUP, a terminal or ssh session closing, the same: its default left the root's lock)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:  # (nohup: it stays ignored)
        signal.signal(signal.SIGHUP, lambda *_: sys.exit(129))
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _run(args: argparse.Namespace) -> int:
    from tierswap.cluster.coordinator import Coordinator
    from tierswap.cluster.launch import check_shared, check_socket_folder, default_run_dir

    # a launcher measures its machine's CPUs itself: a value inherited from another job's
    # launcher (tierswap run started from its workers) is not this one's
    os.environ.pop(MACHINE_ENV, None)
    if args.rdzv_endpoint:
        return _run_hosts(args)
    for flag in ("nnodes", "node_rank", "secret_file", "rdzv_id"):
        if getattr(args, flag) is not None:
            name = "--" + flag.replace("_", "-")
            raise UsageError(
                f"{name}: belongs to a multi-host launch; give --rdzv-endpoint "
                "HOST:PORT too (on one machine, --nodes N simulates N nodes)"
            )
    if args.spare:
        raise UsageError("--spare: needs --rdzv-endpoint (or use --join HOST:PORT)")
    if args.join:
        return _join(args)
    if not args.script:
        raise SystemExit("tierswap run: a SCRIPT to run is needed (or --join HOST:PORT)")
    cfg = Config.from_env(**_config_args(args))
    try:
        check_cpus_here(cfg.agent_cpus, cfg.worker_cpus)
    except ValueError as e:
        raise UsageError(str(e)) from None
    import dataclasses

    from tierswap.cluster.address import check_advertised

    # the address checked is the one used (a name is resolved once, here)
    cfg = dataclasses.replace(cfg, bind=check_advertised(cfg.bind, "tierswap run --bind"))
    run_dir = Path(cfg.run_dir) if cfg.run_dir else default_run_dir()
    check_socket_folder(run_dir, "tierswap run --run-dir")
    if cfg.persist is not None:
        check_shared(cfg.persist)
    _stop_on_signals()
    script = [args.script, *args.args]
    if not Path(args.script).is_file():
        raise SystemExit(f"tierswap run: script {args.script!r} not found")
    key = None  # a fresh one, in RUN_DIR/join.json; or the secret's, so others can --join
    if os.environ.get("TIERSWAP_SECRET"):
        from tierswap.cluster.multihost import job_key, read_secret

        key = job_key(read_secret(None, os.environ, "tierswap run"))
    _pin_launcher(cfg)
    return Coordinator(cfg, script, run_dir, key=key).run()


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
            kind = next((t for t in (int, float) if tp in (t, t | None)), str)
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
    hosts = run.add_argument_group(
        "multi-host launch (one tierswap run per host, the same line on each, as torchrun)"
    )
    hosts.add_argument(
        "--rdzv-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="where the coordinator listens: the host holding this address runs it, every "
        f"host connects to it (port default {DEFAULT_PORT})",
    )
    hosts.add_argument("--nnodes", type=int, default=None, help="hosts that serve the job's nodes")
    hosts.add_argument(
        "--rdzv-backend",
        choices=("c10d", "etcd"),
        default="c10d",
        help="c10d: the coordinator runs on the endpoint's host (default); etcd: the "
        "endpoint is an etcd server, every host a coordinator candidate, and the job "
        "survives the coordinator's host",
    )
    hosts.add_argument(
        "--rdzv-id", default=None, metavar="JOB", help="the job's id; hosts of another are refused"
    )
    hosts.add_argument(
        "--node-rank", type=int, default=None, metavar="I", help="serve node I (default: any)"
    )
    hosts.add_argument(
        "--spare", action="store_true", help="park this host as a spare, whatever is free"
    )
    hosts.add_argument(
        "--secret-file",
        default=None,
        metavar="PATH",
        help="the job's secret, the same on every host (else TIERSWAP_SECRET)",
    )
    run.add_argument("script", nargs="?")
    run.add_argument("args", nargs=argparse.REMAINDER)
    run.set_defaults(func=_run)

    ls = sub.add_parser("ls", help="list the steps of a durable root")
    ls.add_argument("url")
    ls.set_defaults(func=list_root)

    verify = sub.add_parser("verify", help="check every checksum of a durable root")
    verify.add_argument("url")
    verify.add_argument("--step", type=int, default=None)
    verify.set_defaults(func=verify_root)

    export = sub.add_parser(
        "export", help="write a committed step as safetensors, Hugging Face or DCP"
    )
    export.add_argument("url")
    export.add_argument("--step", type=int, default=None, help="default: the newest")
    export.add_argument(
        "--format",
        choices=("merged", "hf", "dcp"),
        default="merged",
        help="merged: one safetensors file of every rank's state merged, plus its JSON; "
        "hf: the model's weights as Hugging Face safetensors in folder OUT; "
        "dcp: a torch.distributed.checkpoint folder OUT",
    )
    export.add_argument(
        "--max-shard-size", default="5GB", help="hf: the largest file (default 5GB)"
    )
    export.add_argument(
        "--model", default=None, help="hf: the model's state key (default: the only module)"
    )
    export.add_argument("out")
    export.set_defaults(func=export_step)

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
            "hosts",
            "dcp",
            "gpu-check",
            "goodput",
            "memory",
            "overhead",
            "peers",
            "all",
            "report",
        ],
    )
    bench.add_argument(
        "--size-mib",
        type=int,
        nargs="+",
        default=None,
        help="state size (default: 1024 for snapshot, 256 for replication); recovery: "
        "the sizes per rank of its curve (default 5 75 384)",
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
    bench.add_argument("--seed", type=int, default=None, help="goodput: the chaos runs' seed")
    bench.add_argument("--json", default=None, help="also write the results here")
    bench.add_argument(
        "--quick", action="store_true", help="all: the short run (minutes), small sizes"
    )
    bench.add_argument(
        "--results",
        default=None,
        help="all: the folder its JSON goes to (default bench/results/<date>-<commit>); "
        "report: the folder to report (default the newest under bench/results)",
    )
    bench.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="all: run only these benchmarks of the run (the others are not run)",
    )
    bench.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="peers: seconds the run may take; a round that would end past them is not "
        "started, past the first two (bench all gives what is left of its own budget, less "
        "the later benchmarks' typical time at the run's pace and a margin); all: the whole "
        "run's (default 2280, 270 with --quick)",
    )
    bench.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="peers: seconds past which no round may end, even the first two that the "
        "budget does not cut (bench all gives its own deadline for it, less a margin)",
    )
    bench.add_argument(
        "--peers-python",
        default=None,
        help="peers: the Python with DLRover and torchft (default .venv-peers/bin/python, "
        "made by `make bench-peers`)",
    )
    bench.set_defaults(func=_bench)

    simulate = sub.add_parser(
        "simulate", help="project a month's goodput at cluster scale: tierswap and the others"
    )
    from tierswap import goodput

    goodput.add_arguments(simulate)
    simulate.set_defaults(func=lambda a: goodput.main(a))
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


def _said_by(command: str, message: str) -> str:
    """``message`` headed by the command it stops, once: a message that names the command
    itself (``tierswap run --rdzv-endpoint: ...``) is not headed again."""
    if message == command or message.startswith((f"{command} ", f"{command}:")):
        return message
    return f"{command}: {message}"


STORAGE_CLIENTS = ("botocore", "aiobotocore", "s3fs", "aiohttp", "gcsfs", "adlfs")
"""Packages whose errors are a remote durable root's (unreachable, refused, no such
bucket), not tierswap's: said in a line, not as a traceback."""


def _storage_error(e: BaseException) -> bool:
    return type(e).__module__.split(".")[0] in STORAGE_CLIENTS


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    command = f"tierswap {args.command}"
    try:
        code = int(args.func(args))
    except (TierswapError, ValueError) as e:
        print(_said_by(command, str(e)), file=sys.stderr)
        code = 2
    except Exception as e:
        if not _storage_error(e):
            raise
        root = (
            getattr(args, "url", None)
            or getattr(args, "persist", None)
            or os.environ.get("TIERSWAP_PERSIST")
            or "the durable root"
        )
        said = f"{root} cannot be reached or used: {type(e).__name__}: {e}"
        print(_said_by(command, said), file=sys.stderr)
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main()
