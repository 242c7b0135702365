"""Hot-swap: a spare takes a failed node's ranks while the survivors keep their processes.

Each test checks the project's oracle (the final state is bit-for-bit the one of an
uninterrupted run) and what makes it a hot swap: survivors' process ids unchanged, the
spare serving the failed node's ranks, at most one step redone.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from e2e import (
    assert_hot_swapped,
    assert_same_bits,
    events,
    final_state,
    kill_job,
    leaked_segments,
    run_job,
)
from tierswap.cluster.workers import STARTS_ALONE
from tierswap.examples import job_command

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

SLOW = ("--sleep", "0.05")
"""Steps long enough for replication to keep up on 2 busy cores, as on real hardware."""
SHORT_LEASE = ("--heartbeat", "0.25", "--lease", "2")
"""A hang is declared after 2 s of silence (10 s by default)."""


@pytest.fixture(autouse=True)
def _no_leaked_memory(tmp_path: Path):
    yield
    assert not leaked_segments(tmp_path), "a job left shared-memory segments behind"


DELAY_S = 0.25


def test_spare_takes_failed_node_ddp(tmp_path: Path, baseline) -> None:
    """Node 1's replicas are held back (a slow network, far slower than a step): training
    waits for tier 1 (``--max-redo 1``), so the swap still redoes at most one step."""
    base = baseline(nodes=2, mode="ddp")
    slow = f"delay:node=1:seconds={DELAY_S}"
    code, run_dir, out = run_job(
        tmp_path,
        "swap",
        steps=12,
        extra=("--spares", "1", "--inject", "kill:node=1:step=7", "--inject", slow),
    )
    assert code == 0, out
    reports = {e["step"]: e["time"] for e in events(run_dir, "report")}
    assert reports[6] - reports[2] >= 4 * DELAY_S * 0.9, "the steps did not wait for tier 1"
    assert_same_bits(base, final_state(tmp_path, "swap"))
    (assigned,) = events(run_dir, "spare_assigned")
    spares = [e for e in events(run_dir, "node_joined") if e["role"] == "spare"]
    assert assigned["node"] == 1 and assigned["host"] == spares[0]["host"]
    assert events(run_dir, "generation_started")[-1]["members"]["1"] == assigned["host"]
    warm = events(run_dir, "spare_warm")
    assert warm and warm[0]["host"] == assigned["host"] and warm[0]["bytes"] > 0, warm
    restored = events(run_dir, "restored")[-1]
    assert restored["tiers"] == {"0": 0, "1": 1}, "survivor from tier 0, the spare from a peer"
    assert_hot_swapped(run_dir, survivors=[0], replaced=[1])
    resumed_at = events(run_dir, "resumed")[0]["time"]
    later = [
        e
        for e in events(run_dir, "snapshot_committed")
        if e["tier"] == 1 and e["time"] > resumed_at
    ]
    assert later, "replication re-formed around the spare"


def test_four_nodes_exact_ddp_spare(tmp_path: Path, baseline) -> None:
    base = baseline(nodes=4, mode="ddp-exact")
    code, run_dir, out = run_job(
        tmp_path,
        "swap",
        nodes=4,
        steps=12,
        mode="ddp-exact",
        train_args=SLOW,
        extra=("--spares", "1", "--inject", "kill:node=1:step=6"),
    )
    assert code == 0, out
    assert_same_bits(base, final_state(tmp_path, "swap"))
    assert events(run_dir, "spare_assigned")[0]["node"] == 1
    assert_hot_swapped(run_dir, survivors=[0, 2, 3], replaced=[1])


def test_two_failures_two_spares_and_a_spare_lost_while_taking_over(
    tmp_path: Path, baseline
) -> None:
    """Node 1 dies; the first spare is killed as it takes over (generation 1 starting);
    the second spare takes node 1; later node 0 dies and a revived host takes it."""
    base = baseline(nodes=2, mode="ddp")
    code, run_dir, out = run_job(
        tmp_path,
        "swap",
        steps=12,
        train_args=SLOW,
        extra=(
            "--spares",
            "2",
            "--inject",
            "kill:node=1:step=4",
            "--inject",
            "kill:node=1:gen=1",
            "--inject",
            "kill:node=0:step=9",
        ),
    )
    assert code == 0, out
    assert_same_bits(base, final_state(tmp_path, "swap"))
    assigned = [(e["node"], e["host"]) for e in events(run_dir, "spare_assigned")]
    assert [n for n, _ in assigned] == [1, 1, 0], assigned
    assert len({h for _, h in assigned}) == 3, "each takeover by another host"
    for r in events(run_dir, "resumed"):
        assert r["redone"] <= 1, r


def test_failure_while_a_snapshot_is_replicated(tmp_path: Path) -> None:
    """A wider model (75 MiB a rank, tens of ms a transfer on loopback); node 1 is killed
    as a replica of step 4 or later starts to go to or from it, cutting it."""
    args = ("--width", "512", "--layers", "2")
    code, _, out = run_job(tmp_path, "base", steps=8, train_args=args)
    assert code == 0, out
    code, run_dir, out = run_job(
        tmp_path,
        "swap",
        steps=8,
        train_args=args,
        extra=("--spares", "1", "--inject", "kill:node=1:step=4:during=replication"),
    )
    assert code == 0, out
    assert_same_bits(final_state(tmp_path, "base"), final_state(tmp_path, "swap"))
    cut = events(run_dir, "replicate_failed") + [
        e for e in events(run_dir, "replica_rejected") if "cut off" in e["why"]
    ]
    assert cut, "the kill cut a transfer in flight"
    assert_hot_swapped(run_dir, survivors=[0], replaced=[1])


def test_hung_worker_is_detected_by_its_lease(tmp_path: Path, baseline) -> None:
    base = baseline(nodes=2, mode="ddp")
    code, run_dir, out = run_job(
        tmp_path,
        "hang",
        steps=12,
        train_args=SLOW,
        extra=("--inject", "stop:rank=1:step=6", *SHORT_LEASE),
    )
    assert code == 0, out
    assert_same_bits(base, final_state(tmp_path, "hang"))
    (hung,) = events(run_dir, "worker_hung")
    assert hung["rank"] == 1 and "no heartbeat" in hung["why"]
    (failure,) = events(run_dir, "failure_detected")
    assert failure["seconds"] < 6, "detected within the lease (plus scheduling slack)"
    assert_hot_swapped(run_dir, survivors=[0], replaced=[1])


def test_hung_node_is_fenced_when_its_lease_expires(tmp_path: Path, baseline) -> None:
    base = baseline(nodes=2, mode="ddp")
    code, run_dir, out = run_job(
        tmp_path,
        "hang",
        steps=12,
        train_args=SLOW,
        extra=(
            "--spares",
            "1",
            "--inject",
            "stop:node=1:step=6",
            *SHORT_LEASE,
        ),
    )
    assert code == 0, out
    assert_same_bits(base, final_state(tmp_path, "hang"))
    (failure,) = events(run_dir, "failure_detected")
    assert failure["what"] == "node" and "lease expired" in failure["detail"]
    assert_hot_swapped(run_dir, survivors=[0], replaced=[1])


def test_no_spare_and_fail_stops_keeping_every_tier(tmp_path: Path) -> None:
    persist = tmp_path / "ckpt"
    code, run_dir, out = run_job(
        tmp_path,
        "fail",
        steps=40,
        train_args=SLOW,
        extra=(
            "--on-no-spare",
            "fail",
            "--persist",
            str(persist),
            "--persist-every",
            "2",
            "--inject",
            "kill:node=1:step=8",
        ),
    )
    assert code == 1, out
    assert "no spare is left" in out and "--persist to resume" in out
    assert events(run_dir, "job_failed")
    check = subprocess.run(
        [sys.executable, "-m", "tierswap.cli", "verify", str(persist)],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr


def _wait_for(run_dir: Path, kind: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "events.jsonl").exists():
            found = events(run_dir, kind)
            if found:
                return found[0]
        time.sleep(0.2)
    raise AssertionError(f"no {kind} event within {timeout} s")


def _job_joined_after_a_loss(
    tmp_path: Path,
    bind: tuple[str, ...] = (),
    joiner: tuple[str, ...] = (),
    secret: str | None = None,
    forks: list[int] | None = None,
) -> tuple[int, Path, str]:
    """Kill node 1 with no spare and nobody revived (``wait``); once the job waits, a host
    joins with ``tierswap run --join`` (its command prefixed by ``joiner``), with the key
    from the job's join.json, or with the ``secret`` the job was started with. ``forks``
    gets the most workers forked by the joining host's template seen at once."""
    run_dir = tmp_path / "wait"
    cmd = job_command(
        run_dir,
        ["--nodes", "2", "--inject", "kill:node=1:step=6", *bind],
        ["--steps", "12", "--mode", "ddp", "--out", str(tmp_path / "wait-final"), *SLOW],
    )
    env = dict(os.environ, TIERSWAP_REVIVE="0")  # nobody comes back unless asked to
    if secret is not None:
        env["TIERSWAP_SECRET"] = secret
    log = tmp_path / "wait.log"
    with log.open("w") as out:
        job = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
            start_new_session=True,
        )
        proc = None
        try:
            _wait_for(run_dir, "waiting_for_node", 120)
            address = json.loads((run_dir / "join.json").read_text())["address"]
            hint = _join_hint(log)  # the command the job printed, run as printed
            assert f"tierswap run --join {address}" in hint
            if secret is not None:
                prefix = "TIERSWAP_SECRET=<the job's secret> "
                assert hint.startswith(prefix), hint
                hint = hint.removeprefix(prefix)
            proc = subprocess.Popen(
                [*joiner, sys.executable, "-m", "tierswap.cli", *shlex.split(hint)[1:]],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=tmp_path,
            )
            deadline = time.monotonic() + 180
            while forks is not None and job.poll() is None and time.monotonic() < deadline:
                forks.append(_forked_workers(proc.pid))  # its agent's pid (execve'd)
                time.sleep(0.2)
            code = job.wait(max(0.1, deadline - time.monotonic()))
            proc.wait(30)
        finally:
            for p in (job, proc):
                if p is not None and p.poll() is None:
                    kill_job(p.pid, run_dir)
                    p.wait()
            if proc is not None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # its workers, if any are left
                except ProcessLookupError:
                    pass
    return code, run_dir, log.read_text()


