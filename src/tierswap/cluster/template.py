"""A machine's worker template: one process that imports torch once and forks every worker
of the machine's agents from itself.

A worker spends seconds of CPU importing torch and the modules a first DDP or FSDP wrap
loads (``worker.WARM_UP``): every worker of every host, every replacement of a dead worker
and every spare. The launcher starts one template per machine; an agent asks it for a
worker (:class:`~tierswap.control.protocol.Fork`) and gets a process whose imports are
done. The fork runs the training script as ``__main__`` with the agent's environment for
it, joins the agent's process group (killing a host still kills its workers), and its exit
is reported to the agent (``Reaped``).

What a fork cannot change must be the workers' already when the template starts: glibc
reads ``GLIBC_TUNABLES`` when a process starts and torch's allocator reads
``THP_MEM_ALLOC_ENABLE`` once, so the launcher gives the template the environment it gives
workers (:func:`tierswap.cluster.address.import_env`). The template never forks with a
second Python thread running or with CUDA initialised (a child would inherit a lock held
by a thread that does not exist, or a CUDA context it cannot use); it refuses instead, and
the agent starts that worker as a process of its own, as it does when there is no
template. Native thread pools that an import starts (OpenBLAS's, with numpy) are not
Python threads: those libraries shut their pools down around a fork themselves, and size
them by the template's CPUs, the machine's, where a worker's own process would have
counted the CPUs it was started on (a worker pinned by ``--worker-cpus`` sets torch's
thread count itself).

Its loop is one thread: the listener, each agent's channel and a SIGCHLD wake-up pipe in
one ``select``. An agent whose channel closes (its host died, or ended) has its workers
that still run killed: a worker never outlives its agent; nor its template (the kernel
kills a fork whose template died, and its agent starts it again alone). The template is a
process group of its own in the launcher's session (a signal to the launcher's group,
Ctrl-C, a ``timeout`` that ends it, does not reach it: the launcher ends it when the job
ends) and ends by itself within ``PARENT_POLL_S`` of its launcher.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import os
import select
import signal
import sys
import threading
import traceback
import types
from importlib.machinery import SourceFileLoader
from pathlib import Path
from typing import NoReturn

from tierswap.control import protocol as p
from tierswap.wire import Channel, Listener

TEMPLATE_ENV = "TIERSWAP_TEMPLATE"
"""The Unix socket of this machine's worker template (set by the launcher for its agents)."""

TEMPLATE_PID_ENV = "TIERSWAP_TEMPLATE_PID"
"""The worker template's process id: an agent waits for its socket only while it lives."""

TEMPLATE_PARENT_ENV = "TIERSWAP_TEMPLATE_PARENT"
"""The pid of the process that started the template: one gone before the template looked
(its parent then another) ends it at once, as one gone later does within ``PARENT_POLL_S``."""

TEMPLATE_OFF_ENV = "TIERSWAP_WORKER_TEMPLATE"
"""``0``: no worker template; every worker is a process of its own (``python SCRIPT``)."""

PRELOAD = ("torch", "torch.distributed", "tierswap.worker", "tierswap.job")
"""What every worker imports; ``worker.WARM_UP`` is imported after these."""

PARENT_POLL_S = 0.2
"""How often the template looks whether its launcher is still there."""

JOIN_THREADS_S = 2.0
"""How long the template waits for a thread of its own (a handshake's watchdog) to end
before a fork; past it the fork is refused."""


