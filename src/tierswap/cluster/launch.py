"""``tierswap run`` on one host: the coordinator plus simulated nodes on loopback.

Each simulated node is an agent process in its own process group with its workers, so
killing the group kills the node as a whole, as a host failure would. The groups are in
the launcher's session, where the machine's worker template (``cluster/template.py``)
forks the agents' workers into them.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from tierswap.cluster.multihost import KEY_ENV, inherited
from tierswap.cluster.template import TEMPLATE_ENV, TEMPLATE_OFF_ENV, TEMPLATE_PID_ENV
from tierswap.cluster.workers import SOCKET_PATH_MAX, start_template, stop_template
from tierswap.config import Config
from tierswap.errors import UsageError
from tierswap.tiers import catalog
from tierswap.tiers.files import url_fs


class LocalNodes:
    """The agent processes of simulated hosts, by host id."""

    def __init__(
        self, cfg: Config, script: list[str], run_dir: Path, job_id: str, secret: bytes
    ) -> None:
        self.cfg = cfg
        self.script = script
        self.run_dir = run_dir
        self.job_id = job_id
        self.secret = secret
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.retired: list[subprocess.Popen[bytes]] = []
        self.own: list[subprocess.Popen[bytes]] = []
        """This machine's agent of a multi-host launch."""
        self.own_reported: set[int] = set()
        self.tags: set[str] = set()
        """The names of the agents this launcher started (``Hello.tag``)."""
        self.reported: set[int] = set()
        self.template: subprocess.Popen[bytes] | None = None
        """This machine's worker template, once an agent was started."""
        self.template_path = str(run_dir / f"template-{os.getpid()}.sock")

    def _template_env(self) -> dict[str, str]:
        """What points an agent at this machine's worker template (started on first need;
        none where ``TIERSWAP_WORKER_TEMPLATE=0``)."""
        if os.environ.get(TEMPLATE_OFF_ENV) == "0":
            return {}
        if self.template is None:
            env = dict(inherited(os.environ), **self.cfg.to_env())
            self.template = start_template(self.template_path, self.secret, env)
        return {TEMPLATE_ENV: self.template_path, TEMPLATE_PID_ENV: str(self.template.pid)}

    def start(self, host: int, coord_address: tuple[str, int]) -> None:
        old = self.procs.pop(host, None)
        if old is not None:
            self.retired.append(old)
        env = inherited(os.environ)  # simulated hosts listen on --bind; the key is enough
        env.update(
            TIERSWAP_COORD=f"{coord_address[0]}:{coord_address[1]}",
            TIERSWAP_AGENT_TAG=self.tag(),
            TIERSWAP_HOST=str(host),
            TIERSWAP_RUN_DIR=str(self.run_dir),
            TIERSWAP_SIMULATED="1",
            **{KEY_ENV: self.secret.hex()},
            **self._template_env(),
        )
        cmd = [sys.executable, "-m", "tierswap.cluster.agent", *self.script]
        self.procs[host] = subprocess.Popen(cmd, env=env, process_group=0)

    def start_agent(self, env: dict[str, str]) -> None:
        """Start this machine's own agent of a multi-host launch (it is one host of the
        job, named by the coordinator when it says hello; its process group is its own, so
        stopping the job stops its workers too)."""
        cmd = [sys.executable, "-m", "tierswap.cluster.agent", *self.script]
        env = dict(env, TIERSWAP_AGENT_TAG=self.tag(), **self._template_env())
        self.own.append(subprocess.Popen(cmd, env=env, process_group=0))

    def adopt(self, proc: subprocess.Popen[bytes], tag: str) -> None:
        """This machine's own agent, started already (``--rdzv-backend etcd``)."""
        self.own.append(proc)
        self.tags.add(tag)

    def tag(self) -> str:
        """A name for an agent this launcher starts (``Hello.tag``)."""
        tag = secrets.token_hex(8)
        self.tags.add(tag)
        return tag

    def is_local(self, host: int) -> bool:
        return host in self.procs

    def kill(self, host: int, tag: str | None = None) -> None:
        """Kill a host this launcher started: a simulated one by its id, this machine's
        own agent of a multi-host launch when ``tag`` is the one it was given."""
        proc = self.procs.get(host)
        if proc is None and tag in self.tags and self.own:
            proc = self.own[0]
        if proc is not None:
            _killpg(proc.pid, signal.SIGKILL)  # also when the agent is gone: workers may live

    def started(self, tag: str) -> bool:
        """Whether this launcher started the agent it gave ``tag`` (on this machine)."""
        return bool(tag) and tag in self.tags

    def own_exited(self) -> int | None:
        """This machine's own agent's exit code, once it exited (reported once)."""
        for proc in self.own:
            code = proc.poll()
            if code is not None and proc.pid not in self.own_reported:
                self.own_reported.add(proc.pid)
                return code
        return None

    def freeze(self, host: int) -> None:
        """SIGSTOP a host's agent and workers: a hung node, for fault injection."""
        proc = self.procs.get(host)
        if proc is not None:
            _killpg(proc.pid, signal.SIGSTOP)

    def exited(self) -> list[tuple[int, int]]:
        """Hosts whose agent process exited since the last call, with the exit code."""
        out = []
        for host, proc in self.procs.items():
            code = proc.poll()
            if code is not None and host not in self.reported:
                self.reported.add(host)
                out.append((host, code))
        return out

    def stop_all(self, told: set[int], timeout: float = 20.0, own: bool = False) -> None:
        """Wait for the agents that were told to exit (host ids in ``told``, and this
        machine's own agent if ``own``) to do so, then kill what is left, groups included;
        a host still starting is killed at once."""
        deadline = time.monotonic() + timeout
        procs = [*self.procs.values(), *self.retired, *self.own]
        waiting = [p for h, p in self.procs.items() if h in told]
        if own:
            waiting += self.own
        for proc in waiting:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in procs:
            _killpg(proc.pid, signal.SIGKILL)  # workers of a SIGKILLed agent may still live
            proc.wait()
        if self.template is not None:
            stop_template(self.template, self.template_path)