def _join_hint(log: Path) -> str:
    """The ``tierswap run --join`` command a waiting job printed."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        said = [line for line in log.read_text().splitlines() if "run --join" in line]
        if said:
            return said[-1].split("a host to join: ", 1)[1].strip()
        time.sleep(0.1)
    raise AssertionError("the job did not say how to join it")


def _forked_workers(agent: int) -> int:
    """How many of the processes below ``agent`` are workers forked by a template."""
    try:
        below = psutil.Process(agent).children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    named = 0
    for proc in below:
        with contextlib.suppress(psutil.NoSuchProcess):
            named += proc.name() == "tierswap-worker"
    return named


def test_no_spare_waits_until_a_node_joins(tmp_path: Path, baseline) -> None:
    base = baseline(nodes=2, mode="ddp")
    forks: list[int] = []
    code, run_dir, out = _job_joined_after_a_loss(tmp_path, forks=forks)
    assert code == 0, out
    # the joining host's agent forks its worker from a template of its own
    assert STARTS_ALONE not in out and max(forks, default=0) == 1, (forks, out)
    assert_same_bits(base, final_state(tmp_path, "wait"))
    (assigned,) = events(run_dir, "spare_assigned")
    assert assigned["node"] == 1 and assigned["host"] >= 2


@pytest.fixture
def other_host():
    """A second host on its own network stack: a network namespace joined to this one by
    a veth pair. Yields (namespace, this host's address, the other's)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    tag = f"{os.getpid() % 10000}{random.randrange(100)}"
    ns, here, there = f"tsj{tag}", f"tsja{tag}", f"tsjb{tag}"
    net = f"10.213.{random.randrange(1, 250)}"
    steps = [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", here, "type", "veth", "peer", "name", there, "netns", ns],
        ["ip", "addr", "add", f"{net}.1/24", "dev", here],
        ["ip", "link", "set", here, "up"],
        ["ip", "-n", ns, "addr", "add", f"{net}.2/24", "dev", there],
        ["ip", "-n", ns, "link", "set", there, "up"],
        ["ip", "-n", ns, "link", "set", "lo", "up"],
    ]
    try:
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True)
            if done.returncode != 0:
                pytest.skip(f"cannot make a network namespace: {done.stderr.strip()}")
        yield ns, f"{net}.1", f"{net}.2"
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # takes the veth
        subprocess.run(["ip", "link", "del", here], capture_output=True)


