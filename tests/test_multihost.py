"""A job across hosts, one ``tierswap run --nnodes N --rdzv-endpoint HOST:PORT`` per host,
as with torchrun: who becomes which node, who is refused, what workers are told, and
hot-swap between hosts with network stacks of their own (network namespaces)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from e2e import assert_hot_swapped, assert_same_bits, events, final_state, leaked_segments
from tierswap.bench.netns import Host, Network, Unavailable
from tierswap.cluster import multihost as mh
from tierswap.cluster.agent import own_cpus
from tierswap.cluster.workers import STARTS_ALONE
from tierswap.config import Config
from tierswap.control import protocol as p
from tierswap.control.hosts import Hosts, refusal
from tierswap.errors import UsageError
from tierswap.examples import job_command
from tierswap.shm import remove_job_segments
from tierswap.worker import torchrun_env

SECRET = "a-test-secret-of-the-job-0123456789"
SLOW = ("--sleep", "0.05")
PROBE = """
import json, os, sys
from pathlib import Path

import tierswap
from tierswap.examples import train_gpt

NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
         "MASTER_ADDR", "MASTER_PORT")


def train(job):
    seen = {n: os.environ.get(n) for n in NAMES}
    seen.update(device=str(job.device), local_rank=job.local_rank, node=job.node,
                local_world_size=job.local_world_size, secret="TIERSWAP_SECRET" in os.environ,
                comm=Path("/proc/self/comm").read_text().strip(),
                cpus=sorted(os.sched_getaffinity(0)))
    out = Path(os.environ["PROBE_OUT"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{job.rank}-gen{job.generation}.json").write_text(json.dumps(seen))
    train_gpt.train(job)


if __name__ == "__main__":
    tierswap.launch(train)
"""


# ---------------------------------------------------------------- pure logic


def test_hosts_become_nodes_as_they_join_and_the_rest_park() -> None:
    hosts = Hosts(nodes=2, spares=0)
    assert hosts.connected(1, pid=10, conn=1, now=0) == 1  # --node-rank 1
    assert hosts.connected(-1, pid=11, conn=2, now=0) == 0  # the lowest node unclaimed
    assert hosts.connected(-1, pid=12, conn=3, now=0) == 2  # beyond --nnodes: a spare
    assert hosts.connected(0, pid=13, conn=4, now=0) == 3  # every node is taken: a spare
    assert hosts.connected(-1, pid=14, conn=5, now=0, spare=True) == 4
    for host in range(5):
        hosts.ready(host, ("10.0.0.1", 1000 + host))
    assert hosts.members == {0: 0, 1: 1}
    assert hosts.spares == [2, 3, 4]


def test_a_node_rank_taken_already_gets_the_node_left() -> None:
    """An unpinned host that came first took node 0; the host pinned to node 0 serves
    node 1 instead of parking while node 1 stays without a host."""
    hosts = Hosts(nodes=2, spares=0)
    assert hosts.connected(-1, pid=10, conn=1, now=0) == 0
    assert hosts.connected(0, pid=11, conn=2, now=0) == 1
    assert hosts.connected(0, pid=12, conn=3, now=0) == 2  # all claimed: a spare


def test_a_spare_asked_for_first_takes_no_node() -> None:
    hosts = Hosts(nodes=1, spares=0)
    assert hosts.connected(-1, pid=10, conn=1, now=0, spare=True) == 1
    assert hosts.connected(-1, pid=11, conn=2, now=0) == 0


def test_hosts_started_with_another_line_are_refused() -> None:
    ok = p.Hello(host=-1, pid=1, nodes=2, nproc_per_node=4, job="j1")
    assert refusal(ok, 2, 4, "j1") is None
    shape = refusal(p.Hello(host=-1, pid=1, nodes=3, nproc_per_node=4, job="j1"), 2, 4, "j1")
    assert shape is not None and "--nnodes 3" in shape and "--nnodes 2" in shape
    job = refusal(p.Hello(host=-1, pid=1, nodes=2, nproc_per_node=4, job="j2"), 2, 4, "j1")
    assert job is not None and "--rdzv-id j2" in job and "another job" in job
    joining = p.Hello(host=-1, pid=1, spare=True)  # tierswap run --join says no shape
    assert refusal(joining, 2, 4, "j1") is None


def test_the_secret_comes_from_a_file_or_the_environment_never_short(tmp_path: Path) -> None:
    f = tmp_path / "job.secret"
    f.write_text(SECRET + "\n")
    assert mh.read_secret(str(f), {}, "t") == SECRET
    assert mh.read_secret(None, {"TIERSWAP_SECRET": SECRET}, "t") == SECRET
    with pytest.raises(UsageError, match="--secret-file PATH or set TIERSWAP_SECRET"):
        mh.read_secret(None, {}, "t")
    with pytest.raises(UsageError, match="at least 16"):
        mh.read_secret(None, {"TIERSWAP_SECRET": "short"}, "t")
    with pytest.raises(UsageError, match="cannot read it"):
        mh.read_secret(str(tmp_path / "missing"), {}, "t")
    assert mh.job_key(SECRET) == mh.job_key(SECRET) != mh.job_key(SECRET + "x")
    assert len(mh.job_key(SECRET)) == 32


def test_endpoints() -> None:
    assert mh.parse_endpoint("127.0.0.1:1234") == ("127.0.0.1", 1234)
    assert mh.parse_endpoint("localhost") == ("127.0.0.1", mh.DEFAULT_PORT)
    for bad in ("127.0.0.1:0", "127.0.0.1:x", ":80", "no-such-host.invalid:80"):
        with pytest.raises(UsageError, match="--rdzv-endpoint"):
            mh.parse_endpoint(bad)


def test_workers_get_torchruns_variables() -> None:
    a = p.Assign(
        rank=5,
        local_rank=1,
        local_world_size=4,
        node=1,
        world_size=8,
        store="10.0.0.1:4567",
        backend="gloo",
        inject=[],
        max_redo=1,
        settled=-1,
    )
    assert torchrun_env(a) == {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "4567",
    }


def test_each_host_pins_by_its_own_cpu_lists_not_the_leaders() -> None:
    """CPU numbers are a machine's own: a host of a multi-host launch pins by its launch's
    lists (none given: not pinned), whatever the leader's were; a host that joins by its
    own if it gave any; a simulated host by the job's."""
    job = Config(nodes=2, agent_cpus="3", worker_cpus="0-2")
    launch = mh.HostLaunch(nnodes=2, nproc_per_node=1, agent_cpus="1")
    back = mh.HostLaunch.from_env({mh.LAUNCH_ENV: launch.to_env()})
    assert back == launch
    mine = own_cpus(job, back, {})
    assert (mine.agent_cpus, mine.worker_cpus) == ("1", None)
    assert mine.max_redo == job.max_redo and mine.nodes == job.nodes
    bare = own_cpus(job, mh.HostLaunch(nnodes=2, nproc_per_node=1), {})
    assert (bare.agent_cpus, bare.worker_cpus) == (None, None)
    assert own_cpus(job, None, {}) == job
    joined = {mh.JOIN_CPUS_ENV: json.dumps({"agent_cpus": None, "worker_cpus": "5"})}
    theirs = own_cpus(job, None, joined)
    assert (theirs.agent_cpus, theirs.worker_cpus) == (None, "5")
    none = {mh.JOIN_CPUS_ENV: json.dumps({"agent_cpus": None, "worker_cpus": None})}
    assert own_cpus(job, None, none).agent_cpus is None, "a host that joins without: unpinned"
    older = {"nnodes": 2, "nproc_per_node": 1, "node_rank": None, "spare": False, "job": None}
    was = mh.HostLaunch.from_env({mh.LAUNCH_ENV: json.dumps(older)})
    assert was is not None and was.agent_cpus is None


def test_a_host_that_joins_passes_its_own_cpu_lists_to_its_agent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tierswap import cli

    class Exec(Exception):
        pass

    def execve(path: str, argv: list[str], env: dict[str, str]) -> None:
        raise Exec(env)

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("two CPUs are needed for an agent's and a worker's list")
    monkeypatch.setenv("TIERSWAP_SECRET", SECRET)
    monkeypatch.delenv("TIERSWAP_WORKER_CPUS", raising=False)
    # its environment's, as for every option
    monkeypatch.setenv("TIERSWAP_AGENT_CPUS", str(cpus[1]))
    monkeypatch.setattr(os, "execve", execve)
    with pytest.raises(Exec) as started:
        cli.main(["run", "--join", "127.0.0.1:1", "--worker-cpus", str(cpus[0])])
    (env,) = started.value.args
    mine = {"agent_cpus": str(cpus[1]), "worker_cpus": str(cpus[0])}
    assert json.loads(env[mh.JOIN_CPUS_ENV]) == mine
    monkeypatch.delenv("TIERSWAP_AGENT_CPUS")
    with pytest.raises(Exec) as started:
        cli.main(["run", "--join", "127.0.0.1:1"])
    none = json.loads(started.value.args[0][mh.JOIN_CPUS_ENV])
    assert none == {"agent_cpus": None, "worker_cpus": None}, "none given: not the job's"
    with pytest.raises(SystemExit, match="--join --worker-cpus: CPU list '0-x'"):
        cli.main(["run", "--join", "127.0.0.1:1", "--worker-cpus", "0-x"])
    with pytest.raises(SystemExit, match="--join --agent-cpus 4096: this machine does not"):
        cli.main(["run", "--join", "127.0.0.1:1", "--agent-cpus", "4096"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nnodes", "2", "x.py"], "--nnodes: belongs to a multi-host launch"),
        (["--spare", "x.py"], "--spare: needs --rdzv-endpoint"),
        (["--rdzv-endpoint", "127.0.0.1:1", "x.py"], "give --nnodes N"),
        (["--rdzv-endpoint", "127.0.0.1:1", "--nnodes", "2", "--nodes", "2", "x.py"], "--nodes"),
        (["--rdzv-endpoint", "127.0.0.1:1", "--nnodes", "2", "--node-rank", "2", "x.py"],
         "--node-rank 2: nodes are numbered 0..1"),
        (["--rdzv-endpoint", "127.0.0.1:1", "--nnodes", "2", "x.py"], "the job's secret"),
        (["--rdzv-endpoint", "127.0.0.1:1", "--nnodes", "2", "--spares", "1", "x.py"],
         "--spares with --rdzv-endpoint: a spare is a host of its own here"),
        (["--rdzv-endpoint", "127.0.0.1:1", "--nnodes", "2", "--bind", "127.0.0.1", "x.py"],
         "--rdzv-endpoint and --bind"),
        (["--rdzv-endpoint", "127.0.0.1:1", "--nnodes", "2", "--agent-cpus", "4096", "x.py"],
         "--agent-cpus 4096: this machine does not let the job run on CPUs 4096"),
        (["--nodes", "2", "--worker-cpus", "0,4096", "x.py"],
         "--worker-cpus 0,4096: this machine does not let the job run on CPUs 4096"),
    ],
)  # fmt: skip
def test_bad_launch_lines_are_refused_saying_why(
    args: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    from tierswap import cli

    monkeypatch.delenv("TIERSWAP_SECRET", raising=False)
    with pytest.raises(SystemExit) as done:  # refused before anything starts
        cli.main(["run", *args])
    err = capsys.readouterr().err
    assert done.value.code == 2, err
    assert message in err, err


# ---------------------------------------------------------------- real launches


def _free_port(address: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


class Launches:
    """The ``tierswap run`` of each host of one job; every process they started is killed
    by its id at the end (the launchers' groups, and each agent's)."""

    def __init__(self, tmp: Path, name: str, endpoint: str, script: Path) -> None:
        self.tmp, self.name, self.endpoint, self.script = tmp, name, endpoint, script
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        self.out = tmp / f"{name}-final"

    def start(
        self,
        i: int,
        *run: str,
        host: Host | None = None,
        nproc: int = 1,
        steps: int = 12,
        mode: str = "ddp",
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        run_args = ["--nnodes", "2", "--nproc-per-node", str(nproc)]
        run_args += ["--rdzv-endpoint", self.endpoint, *run]
        cmd = job_command(
            self.run_dir(i),
            run_args,
            ["--steps", str(steps), "--mode", mode, "--out", str(self.out), *SLOW],
            self.script,
        )
        if host is not None:
            cmd = [*host.prefix, *cmd]
        log = self.tmp / f"{self.name}-host{i}.log"
        self.logs.append(log)
        environ = dict(os.environ, TIERSWAP_SECRET=SECRET, PROBE_OUT=str(self.tmp / "probe"))
        with log.open("w") as f:
            proc = subprocess.Popen(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd=self.tmp,
                env=environ if env is None else env,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def run_dir(self, i: int) -> Path:
        return self.tmp / f"{self.name}-host{i}"

    def output(self) -> str:
        return "\n".join(f"== {log.name}\n{log.read_text()}" for log in self.logs if log.exists())

    def wait(self, timeout: float = 180) -> list[int | None]:
        deadline = time.monotonic() + timeout
        codes: list[int | None] = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes

    def close(self) -> None:
        pids = [proc.pid for proc in self.procs]
        coord = self.run_dir(0) / "events.jsonl"
        if coord.exists():
            pids += [e["pid"] for e in events(self.run_dir(0), "node_joined")]
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.procs:
            proc.wait()


@pytest.fixture(autouse=True)
def _no_leaked_memory(tmp_path: Path):
    """Checked before anything is cleaned up for the test: what the jobs left behind.
    (The hosts share this machine's /dev/shm: a killed host's segments are freed by the
    coordinator's end-of-job sweep here, where on a cluster they are its own machine's.)"""
    yield
    leaked = leaked_segments(tmp_path)
    for path in tmp_path.rglob("events.jsonl"):
        for started in events(path.parent, "job_started"):
            remove_job_segments(started["job_id"])
    assert not leaked, f"a job left shared-memory segments behind: {leaked}"


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    return script


def _wait_for(run_dir: Path, kind: str, timeout: float, **fields: Any) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "events.jsonl").exists():
            for e in events(run_dir, kind):
                if all(e.get(k) == v for k, v in fields.items()):
                    return e
        time.sleep(0.1)
    raise AssertionError(f"no {kind} {fields} event within {timeout} s")


def _probes(tmp: Path) -> dict[tuple[int, int], dict[str, Any]]:
    found = {}
    for f in (tmp / "probe").glob("rank*-gen*.json"):
        rank, gen = f.stem.removeprefix("rank").split("-gen")
        found[int(rank), int(gen)] = json.loads(f.read_text())
    return found


def test_hosts_on_one_machine_run_a_job_with_torchruns_names(tmp_path: Path, probe: Path) -> None:
    """Two launchers with the same line on one machine (the endpoint is loopback: the
    first to listen on it runs the coordinator); 2 workers each. A third host started with
    another --nnodes and a fourth with another secret are refused, saying why, and the job
    is not disturbed. Each host's workers count their local ranks from 0, and run on the
    CPUs of their own host's --worker-cpus, not on the coordinator's host's."""
    port = _free_port()
    job = Launches(tmp_path, "hosts", f"127.0.0.1:{port}", probe)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("two CPUs are needed to tell the hosts' --worker-cpus apart")
    try:
        # the coordinator's host pins its launcher and agent too; the other does not
        job.start(0, "--worker-cpus", str(cpus[0]), "--agent-cpus", str(cpus[1]),
                  "--node-rank", "0", nproc=2, steps=6)  # fmt: skip
        _wait_for(job.run_dir(0), "job_started", 60)
        launcher = os.sched_getaffinity(job.procs[0].pid)
        job.start(1, "--worker-cpus", str(cpus[1]), "--node-rank", "1", nproc=2, steps=6)
        wrong = job.start(2, "--nnodes", "3", nproc=2)  # overrides the --nnodes 2 before it
        env = dict(os.environ, TIERSWAP_SECRET=SECRET + "-not")
        stranger = job.start(3, nproc=2, env=env)
        assert stranger.wait(60) != 0
        assert wrong.wait(60) != 0
        codes = job.wait(240)
    finally:
        job.close()
    out = job.output()
    assert codes[:2] == [0, 0], out
    refused = job.logs[2].read_text()
    assert "the coordinator refused this host" in refused, refused
    assert "--nnodes 3" in refused and "--nnodes 2" in refused, refused
    assert "same secret" in job.logs[3].read_text(), job.logs[3].read_text()
    assert SECRET not in out
    assert SECRET not in (job.run_dir(0) / "events.jsonl").read_text()
    (refusal_event,) = events(job.run_dir(0), "host_refused")
    assert "--nnodes 3" in refusal_event["why"]
    joined = {e["node"]: e for e in events(job.run_dir(0), "node_joined")}
    assert sorted(joined) == [0, 1]
    seen = _probes(tmp_path)
    assert sorted(seen) == [(r, 0) for r in range(4)], seen
    store = events(job.run_dir(0), "job_started")[0]
    for rank in range(4):
        env_of = seen[rank, 0]
        assert env_of["RANK"] == str(rank)
        assert env_of["LOCAL_RANK"] == str(rank % 2) and env_of["local_rank"] == rank % 2
        assert env_of["WORLD_SIZE"] == "4" and env_of["LOCAL_WORLD_SIZE"] == "2"
        assert env_of["GROUP_RANK"] == str(rank // 2) and env_of["node"] == rank // 2
        assert env_of["MASTER_ADDR"] == "127.0.0.1" and env_of["MASTER_PORT"] != str(port)
        assert env_of["device"] == "cpu"
        assert env_of["secret"] is False  # the secret text reaches no worker
        # forked from a template: the coordinator's host's launcher's, the other's agent's
        assert env_of["comm"] == "tierswap-worker", (rank, env_of["comm"])
    assert STARTS_ALONE not in out, out
    assert store["nodes"] == 2
    pinned = {n: {tuple(seen[r, 0]["cpus"]) for r in (2 * n, 2 * n + 1)} for n in (0, 1)}
    # each host's two workers (node I is host I: --node-rank) on the CPU its line named
    assert pinned == {0: {(cpus[0],)}, 1: {(cpus[1],)}}, pinned
    assert launcher == {cpus[1]}, "the coordinator runs on its host's --agent-cpus"


def _network(count: int) -> Network:
    try:
        return Network(count)
    except Unavailable as e:
        pytest.skip(str(e))


def _serving(run_dir: Path, node: int) -> dict[str, Any]:
    return next(e for e in events(run_dir, "node_joined") if e["node"] == node)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_host_killed_across_network_stacks_is_hot_swapped(
    tmp_path: Path, baseline, probe: Path, mode: str
) -> None:
    """Three hosts, each its own network stack: the coordinator's host serves node 0,
    another serves node 1, a third parks as a spare. Every process of node 1's host is
    killed; the spare takes node 1 over the network, the survivor keeps its processes,
    and the job ends bit for bit as an uninterrupted one."""
    base = baseline(nodes=2, mode=mode)
    with _network(3) as (a, b, c):
        job = Launches(tmp_path, "ns", f"{a.address}:29400", probe)
        try:
            job.start(0, "--node-rank", "0", host=a, mode=mode)
            job.start(1, "--node-rank", "1", host=b, mode=mode)
            job.start(2, "--spare", host=c, mode=mode)
            run_dir = job.run_dir(0)
            _wait_for(run_dir, "snapshot_committed", 120, tier=1, step=3)
            survivor = _serving(run_dir, 0)
            assert _serving(run_dir, 1)["address"] == b.address
            killed = b.kill_all()
            assert killed
            codes = job.wait(240)
        finally:
            job.close()
        out = job.output()
        assert codes[0] == 0 and codes[2] == 0, out
        assert not b.pids()
    assert_same_bits(base, final_state(tmp_path, "ns"))
    (assigned,) = events(run_dir, "spare_assigned")
    assert assigned["node"] == 1
    assert _serving_host(run_dir, assigned["host"])["address"] == c.address
    assert survivor["pid"] not in killed
    (detected,) = events(run_dir, "failure_detected")
    assert detected["node"] == 1
    assert_hot_swapped(run_dir, survivors=[0], replaced=[1])
    seen = _probes(tmp_path)
    assert seen[1, 1]["GROUP_RANK"] == "1" and seen[1, 1]["MASTER_ADDR"] == a.address


def _serving_host(run_dir: Path, host: int) -> dict[str, Any]:
    return next(e for e in events(run_dir, "node_joined") if e["host"] == host)


def test_a_host_cut_off_is_fenced_and_the_job_goes_on(tmp_path: Path, baseline, probe) -> None:
    """Node 1's link goes down (``ip link set ... down``): nothing closes, it only goes
    silent. Its lease expires, it is declared lost and fenced; the spare takes its node;
    the cut host stops by itself (its heartbeats go unanswered); nothing it held is
    committed afterwards, and the job ends bit for bit as an uninterrupted one."""
    base = baseline(nodes=2, mode="ddp")
    lease = ("--heartbeat", "0.5", "--lease", "2", "--collective-timeout", "4")
    with _network(3) as (a, b, c):
        job = Launches(tmp_path, "cut", f"{a.address}:29400", probe)
        try:
            job.start(0, "--node-rank", "0", *lease, host=a)
            cut = job.start(1, "--node-rank", "1", *lease, host=b)
            job.start(2, "--spare", *lease, host=c)
            run_dir = job.run_dir(0)
            _wait_for(run_dir, "snapshot_committed", 120, tier=1, step=3)
            b.cut()
            cut_at = time.time()
            codes = job.wait(240)
            assert cut.wait(30) != 0  # the cut host gave up by itself
        finally:
            job.close()
        out = job.output()
        assert codes[0] == 0 and codes[2] == 0, out
    assert "the coordinator is gone" in job.logs[1].read_text(), job.logs[1].read_text()
    assert_same_bits(base, final_state(tmp_path, "cut"))
    assert_hot_swapped(run_dir, survivors=[0], replaced=[1])
    (detected,) = events(run_dir, "failure_detected")
    assert detected["node"] == 1 and "lease expired" in detected["detail"], detected
    assert detected["time"] - cut_at < 2 + 2.5, detected  # a lease, and a tick or two
    (assigned,) = events(run_dir, "spare_assigned")
    assert assigned["node"] == 1


# ---------------------------------------------------------------- taking over (etcd), pure


def _core(nodes: int = 2) -> Any:
    from tierswap.config import Config
    from tierswap.control.coordinator import CoordinatorCore

    cfg = Config(nodes=nodes)
    return CoordinatorCore(
        cfg, job_id="j", script=["x.py"], address=("h", 1), store="h:2", tier2=None, now=0.0,
        multihost=True,
    )  # fmt: skip


def _hello(core: Any, conn: int, now: float, **fields: Any) -> list[Any]:
    from tierswap.control import commands as cc

    return core.handle(cc.AgentMessage(conn, p.Envelope(-1, p.Hello(**fields)), now), now)


def _started_job() -> dict[str, Any]:
    """The record of a leader whose job runs: hosts 0 and 1 serve, host 2 is a spare."""
    from tierswap.control import commands as cc

    old = _core()
    old.handle(cc.Begin(), 0.0)
    for host, spare in ((0, False), (1, False), (2, True)):
        _hello(old, host + 1, 0.1, host=-1, pid=50 + host, tag=f"t{host}", spare=spare)
    for host in range(3):
        ready = p.Ready(replica=("h", 100 + host), workers=[])
        old.handle(cc.AgentMessage(host + 1, p.Envelope(-1, ready), 0.2), 0.2)
    assert old.generation == 0 and old.hosts.members == {0: 0, 1: 1}
    return old.record()


def test_a_new_leader_takes_back_the_hosts_it_had_and_ends_their_generation() -> None:
    from tierswap.control import commands as cc

    record = json.loads(json.dumps(_started_job()))  # as it comes back from etcd
    core = _core()
    out = core.handle(cc.TakeOver(record, old_host=0), 1.0)
    assert any(isinstance(c, cc.Log) and c.event == "coordinator_took_over" for c in out)
    refused = _hello(core, 11, 1.1, host=1, pid=51, tag="other", rejoin=True)
    assert any(isinstance(c, cc.Send) and isinstance(c.msg, p.Refused) for c in refused)
    back = _hello(core, 12, 1.2, host=1, pid=51, tag="t1", rejoin=True)
    assert any(isinstance(c, cc.Send) and isinstance(c.msg, p.Welcome) for c in back)
    _hello(core, 13, 1.3, host=2, pid=52, tag="t2", rejoin=True)
    # all but the old leader's own host are back: it gets OLD_HOST_GRACE_S more
    assert core.expected == {0}
    out = core.handle(cc.Tick({}), 1.3 + 0.6)
    stops = [c for c in out if isinstance(c, cc.Broadcast) and isinstance(c.msg, p.Stop)]
    assert stops and stops[0].gen == 0, "the old generation is stopped"
    # node 0's loss names its rank; what the old leader lost cannot be told: every rank
    assert [c.msg for c in stops] == [p.Stop(verify=[0]), p.Stop(verify=None)]
    assert core.expected is None and core.hosts.vacant == {0} and 0 in core.hosts.fenced
    late = _hello(core, 14, 2.5, host=0, pid=50, tag="t0", rejoin=True)
    assert any(isinstance(c, cc.Send) and isinstance(c.msg, p.Refused) for c in late)


def test_a_new_leader_with_every_host_back_has_every_replica_read_again() -> None:
    """It cannot tell what its predecessor may have lost (a node recorded vacant whose
    stop never went out): the stop that ends the old generation names no ranks, so every
    node reads every replica it holds before it reports."""
    from tierswap.control import commands as cc

    core = _core()
    core.handle(cc.TakeOver(json.loads(json.dumps(_started_job())), old_host=None), 1.0)
    out: list[Any] = []
    for conn, host in ((11, 0), (12, 1), (13, 2)):
        out += _hello(core, conn, 1.1, host=host, pid=50 + host, tag=f"t{host}", rejoin=True)
    stops = [c.msg for c in out if isinstance(c, cc.Broadcast) and isinstance(c.msg, p.Stop)]
    assert stops == [p.Stop(verify=None)]


def test_a_host_lost_while_a_new_leader_awaits_the_others_has_every_node_stopped_again() -> None:
    """Host 0 is lost while the spare is still awaited: the stop that followed reached
    host 1 only, and reports are not taken during the wait; once the spare is back every
    node is stopped again and the next generation starts on their reports."""
    from tierswap.control import commands as cc

    core = _core()
    core.handle(cc.TakeOver(json.loads(json.dumps(_started_job())), old_host=None), 1.0)
    _hello(core, 11, 1.1, host=0, pid=50, tag="t0", rejoin=True)
    _hello(core, 12, 1.1, host=1, pid=51, tag="t1", rejoin=True)
    core.handle(cc.AgentClosed(11), 1.2)  # host 0 lost while host 2 (the spare) is awaited
    report = p.Stopped(holdings={}, peer={}, peer_deltas={}, verified=[0])
    core.handle(cc.AgentMessage(12, p.Envelope(0, report), 1.25), 1.25)  # not taken: awaited
    out = _hello(core, 13, 1.3, host=2, pid=52, tag="t2", rejoin=True)
    stops = [c.msg for c in out if isinstance(c, cc.Broadcast) and isinstance(c.msg, p.Stop)]
    assert stops == [p.Stop(verify=None)] and core.stopping == {1}
    report = p.Stopped(holdings={}, peer={}, peer_deltas={}, verified=None)
    out = core.handle(cc.AgentMessage(12, p.Envelope(0, report), 1.4), 1.4)
    starts = [c for c in out if isinstance(c, cc.Send) and isinstance(c.msg, p.Start)]
    assert core.generation == 1 and sorted(c.conn for c in starts) == [12, 13]


def test_a_takeover_while_hosts_were_starting_waits_for_them_too() -> None:
    from tierswap.control import commands as cc

    old = _core()
    old.handle(cc.Begin(), 0.0)
    _hello(old, 1, 0.1, host=-1, pid=50, tag="t0")  # said hello, not ready yet
    record = old.record()
    core = _core()
    core.handle(cc.TakeOver(record, old_host=None), 1.0)
    assert core.expected == {0}
    _hello(core, 5, 1.1, host=0, pid=50, tag="t0", rejoin=True)
    ready = p.Ready(replica=("h", 100), workers=[])
    core.handle(cc.AgentMessage(5, p.Envelope(-1, ready), 1.2), 1.2)
    _hello(core, 6, 1.3, host=-1, pid=51, tag="t1")  # the second host, for the first time
    out = core.handle(cc.AgentMessage(6, p.Envelope(-1, ready), 1.4), 1.4)
    assert core.generation == 0 and core.hosts.members == {0: 0, 1: 1}, out


def test_a_ready_said_again_during_a_takeover_starts_nothing_early() -> None:
    """The old leader died while its job was starting (host 0 ready, host 1 not yet):
    host 1's ready, said again on its rejoin, waits until host 0 is back too."""
    from tierswap.control import commands as cc

    old = _core()
    old.handle(cc.Begin(), 0.0)
    _hello(old, 1, 0.1, host=-1, pid=50, tag="t0")
    _hello(old, 2, 0.1, host=-1, pid=51, tag="t1")
    ready = p.Ready(replica=("h", 100), workers=[])
    old.handle(cc.AgentMessage(1, p.Envelope(-1, ready), 0.2), 0.2)
    core = _core()
    core.handle(cc.TakeOver(json.loads(json.dumps(old.record())), old_host=None), 1.0)
    _hello(core, 6, 1.1, host=1, pid=51, tag="t1", rejoin=True)
    out = core.handle(cc.AgentMessage(6, p.Envelope(-1, ready), 1.2), 1.2)
    assert core.generation == -1 and not any(isinstance(c, cc.Send) for c in out)
    out = _hello(core, 5, 1.3, host=0, pid=50, tag="t0", rejoin=True)
    starts = [c for c in out if isinstance(c, cc.Send) and isinstance(c.msg, p.Start)]
    assert core.generation == 0 and sorted(c.conn for c in starts) == [5, 6]


def test_a_host_started_before_etcd_waits_for_it_up_to_the_startup_timeout() -> None:
    """Pods may start before etcd: a host waits for it, then says which option ran out."""
    import socket
    import threading

    from tierswap.cluster.candidate import address_towards
    from tierswap.errors import UsageError

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(UsageError, match=r"etcd does not answer .*--startup-timeout"):
        address_towards(("127.0.0.1", port), wait=0.3)
    late = socket.socket()
    try:
        threading.Timer(0.5, lambda: (late.bind(("127.0.0.1", port)), late.listen())).start()
        assert address_towards(("127.0.0.1", port), wait=10) == "127.0.0.1"
    finally:
        late.close()
