"""An agent's worker processes: started, watched, killed. Which worker runs which rank,
and when, is the agent's core's (``control/workers.py``); this only holds the processes.

A worker is forked from this machine's worker template (``cluster/template.py``) where
the launcher started one, so that it starts with torch imported; else, or where the
template refuses or is gone, it is a process of its own (``python SCRIPT``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec

from tierswap.affinity import WORKER_ENV, parse_cpus
from tierswap.cluster.address import import_env
from tierswap.cluster.multihost import KEY_ENV
from tierswap.cluster.template import (
    TEMPLATE_ENV,
    TEMPLATE_OFF_ENV,
    TEMPLATE_PARENT_ENV,
    TEMPLATE_PID_ENV,
    start_time,
)
from tierswap.control import protocol as p
from tierswap.control.agent_events import WorkerExited
from tierswap.wire import Channel

STARTS_ALONE = "workers start as processes of their own, not from the worker template"

KILL_WAIT_S = 10.0
"""How long an agent that ends waits for its killed workers, all of them together."""

TEMPLATE_WAIT_S = 120.0
"""How long an agent waits for the template to finish its imports and listen."""


class Processes:
    def __init__(
        self,
        script: list[str],
        env: Mapping[str, str],
        post: Callable[[Any], None],
        template: Templates | None = None,
    ) -> None:
        self.script = script
        self.env = dict(env)
        """The environment of every worker (TIERSWAP_* of the job and of this agent)."""
        self.post = post
        self.template = template
        self.procs: dict[tuple[int, int], subprocess.Popen[bytes] | Forked] = {}
        """(local index, incarnation) -> its process."""

    def spawn(self, local: int, incarnation: int) -> None:
        """Start a worker: it imports the script, attaches and waits for a rank."""
        env = dict(self.env, TIERSWAP_LOCAL=str(local), TIERSWAP_INCARNATION=str(incarnation))
        cpus = env.get(WORKER_ENV)
        if self.template is not None:
            self.procs[(local, incarnation)] = self.template.fork(
                p.Fork(key=-1, argv=list(self.script), env=env, cwd=os.getcwd(),
                       pgid=os.getpgid(0), cpus=sorted(parse_cpus(cpus)) if cpus else []),
                lambda code: self.post(WorkerExited(local, incarnation, code)),
                lambda: self._start(local, incarnation, env),
            )  # fmt: skip
            return
        self.procs[(local, incarnation)] = self._start(local, incarnation, env)

    def _start(self, local: int, incarnation: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
        """A worker as a process of its own."""
        # stdin: nothing (a worker is no terminal's: reading one would stop it, SIGTTIN)
        proc = subprocess.Popen([sys.executable, *self.script], env=env, stdin=subprocess.DEVNULL)
        if cpus := env.get(WORKER_ENV):  # at once, before it imports torch (it pins again)
            with contextlib.suppress(OSError, ValueError):
                os.sched_setaffinity(proc.pid, parse_cpus(cpus))

        def watch() -> None:
            code = proc.wait()
            self.post(WorkerExited(local, incarnation, code))

        threading.Thread(target=watch, name=f"tierswap-watch-{local}", daemon=True).start()
        return proc

    def kill(self, local: int, incarnation: int) -> None:
        proc = self.procs.get((local, incarnation))
        if proc is not None and proc.poll() is None:
            proc.kill()  # its watcher reports the exit

    def reap(self) -> None:
        """Forget processes that have exited."""
        self.procs = {k: p for k, p in self.procs.items() if p.poll() is None}

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        deadline = time.monotonic() + KILL_WAIT_S
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        self.procs.clear()

    def close(self) -> None:
        """Every worker killed (a fork not made yet is never made), the template's
        channel closed."""
        self.kill_all()  # forks' real exits come back while the channel is open
        if self.template is not None:
            self.template.close()


class Forked:
    """A worker forked by the template: what ``subprocess.Popen`` offers of one, for the
    agent (its exit code comes from the template, which is its parent)."""

    def __init__(self, exited: Callable[[int], None], alone: Callable[[], Any]) -> None:
        self.pid: int | None = None
        self.returncode: int | None = None
        self._exited = exited
        self._alone = alone
        """Start it as a process of its own instead (the template refused, or is gone)."""
        self._instead: subprocess.Popen[bytes] | None = None
        self._kill = False
        self._who: tuple[int, int] | None = None
        """The fork's pidfd, else (no pidfds here) -1, and its start time; None once it
        is reaped or was gone before it could be opened."""
        self._lock = threading.Lock()
        self._done = threading.Event()

    def poll(self) -> int | None:
        if self._instead is not None:
            return self._instead.poll()
        return self.returncode

    def kill(self) -> None:
        with self._lock:
            if self._instead is not None:
                self._instead.kill()
            elif self.pid is None:
                self._kill = True  # once it runs
            elif self.returncode is None:
                self._sigkill()

    def wait(self, timeout: float | None = None) -> int | None:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired("forked worker", timeout or 0.0)
        if self._instead is not None:
            return self._instead.wait(timeout)
        return self.returncode

    def forked(self, pid: int, start: int) -> None:
        with self._lock:
            self.pid = pid
            self._who = _pidfd(pid, start)
            if self._kill:
                self._sigkill()

    def _sigkill(self) -> None:
        """SIGKILL to the fork, never to a process that took its pid once it was reaped
        (the template, its parent, reaps it; the agent hears of that later)."""
        if self._who is None or self.pid is None:
            return  # gone
        fd, start = self._who
        with contextlib.suppress(ProcessLookupError):
            if fd >= 0:  # bound to the process, not to its pid
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            elif start_time(self.pid) == start:  # no pidfds: a window of microseconds
                os.kill(self.pid, signal.SIGKILL)

    def reaped(self, code: int) -> None:
        with self._lock:
            self.returncode = code
            if self._who is not None and self._who[0] >= 0:
                os.close(self._who[0])
            self._who = None
        self._done.set()
        self._exited(code)

    def refused(self) -> None:
        """Started as a process of its own instead; it reports its own exit."""
        with self._lock:
            if self._kill:
                self.returncode = -signal.SIGKILL
            else:
                try:
                    self._instead = self._alone()
                except Exception as e:  # no process: the agent hears of it as an exit
                    print(f"tierswap agent: a worker could not start: {e}", file=sys.stderr)
                    self.returncode = 1
                else:
                    self.pid = self._instead.pid
        self._done.set()  # wait() is the process's own from now on
        if self._instead is None:
            self._exited(self.returncode if self.returncode is not None else 1)


class Templates:
    """An agent's channel to its machine's worker template, connected by its own thread
    (the template may still be importing torch): forks asked for meanwhile wait for it."""

    def __init__(self, path: str, secret: bytes, template_pid: int | None) -> None:
        self.path = path
        self.secret = secret
        self.template_pid = template_pid
        self.chan: Channel | None = None
        self.gone = False
        self.closed = False
        self.said = False
        self.waiting: dict[int, Forked] = {}
        self.running: dict[int, Forked] = {}
        self.queued: list[p.Fork] = []
        self.next_key = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="tierswap-template", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """The agent ends: no worker is started any more, alone or forked."""
        with self._lock:
            self.closed = True
            chan = self.chan
        if chan is not None:
            with contextlib.suppress(OSError):
                chan.sock.shutdown(socket.SHUT_RDWR)  # the reader sees the end
        self._thread.join(5.0)

    def fork(self, msg: p.Fork, exited: Callable[[int], None], alone: Callable[[], Any]) -> Forked:
        """Ask for worker ``msg`` (its key is set here); ``exited`` gets its exit code,
        ``alone`` starts it as a process of its own where the template cannot."""
        handle = Forked(exited, alone)
        chan: Channel | None = None
        with self._lock:
            gone = self.gone
            if not gone:
                key = self.next_key
                self.next_key += 1
                self.waiting[key] = handle
                msg = msgspec.structs.replace(msg, key=key)
                chan = self.chan
                if chan is None:
                    self.queued.append(msg)
        if gone:  # outside the lock: it starts a process
            handle.refused()
        elif chan is not None:
            try:
                chan.send(msg)
            except OSError:
                pass  # the reader finds the channel closed and starts the waiting alone
        return handle

    def _connect(self) -> Channel | None:
        deadline = time.monotonic() + TEMPLATE_WAIT_S
        while time.monotonic() < deadline and self._template_lives() and not self.closed:
            try:
                return Channel.connect(self.path, self.secret, p.TemplateToAgent)
            except (FileNotFoundError, ConnectionRefusedError):
                time.sleep(0.02)  # still importing
            except Exception:  # refused, another secret: the workers start alone
                return None
        return None

    def _template_lives(self) -> bool:
        """Whether the template may still come to listen: not once it exited (a zombie
        its launcher has not reaped yet counts as exited)."""
        if self.template_pid is None:
            return True
        try:
            stat = Path(f"/proc/{self.template_pid}/stat").read_bytes()
        except FileNotFoundError:
            return False
        except OSError:
            return True
        return stat.rsplit(b")", 1)[-1].split()[0] not in (b"Z", b"X")

    def _run(self) -> None:
        try:
            chan = self._connect()
            with self._lock:
                if chan is not None and self.closed:
                    chan.close()
                    chan = None
                if chan is not None:
                    self.chan, queued, self.queued = chan, self.queued, []
            if chan is not None:
                try:
                    for msg in queued:
                        chan.send(msg)
                    self._read(chan)
                except (OSError, EOFError, p.ProtocolError):
                    pass
                chan.close()
        finally:  # whatever ended it, no worker waits for a fork that will not come
            self._lost()

    def _say(self, why: str) -> None:
        """Once: workers start as processes of their own (slower, never wrong)."""
        if not self.said:
            self.said = True
            print(f"tierswap agent: {STARTS_ALONE} ({why})", file=sys.stderr, flush=True)

    def _read(self, chan: Channel) -> None:
        while True:
            env = chan.recv()
            assert env is not None
            msg = env.msg
            with self._lock:
                handle = self.waiting.pop(msg.key, None) or self.running.pop(msg.key, None)
                if handle is not None and isinstance(msg, p.Forked):
                    self.running[msg.key] = handle
            if handle is None:
                continue
            match msg:
                case p.Forked(pid=pid, start=start):
                    handle.forked(pid, start)
                case p.ForkRefused(why=why):
                    self._say(why)
                    handle.refused()
                case p.Reaped(code=code):
                    handle.reaped(code)

    def _lost(self) -> None:
        """No template (any more): the workers not yet forked start alone; those it forked
        are killed, their exits unknowable (their parent is gone), reported as SIGKILL."""
        with self._lock:
            self.gone = True
            waiting, self.waiting = self.waiting, {}
            running, self.running = self.running, {}
            closed = self.closed
        if not closed:
            self._say("it is not running")
        for handle in waiting.values():
            if closed:
                handle.kill()  # marked: refused() then starts nothing
            handle.refused()
        for handle in running.values():
            handle.kill()
            handle.reaped(-signal.SIGKILL)


def _pidfd(pid: int, start: int) -> tuple[int, int] | None:
    """A pidfd of process ``pid`` if it still is the one started at ``start`` (a pidfd of
    -1 where the kernel has none), else None: it is gone, its pid perhaps another's."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    except OSError:  # no pidfds (before Linux 5.3), no fds left: the checked pid instead
        fd = -1
    if start_time(pid) != start:  # checked after the open: the fd is of the process seen
        if fd >= 0:
            os.close(fd)
        return None
    return fd, start