class Template:
    """The template's state: its listener, each agent's channel and the workers it forked."""

    def __init__(self, listener: Listener, secret: bytes, parent: int) -> None:
        self.listener = listener
        self.secret = secret
        self.agents: dict[int, Channel] = {}
        """socket fd -> an agent's channel."""
        self.children: dict[int, tuple[int, int]] = {}
        """pid -> (its agent's socket fd, the agent's key for it)."""
        self.parent = parent
        """The launcher, read before the imports: one that died during them is noticed."""
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        self.wake = (wake_r, wake_w)

    def serve(self) -> None:
        """Until the launcher is gone."""
        signal.set_wakeup_fd(self.wake[1])
        signal.signal(signal.SIGCHLD, lambda *_: None)  # the wake-up pipe is what counts
        listening = self.listener.fileno()
        while os.getppid() == self.parent:
            fds = [listening, self.wake[0], *self.agents]
            readable, _, _ = select.select(fds, [], [], PARENT_POLL_S)
            for fd in readable:
                if fd == listening:
                    self._accept()
                elif fd == self.wake[0]:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wake[0], 512)
                elif fd in self.agents:
                    self._from_agent(fd)
            self._reap()
        for pid in self.children:  # the launcher is gone: so is the job
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _accept(self) -> None:
        try:
            sock = self.listener.accept()
            chan = self.listener.handshake(sock, p.AgentToTemplate)
        except (OSError, EOFError):  # not one of the job's agents, or one that died
            return
        self.agents[chan.sock.fileno()] = chan

    def _from_agent(self, fd: int) -> None:
        chan = self.agents[fd]
        try:
            env = chan.recv(0)
        except (OSError, EOFError, p.ProtocolError):
            self._agent_gone(fd)
            return
        if env is None:
            return
        msg = env.msg
        assert isinstance(msg, p.Fork)
        reply: p.Message
        try:
            why = _cannot_fork()
            reply = p.ForkRefused(key=msg.key, why=why) if why else self._fork(fd, msg)
        except OSError as e:
            reply = p.ForkRefused(key=msg.key, why=f"fork failed: {e}")
        with contextlib.suppress(OSError):
            chan.send(reply)

    def _fork(self, fd: int, msg: p.Fork) -> p.Message:
        template = os.getpid()
        pid = os.fork()
        if pid == 0:
            _child(msg, [self.listener, *self.agents.values()], self.wake, template)
        try:  # the child does it too: whichever runs first, neither can run unplaced
            os.setpgid(pid, msg.pgid)
        except OSError as e:
            if os.getpgid(pid) != msg.pgid:  # another session's group: it cannot join
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return p.ForkRefused(key=msg.key, why=f"cannot join process group: {e}")
        start = start_time(pid)  # not reaped yet: it is there, unless /proc is not
        if start is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return p.ForkRefused(key=msg.key, why=f"no start time of process {pid} in /proc")
        self.children[pid] = (fd, msg.key)
        return p.Forked(key=msg.key, pid=pid, start=start)

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            owner = self.children.pop(pid, None)
            if owner is None:
                continue
            fd, key = owner
            chan = self.agents.get(fd)
            if chan is not None:
                with contextlib.suppress(OSError):
                    chan.send(p.Reaped(key=key, code=os.waitstatus_to_exitcode(status)))

    def _agent_gone(self, fd: int) -> None:
        """An agent's channel closed: its workers that still run go with it."""
        chan = self.agents.pop(fd)
        chan.close()
        for pid, (owner, _) in list(self.children.items()):
            if owner == fd:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                self.children[pid] = (-1, -1)  # reaped by _reap, reported to nobody


def start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks after boot (``/proc/PID/stat``'s 22nd
    field), or None where there is no such process: with the pid, which process it is."""
    try:  # bytes: a process's name may be any (it ends at the last ")")
        return int(Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _cannot_fork() -> str:
    """Why a fork now would be unsafe ("" when it is not)."""
    main = threading.main_thread()
    for t in threading.enumerate():  # a handshake's watchdog, cancelled, ends at once
        if t is not main:
            t.join(JOIN_THREADS_S)
    if threading.active_count() > 1:
        return f"threads running in the template: {[t.name for t in threading.enumerate()]}"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised in the template"
    return ""


def _child(
    msg: p.Fork, inherited: list[Listener | Channel], wake: tuple[int, int], template: int
) -> NoReturn:
    """The forked worker: placed, given its environment, runs the script, exits."""
    code = 1
    try:
        os.setpgid(0, msg.pgid)
        _die_with(template)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as python starts
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        for held in inherited:  # the template's sockets are not the worker's
            _close_quietly(held)
        os.close(wake[0])
        os.close(wake[1])
        _no_stdin()
        os.chdir(msg.cwd)
        os.environ.clear()
        os.environ.update(msg.env)
        if msg.cpus:
            os.sched_setaffinity(0, msg.cpus)
        _title(msg.argv)
        code = _run_script(msg.argv)
    except BaseException:
        traceback.print_exc()
    with contextlib.suppress(BaseException):
        sys.stdout.flush()
        sys.stderr.flush()
    if code == INTERRUPTED:  # as python ends on an uncaught KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


INTERRUPTED = -int(signal.SIGINT)
"""``_run_script``'s code for a script ended by an uncaught ``KeyboardInterrupt``."""