def _killpg(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def new_job_id() -> str:
    return secrets.token_hex(4)


def check_socket_folder(folder: Path, what: str) -> None:
    """Refuse a folder too long for the agents' Unix sockets inside it, naming the fix
    (the agent would die at start with "AF_UNIX path too long")."""
    longest = folder / "agent-99999-4194304.sock"  # the largest host index and pid
    n = len(os.fsencode(str(longest)))
    if n > SOCKET_PATH_MAX:
        raise SystemExit(
            f"{what} {str(folder)!r} is too long for the agents' Unix sockets in it ({n} "
            f"bytes of the {SOCKET_PATH_MAX} a socket path may have): give a shorter folder"
        )


def default_run_dir() -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{stamp}-{os.getpid()}"


IN_PROCESS = ("memory", "faulty")
"""fsspec filesystems whose files live in one process."""


def check_shared(url: str) -> None:
    """Refuse a durable root that the job's processes cannot share, or whose filesystem
    is not installed, naming the fix (instead of a traceback, or steps "persisted" to a
    store each process has to itself)."""
    scheme = url.split("://", 1)[0] if "://" in url else "file"
    if scheme in IN_PROCESS:
        raise UsageError(
            f"--persist {url}: a {scheme}:// filesystem lives inside one process, and the "
            "job's agents and workers are other processes (each would see an empty root of "
            "its own, and nothing would be kept): give a path, or a shared store such as "
            "s3://bucket/prefix"
        )
    try:
        url_fs(url)
    except ImportError as e:
        extra = " (pip install 'tierswap[s3]')" if scheme in ("s3", "s3a") else ""
        raise UsageError(f"--persist {url}: {e}{extra}") from None


def check_init_from(cfg: Config) -> None:
    """Refuse an ``--init-from`` that holds no DCP checkpoint here; make its path absolute
    (resolved on the coordinator's host), which every host must then read it at."""
    if cfg.init_from is None:
        return
    given = cfg.init_from
    if "://" in given:
        raise UsageError(
            f"--init-from {given}: give a folder (DCP's FileSystemReader reads local paths); "
            "mount the store, or copy the checkpoint to a shared filesystem"
        )
    cfg.init_from = os.path.abspath(given)
    if not os.path.isfile(os.path.join(cfg.init_from, ".metadata")):
        raise UsageError(
            f"--init-from {given}: no DCP checkpoint there (no .metadata file); give the "
            "folder that dcp.save wrote"
        )


def check_durable(cfg: Config) -> tuple[str | None, tuple[int, int] | None]:
    """A warning for a durable root that cannot be written (the job then trains on memory
    tiers), and ``(step, world size)`` of the newest restorable step written at another
    world size than this job's, if any: the job's steps at this size up to it are
    superseded, and while none newer than it is left the job starts from it, resharded."""
    if cfg.persist is None:
        return None, None
    check_shared(cfg.persist)
    try:
        restorable = [s for s in catalog.list_steps(cfg.persist) if s.restorable]
    except OSError as e:
        return f"cannot list it: {e}", None
    others = [s for s in restorable if s.world_size != cfg.world_size]
    reshard = None
    if others:
        assert others[-1].world_size is not None
        reshard = (others[-1].step, others[-1].world_size)
    if cfg.init_from is not None and not restorable:
        check_init_from(cfg)  # only read where no step of the job is there to resume
    return catalog.probe_writable(cfg.persist), reshard
