"""``tierswap bench hosts``: a host killed across real network stacks against the same
job simulated on one host, and the coordinator's host killed under ``--rdzv-backend etcd``.

Both runs are the example GPT, 2 nodes of 1 rank and one spare, DDP, the same steps:

- *one host*: ``tierswap run --nodes 2 --spares 1`` (every node an agent on loopback);
- *hosts*: three network namespaces on a bridge (``bench/netns.py``), each running its
  own ``tierswap run --nnodes 2 --rdzv-endpoint A:29400`` (A serves node 0 and runs the
  coordinator, B serves node 1, C is ``--spare``); replicas go over TLS, as on a cluster.

The kill is the same for both, from outside, at the same moment: once tier 1 has
committed step ``KILL - 1``, every process of node 1's host is SIGKILLed (its agent's
process group on one host; every process in B's namespace across hosts). Recovery is the
time from that kill to the coordinator's ``resumed`` event (every rank has completed its
first step again); the runs alternate (one host, hosts, one host, ...), and each is
checked bit for bit against an uninterrupted run.

*failover* (where an etcd server is installed): the same three hosts with
``--rdzv-backend etcd`` and etcd on a fourth namespace; A's launcher leads and serves node
0. Every process of A is killed; the time to the next leader's ``coordinator_took_over``
and to the ``resumed`` event (every rank has completed a step again). Needs root.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from tierswap.bench.common import stats
from tierswap.bench.etcdserver import ETCD, Etcd
from tierswap.bench.netns import Network, Unavailable
from tierswap.cluster.election import TTL
from tierswap.events import job_events
from tierswap.examples import differing, job_command, load_final
from tierswap.shm import remove_job_segments

STEPS, KILL = 16, 8
SLEEP = ("--sleep", "0.05")
SECRET = "bench-hosts-secret-0123456789abcdef"
TIMEOUT = 300.0


def _wait(run_dir: Path, kind: str, timeout: float, **fields: Any) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in job_events(run_dir, kind):
            if all(e.get(k) == v for k, v in fields.items()):
                return e
        time.sleep(0.02)
    raise RuntimeError(f"no {kind} {fields} in {run_dir} within {timeout:g} s")


def _script_args(out: Path) -> list[str]:
    return ["--steps", str(STEPS), "--mode", "ddp", "--out", str(out), *SLEEP]


def _start(cmd: list[str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, TIERSWAP_SECRET=SECRET)
    with log.open("w") as f:
        return subprocess.Popen(
            cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def _finish(procs: list[subprocess.Popen[bytes]], pids: list[int]) -> list[int]:
    """Wait for the launchers, then kill whatever of the job is left, by id."""
    deadline = time.monotonic() + TIMEOUT
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(-1)
    for pid in [p.pid for p in procs] + pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for proc in procs:
        proc.wait()
    return codes


def _result(run_dir: Path, killed_at: float, out: Path, base: Path) -> dict[str, Any]:
    (resumed,) = job_events(run_dir, "resumed")
    diff = differing(load_final(base), load_final(out))
    return {
        "seconds": resumed["time"] - killed_at,
        "phases": resumed["phases"],
        "redone": resumed["redone"],
        "bit_exact": not diff,
    }


def one_host(work: Path, name: str, base: Path) -> dict[str, Any]:
    run_dir, out = work / name, work / f"{name}-final"
    cmd = job_command(run_dir, ["--nodes", "2", "--spares", "1"], _script_args(out))
    proc = _start(cmd, work, work / f"{name}.log")
    pids: list[int] = []
    try:
        _wait(run_dir, "snapshot_committed", TIMEOUT, tier=1, step=KILL - 1)
        node1 = next(e for e in job_events(run_dir, "node_joined") if e["node"] == 1)
        os.killpg(node1["pid"], signal.SIGKILL)
        killed_at = time.time()
    finally:
        pids = [e["pid"] for e in job_events(run_dir, "node_joined")]
        codes = _finish([proc], pids)
    if codes != [0]:
        raise RuntimeError(f"{name} failed: {(work / f'{name}.log').read_text()[-3000:]}")
    return _result(run_dir, killed_at, out, base)


def across_hosts(work: Path, name: str, base: Path) -> dict[str, Any]:
    out = work / f"{name}-final"
    with Network(3) as (a, b, c):
        endpoint = f"{a.address}:29400"
        procs = []
        for i, (host, role) in enumerate(
            [(a, ["--node-rank", "0"]), (b, ["--node-rank", "1"]), (c, ["--spare"])]
        ):
            run = ["--nnodes", "2", "--rdzv-endpoint", endpoint, *role]
            cmd = [*host.prefix, *job_command(work / f"{name}-h{i}", run, _script_args(out))]
            procs.append(_start(cmd, work, work / f"{name}-h{i}.log"))
        run_dir = work / f"{name}-h0"
        try:
            _wait(run_dir, "snapshot_committed", TIMEOUT, tier=1, step=KILL - 1)
            b.kill_all()
            killed_at = time.time()
        finally:
            codes = _finish(procs, [e["pid"] for e in job_events(run_dir, "node_joined")])
    if codes[0] != 0 or codes[2] != 0:
        logs = "\n".join((work / f"{name}-h{i}.log").read_text()[-2000:] for i in range(3))
        raise RuntimeError(f"{name} failed ({codes}):\n{logs}")
    return _result(run_dir, killed_at, out, base)


def _all_events(work: Path, name: str, kind: str) -> list[dict[str, Any]]:
    """The events of every host's log of one job (each leader logs its own)."""
    found = [e for i in range(3) for e in job_events(work / f"{name}-h{i}", kind)]
    return sorted(found, key=lambda e: e["time"])