def test_a_host_joins_from_another_network(tmp_path: Path, baseline, other_host) -> None:
    """The job runs on one address; the host that takes the lost node's place lives in
    another network namespace (its own interfaces, only a veth link to the job): its
    agent listens on its own address, its workers meet the survivor over gloo on that
    link, it pulls rank 1 from node 0's memory and replicates back."""
    ns, here, there = other_host
    base = baseline(nodes=2, mode="ddp")
    code, run_dir, out = _job_joined_after_a_loss(
        tmp_path,
        bind=("--bind", here),
        joiner=("ip", "netns", "exec", ns),
        secret="the-secret-this-job-was-started-with",  # another machine has no join.json
    )
    assert code == 0, out
    assert_same_bits(base, final_state(tmp_path, "wait"))
    (assigned,) = events(run_dir, "spare_assigned")
    assert assigned["node"] == 1
    joined = [e for e in events(run_dir, "node_joined") if e["host"] == assigned["host"]]
    assert joined and joined[0]["address"] == there, joined
    assert {int(r): t for r, t in events(run_dir, "restored")[-1]["tiers"].items()} == {0: 0, 1: 1}
    restored_at = events(run_dir, "restored")[-1]["time"]
    assert any(
        e["tier"] == 1 and e["time"] > restored_at for e in events(run_dir, "snapshot_committed")
    ), "replication goes both ways over the link"
