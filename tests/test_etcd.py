"""``--rdzv-backend etcd``: a coordinator that survives its host, against a real etcd
server (Debian's ``etcd-server``, which ``make test`` installs), on loopback and in a
network namespace of its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e import assert_same_bits, final_state, leaked_segments
from tierswap.bench.etcdserver import ETCD, Etcd
from tierswap.bench.netns import Host, Network, Unavailable
from tierswap.control.ports import FencedRoot
from tierswap.errors import Deposed
from tierswap.examples import job_command
from tierswap.shm import remove_job_segments
from tierswap.tiers import catalog

pytest.importorskip("etcd3gw", reason="--rdzv-backend etcd needs etcd3gw (the etcd extra)")
pytestmark = pytest.mark.skipif(ETCD is None, reason="no etcd server here (apt etcd-server)")
SECRET = "a-test-secret-of-the-etcd-job-0123456789"


@pytest.fixture
def etcd() -> Iterator[Etcd]:
    server = Etcd("127.0.0.1")
    try:
        server.wait()
        yield server
    finally:
        server.close()


# ---------------------------------------------------------------- the leader's fence


def test_a_deposed_leader_can_change_nothing(etcd: Etcd, tmp_path: Path) -> None:
    """Leader A stalls past its lease (here its lease is revoked, as its expiry would);
    B leads. Whatever A does next fails before it happens: its state is not written, a
    COMMIT it was about to write is not written, and the job's end is not its to say."""
    from tierswap.cluster.election import Rendezvous

    a, b = Rendezvous(etcd.endpoint, "j"), Rendezvous(etcd.endpoint, "j")
    try:
        assert a.campaign({"address": ["10.0.0.1", 1]})
        assert not b.campaign({"address": ["10.0.0.2", 2]})
        a.write_state({"generation": 3})
        assert b.state() == {"generation": 3}
        assert a.lease is not None
        a.lease.revoke()  # A's lease ends while it is paused
        assert b.campaign({"address": ["10.0.0.2", 2]})
        assert b.leader() is not None and b.leader()["id"] == b.id  # type: ignore[index]
        # A, waking up, does not know yet (each time): etcd's compare is what stops it
        a.lost.clear()
        with pytest.raises(Deposed, match="another coordinator leads"):
            a.write_state({"generation": 4})
        assert b.state() == {"generation": 3}
        root = str(tmp_path / "ckpt")
        fenced = FencedRoot(root, "j", a.confirm)
        for act in (lambda: fenced.write_commit(7, 1, {}), lambda: fenced.retain(1),
                    lambda: fenced.discard(7), lambda: a.finish(0)):  # fmt: skip
            a.lost.clear()
            with pytest.raises(Deposed, match="another coordinator leads"):
                act()
        assert not catalog.list_steps(root)
        assert b.done() is None
        b.write_state({"generation": 5})  # the leader's own writes go on
        b.finish(0)
        assert b.done() == {"code": 0} and b.state() is None  # nothing left to take over
    finally:
        a.close()
        b.close()