def failover(work: Path, name: str, base: Path) -> dict[str, Any]:
    """``--rdzv-backend etcd``: the coordinator's host (it serves node 0) is killed."""
    out = work / f"{name}-final"
    with Network(4) as (a, b, c, d):
        server = Etcd(d.address, prefix=d.prefix)
        procs: list[subprocess.Popen[bytes]] = []
        try:
            server.wait(prefix=a.prefix)
            endpoint = f"{server.endpoint[0]}:{server.endpoint[1]}"
            for i, (host, role) in enumerate(
                [(a, ["--node-rank", "0"]), (b, ["--node-rank", "1"]), (c, ["--spare"])]
            ):
                run = ["--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint]
                cmd = job_command(work / f"{name}-h{i}", [*run, *role], _script_args(out))
                procs.append(_start([*host.prefix, *cmd], work, work / f"{name}-h{i}.log"))
                if i == 0:  # the first host leads
                    _wait(work / f"{name}-h0", "job_started", TIMEOUT)
            _wait(work / f"{name}-h0", "snapshot_committed", TIMEOUT, tier=1, step=KILL - 1)
            a.kill_all()
            killed_at = time.time()
            codes = _finish(procs[1:], [])
        finally:
            _finish(procs, [])
            for host in (a, b, c):
                host.kill_all()
            server.close()
    if codes != [0, 0]:
        logs = "\n".join((work / f"{name}-h{i}.log").read_text()[-2000:] for i in range(3))
        raise RuntimeError(f"{name} failed ({codes}):\n{logs}")
    (took,) = _all_events(work, name, "coordinator_took_over")
    resumed = [e for e in _all_events(work, name, "resumed") if e["time"] > killed_at]
    for started in _all_events(work, name, "job_started"):
        remove_job_segments(started["job_id"])  # the killed host's (one /dev/shm here)
    diff = differing(load_final(base), load_final(out))
    return {
        "seconds": resumed[0]["time"] - killed_at,
        "takeover": took["time"] - killed_at,
        "phases": resumed[0]["phases"],
        "redone": resumed[0]["redone"],
        "bit_exact": not diff,
    }


def uninterrupted(work: Path) -> Path:
    out = work / "base-final"
    cmd = job_command(work / "base", ["--nodes", "2"], _script_args(out))
    codes = _finish([_start(cmd, work, work / "base.log")], [])
    if codes != [0]:
        raise RuntimeError(f"the uninterrupted run failed: {(work / 'base.log').read_text()}")
    return out


def run(repeats: int) -> dict[str, Any]:
    rounds: dict[str, list[dict[str, Any]]] = {"one_host": [], "hosts": [], "failover": []}
    with tempfile.TemporaryDirectory(prefix="tierswap-bench-hosts-") as tmp:
        work = Path(tmp)
        base = uninterrupted(work)
        for i in range(repeats):  # interleaved: one host, hosts, one host, ...
            rounds["one_host"].append(one_host(work, f"one{i}", base))
            rounds["hosts"].append(across_hosts(work, f"hosts{i}", base))
            if ETCD is not None:
                rounds["failover"].append(failover(work, f"fail{i}", base))
    if not rounds["failover"]:
        del rounds["failover"]  # no etcd server here: said in the report
    summary = {k: stats([r["seconds"] for r in v]) for k, v in rounds.items()}
    ratio = summary["hosts"]["median"] / summary["one_host"]["median"]
    return {"rounds": rounds, "summary": summary, "ratio": ratio, "kill_at_step": KILL}


def report(result: dict[str, Any]) -> str:
    lines = [
        "| job | recovery, median (min - max) | redone | bit-exact |",
        "| --- | --- | --- | --- |",
    ]
    names = {
        "one_host": "2 nodes + spare simulated on one host",
        "hosts": "3 hosts (namespaces)",
        "failover": "3 hosts + etcd, the coordinator's host killed",
    }
    for key, label in names.items():
        if key not in result["rounds"]:
            lines.append(f"| {label} | not run: no etcd server here (apt etcd-server) | | |")
            continue
        s, rs = result["summary"][key], result["rounds"][key]
        exact = sum(r["bit_exact"] for r in rs)
        redone = max(r["redone"] for r in rs)
        lines.append(
            f"| {label} | {s['median']:.2f} s ({s['min']:.2f} - {s['max']:.2f}) | "
            f"<= {redone} | {exact}/{len(rs)} |"
        )
    lines.append(f"\nacross hosts / one host: {result['ratio']:.2f}x (target <= 1.5x)")
    if "failover" in result["rounds"]:
        took = stats([r["takeover"] for r in result["rounds"]["failover"]])
        lines.append(
            f"coordinator failover: another host led after {took['median']:.2f} s "
            f"({took['min']:.2f} - {took['max']:.2f}; etcd lease {TTL} s), every rank "
            f"stepped again after {result['summary']['failover']['median']:.2f} s "
            "(target < 5 s)"
        )
    phases = {
        key: {p: stats([r["phases"][p] for r in rs])["median"] for p in rs[0]["phases"]}
        for key, rs in result["rounds"].items()
    }  # (after a failover, "detect" to "resume" count from the takeover)
    for key, ph in phases.items():
        lines.append(f"{names[key]}: " + ", ".join(f"{p} {v:.2f} s" for p, v in ph.items()))
    return "\n".join(lines)


def main(args: Any) -> int:
    try:
        result = run(args.repeats)
    except Unavailable as e:
        print(f"tierswap bench hosts: {e}")
        return 2
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0