def start_template(path: str, secret: bytes, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """Start a worker template that listens at ``path`` for agents holding ``secret``: a
    process group of its own (a signal to its starter's group does not reach it), with
    ``env`` and what a process reads as it starts (``address.import_env``). It ends with
    this process, also one that is gone before the template looked (``TEMPLATE_PARENT_ENV``)."""
    full = import_env(dict(env))
    full.update({TEMPLATE_ENV: path, KEY_ENV: secret.hex(), TEMPLATE_PARENT_ENV: str(os.getpid())})
    cmd = [sys.executable, "-m", "tierswap.cluster.template"]
    return subprocess.Popen(cmd, env=full, process_group=0)


def stop_template(proc: subprocess.Popen[bytes], path: str) -> None:
    """End a template this process started, its forks with it, and remove its socket."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # its group is its own
    proc.wait()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


SOCKET_PATH_MAX = 107
"""Bytes a Unix socket's path may have (Linux's sun_path, less its terminating zero)."""


def own_template(run_dir: Path, secret: bytes) -> tuple[subprocess.Popen[bytes], str] | None:
    """Where no launcher on this machine started a template for this agent (a host of a
    multi-host launch, one that joins, an etcd candidate's agent), the agent starts one of
    its own, first thing, so that its imports overlap the agent's greeting; it points the
    agent at it (``os.environ``). Its socket is in ``run_dir`` (the job's, or the agent's
    own temporary folder) under a name of its own: hosts may share a run folder, and
    their pids may be the same. None where there is one, templates are off, or it cannot
    start (the workers then start alone)."""
    if os.environ.get(TEMPLATE_ENV) or os.environ.get(TEMPLATE_OFF_ENV) == "0":
        return None
    path = str(run_dir / f"template-{secrets.token_hex(4)}.sock")
    try:
        if len(os.fsencode(path)) > SOCKET_PATH_MAX:
            raise OSError(f"{path}: longer than a socket path may be")
        proc = start_template(path, secret, os.environ)
    except OSError as e:
        print(f"tierswap agent: {STARTS_ALONE} (no template: {e})", file=sys.stderr, flush=True)
        return None
    os.environ.update({TEMPLATE_ENV: path, TEMPLATE_PID_ENV: str(proc.pid)})
    return proc, path


def templates(environ: Mapping[str, str], secret: bytes) -> Templates | None:
    """The agent's client of its machine's worker template, where its launcher started one."""
    path = environ.get(TEMPLATE_ENV)
    if not path:
        return None
    pid = environ.get(TEMPLATE_PID_ENV)
    return Templates(path, secret, int(pid) if pid else None)