def _no_stdin() -> None:
    """A worker reads nothing from stdin, as one started alone (``workers.py``): it is no
    terminal's, and reading one from its agent's background group would stop it."""
    null = os.open(os.devnull, os.O_RDONLY)
    if null != 0:  # 0 was free: it is stdin now
        os.dup2(null, 0)
        os.close(null)


def _die_with(template: int) -> None:
    """A fork dies with the template (the kernel sends it SIGKILL): its agent, told the
    template is gone, starts that worker again as a process of its own."""
    _prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != template:  # the template died before the line above
        os._exit(1)


def _title(argv: list[str]) -> None:
    """The fork's command line becomes the one a worker started alone has (``python
    SCRIPT ARGS``: what ``ps``, ``pgrep -f`` and a cluster's monitoring look for, not the
    template's), and its process name ``tierswap-worker`` (``/proc/PID/comm``, in ``top``
    and ``ps -e``)."""
    import setproctitle  # the template's (main): a fork finds it imported

    try:
        setproctitle.setproctitle(" ".join([sys.executable, *argv]))
    except Exception as e:  # a name it cannot take (a NUL, bytes not UTF-8): keep the old
        print(f"[tierswap] worker's command line left as it was: {e}", file=sys.stderr)
    _prctl(PR_SET_NAME, ctypes.c_char_p(WORKER_NAME))  # after: setproctitle sets it too


def _prctl(option: int, value: int | ctypes.c_char_p) -> None:
    """``prctl(option, value)`` on this process, where libc has it (nothing elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(option, value)


PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
WORKER_NAME = b"tierswap-worker"
"""A fork's process name (``/proc/PID/comm``, 15 bytes at most)."""


def _close_quietly(held: Listener | Channel) -> None:
    if isinstance(held, Listener):
        held.forget()
    else:
        with contextlib.suppress(OSError):
            os.close(held.sock.detach())


def _run_script(argv: list[str]) -> int:
    """``python SCRIPT ARGS...`` in this process: the exit code the interpreter would give,
    after what it does at its end (non-daemon threads joined, with the callbacks that stop
    executors' threads; atexit; the script's objects finalised, open files flushed), with
    the script's module as ``__main__`` throughout, as python has it."""
    script = os.path.abspath(argv[0])
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(script)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=script, __cached__=None, __spec__=None, __package__=None,
                         __loader__=SourceFileLoader("__main__", script))  # fmt: skip
    sys.modules["__main__"] = main
    try:
        with open(script, "rb") as f:
            source = f.read()
        exec(compile(source, script, "exec"), main.__dict__)
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = INTERRUPTED
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    main.__dict__.clear()
    gc.collect()
    return code


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def preload() -> None:
    """Import what every worker imports, the way a worker does (``worker.WARM_UP`` last)."""
    for name in PRELOAD:
        importlib.import_module(name)
    from tierswap.worker import _warm_up

    _warm_up()


def main() -> None:
    import setproctitle

    from tierswap.affinity import machine_cpus
    from tierswap.cluster.multihost import KEY_ENV

    # setproctitle finds the room for a fork's command line (_title) through the
    # environment this process started with: it looks now, before anything changes that
    setproctitle.getproctitle()
    parent = os.getppid()
    starter = os.environ.pop(TEMPLATE_PARENT_ENV, None)
    if starter is not None and int(starter) != parent:  # gone already: so is the job
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
    secret = bytes.fromhex(os.environ.pop(KEY_ENV))
    # a launcher pinned to --agent-cpus started this template: it takes the machine's CPUs
    # back before its imports size their thread pools (each fork is moved to its workers')
    with contextlib.suppress(OSError, ValueError):
        os.sched_setaffinity(0, machine_cpus())
    preload()
    gc.collect()
    gc.freeze()  # shared with every fork, and never written by its collector
    # listening once the imports are done: an agent waits for the socket to appear
    listener = Listener(os.environ[TEMPLATE_ENV], secret)
    try:
        Template(listener, secret, parent).serve()
    finally:
        listener.close()


if __name__ == "__main__":
    main()