def test_a_dead_runs_keys_go_with_its_last_host(
    etcd: Etcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every host of a run died: its state stays only while the job's lease lives, and a
    new run under the same id waits for it to go instead of taking the dead run over."""
    from tierswap.cluster import election

    monkeypatch.setattr(election, "JOB_TTL", 2)
    old = election.Rendezvous(etcd.endpoint, "j")
    assert old.campaign({"address": ["10.0.0.1", 1]})
    old.write_state({"generation": 2})
    assert old.lease is not None
    old.close()  # its launcher dies: nobody renews the job's lease any more
    old.lease.revoke()
    new = election.Rendezvous(etcd.endpoint, "j")
    said: list[str] = []
    t0 = time.monotonic()
    election.wait_for_stale_keys(new, said.append)
    assert new.state() is None
    assert said and "lost every host" in said[0]
    assert time.monotonic() - t0 < 2 + 3  # the job's lease, and etcd's expiry tick
    new.close()


# ---------------------------------------------------------------- across hosts


def _launch(host: Host | None, i: int, tmp: Path, etcd: tuple[str, int], *run: str) -> Any:
    """Host ``i``'s ``tierswap run`` (in ``host``'s namespace, or on this one's loopback)."""
    cmd = job_command(
        tmp / f"h{i}",
        ["--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-id", "train",
         "--rdzv-endpoint", f"{etcd[0]}:{etcd[1]}", *run],
        ["--steps", "12", "--mode", "ddp", "--out", str(tmp / "etcd-final"), "--sleep", "0.1"],
    )  # fmt: skip
    log = (tmp / f"h{i}.log").open("w")
    env = dict(os.environ, TIERSWAP_SECRET=SECRET)
    prefix = host.prefix if host else []
    proc = subprocess.Popen(
        [*prefix, *cmd], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp,
        start_new_session=True,
    )  # fmt: skip
    log.close()
    return proc


def _events(tmp: Path) -> list[dict[str, Any]]:
    out = []
    for f in tmp.glob("h*/events.jsonl"):
        out += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return sorted(out, key=lambda e: e["time"])


def _wait(tmp: Path, timeout: float, test: Any) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in _events(tmp):
            if test(e):
                return e
        time.sleep(0.1)
    raise AssertionError(f"no such event within {timeout} s: {_events(tmp)[-5:]}")


def test_the_coordinators_host_killed_another_leads_and_the_job_ends_bit_exact(
    tmp_path: Path, baseline
) -> None:
    """Three hosts, each its own network stack, and etcd on a fourth. A's launcher leads
    (it started first) and serves node 0; B serves node 1; C is a spare. Every process of
    A is killed: within etcd's lease another launcher leads, reads the state back, B and
    C reconnect to it, C takes node 0, and the job ends bit for bit as an uninterrupted
    one, with every host's launcher exiting 0. B and C were launched with another
    ``--max-redo``: whichever leads next runs the job with A's, as its hosts do. B was
    also launched with a CPU list of its own, which A's lacked: it stays B's (its
    launcher, a candidate, is pinned by it) and is not said to be ignored."""
    base = baseline(nodes=2, mode="ddp")
    try:
        net = Network(4)
    except Unavailable as e:
        pytest.skip(str(e))
    with net as (a, b, c, d):
        server = Etcd(d.address, prefix=d.prefix)
        procs = []
        try:
            server.wait(prefix=a.prefix)
            procs.append(_launch(a, 0, tmp_path, server.endpoint, "--node-rank", "0"))
            _wait(tmp_path, 60, lambda e: e["event"] == "job_started")
            # B and C were launched with another --max-redo: the job keeps A's
            other = ("--max-redo", "2")
            cpus = os.sched_getaffinity(0)
            own = ("--agent-cpus", str(max(cpus))) if len(cpus) > 1 else ()  # B's own list
            procs.append(_launch(b, 1, tmp_path, server.endpoint, "--node-rank", "1", *other, *own))
            procs.append(_launch(c, 2, tmp_path, server.endpoint, "--spare", *other))
            _wait(tmp_path, 120, lambda e: e["event"] == "snapshot_committed" and e["step"] >= 4)
            if own:
                assert os.sched_getaffinity(procs[1].pid) == {max(cpus)}, "B's own list"
            killed = a.kill_all()
            killed_at = time.time()
            assert killed
            codes = [proc.wait(180) for proc in procs[1:]]
            procs[0].wait()
        finally:
            for proc in procs:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
            for h in (a, b, c):
                h.kill_all()
            server.close()
        logs = "\n".join((tmp_path / f"h{i}.log").read_text() for i in range(3))
        assert codes == [0, 0], logs
    evs = _events(tmp_path)
    leaked = leaked_segments(tmp_path)
    for e in evs:
        if e["event"] == "job_started":
            remove_job_segments(e["job_id"])
    assert not leaked, leaked
    assert_same_bits(base, final_state(tmp_path, "etcd"))
    (took,) = [e for e in evs if e["event"] == "coordinator_took_over"]
    assert took["old_host"] == 0 and took["time"] - killed_at < 5, took
    assert took["ignored"] == ["max_redo"], "the new leader runs the job's options, not its own"
    (complete,) = [e for e in evs if e["event"] == "takeover_complete"]
    assert complete["missing"] == [0]
    (assigned,) = [e for e in evs if e["event"] == "spare_assigned"]
    assert assigned["node"] == 0 and assigned["host"] == 2
    resumed = [e for e in evs if e["event"] == "resumed" and e["time"] > killed_at]
    assert resumed and resumed[0]["time"] - killed_at < 5, resumed
    assert resumed[0]["redone"] <= 1
    assert any(e["event"] == "job_finished" for e in evs)


def test_a_leader_paused_past_its_lease_is_deposed_and_changes_nothing(
    tmp_path: Path, baseline, etcd: Etcd
) -> None:
    """The leading launcher is SIGSTOPped (its host's agent keeps running) past its etcd
    lease: another launcher takes the job over, the agents (that one included) rejoin
    it, and training goes on. When the old leader runs again it finds itself deposed
    and acts no further: it logs that, writes no step, and its host goes on serving the
    new leader. The job ends bit-exact, and tier 2 verifies."""
    base = baseline(nodes=2, mode="ddp")
    root = tmp_path / "ckpt"
    here = None
    persist = ("--persist", str(root), "--persist-every", "2")
    procs = [_launch(here, 0, tmp_path, etcd.endpoint, "--node-rank", "0", *persist)]
    try:
        _wait(tmp_path, 60, lambda e: e["event"] == "job_started")
        procs.append(_launch(here, 1, tmp_path, etcd.endpoint, "--node-rank", "1", *persist))
        procs.append(_launch(here, 2, tmp_path, etcd.endpoint, "--spare", *persist))
        _wait(tmp_path, 120, lambda e: e["event"] == "snapshot_committed" and e["step"] >= 4)
        os.kill(procs[0].pid, signal.SIGSTOP)  # the coordinator; its host's agent runs on
        took = _wait(tmp_path, 30, lambda e: e["event"] == "coordinator_took_over")
        _wait(tmp_path, 30, lambda e: e["event"] == "resumed" and e["time"] > took["time"])
        os.kill(procs[0].pid, signal.SIGCONT)
        continued_at = time.time()
        codes = [proc.wait(180) for proc in procs]
    finally:
        for proc in procs:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
            proc.wait()
        for e in _events(tmp_path):
            if e["event"] == "node_joined":
                try:
                    os.killpg(e["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
    logs = "\n".join((tmp_path / f"h{i}.log").read_text() for i in range(3))
    # the old leader's host keeps its node if its agent is back within the takeover's
    # wait (0.5 s more than the others), else a spare takes the node and it stops (1)
    assert codes[1:] == [0, 0] and codes[0] in (0, 1), logs
    old = [json.loads(line) for line in (tmp_path / "h0" / "events.jsonl").read_text().splitlines()]
    deposed = [e for e in old if e["event"] == "coordinator_deposed"]
    assert deposed, "the old leader never found out"
    # the stop may have fallen inside a batch of commands, checked before it: that batch
    # ends when the process runs again (at once); nothing is decided after it
    after = [
        e for e in old if e["time"] > continued_at + 0.2 and e["event"] != "coordinator_deposed"
    ]
    assert not after, f"the deposed leader acted: {after[:3]}"
    assert_same_bits(base, final_state(tmp_path, "etcd"))
    check = subprocess.run(
        [*job_command(tmp_path, [], [])[:3], "verify", str(root)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    leaked = leaked_segments(tmp_path)
    for e in _events(tmp_path):
        if e["event"] == "job_started":
            remove_job_segments(e["job_id"])
    assert not leaked, leaked
