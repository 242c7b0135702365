"""The coordinator process: the shell around ``control/coordinator.py``'s core.

It runs in the launcher. It owns the listener agents connect to, the store workers
rendezvous on (``store.py``, behind the job's secret; each generation uses the prefix
``gen<g>/``), the simulated hosts' agent
processes, the event log and the console. One reader thread per agent connection feeds a
queue; one loop hands each event to the core and carries out what it returns, so the
job's state has a single writer.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import shlex
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierswap.cluster.launch import LocalNodes, check_durable, check_init_from, new_job_id
from tierswap.cluster.multihost import HostLaunch, agent_env
from tierswap.config import Config
from tierswap.control import protocol as p
from tierswap.control.commands import (
    AgentClosed,
    AgentMessage,
    Begin,
    Broadcast,
    Close,
    Drain,
    DurableLost,
    End,
    FreeSegments,
    FreezeHost,
    HostExited,
    KillHost,
    KillProcess,
    Log,
    Say,
    Send,
    ShowProgress,
    StartHost,
    TakeOver,
    Tick,
)
from tierswap.control.coordinator import CoordinatorCore
from tierswap.control.ports import DurableRoot, FencedRoot
from tierswap.errors import Deposed, UsageError
from tierswap.events import EventLog, Progress
from tierswap.keystore import StoreServer
from tierswap.serving import reader, serve
from tierswap.shm import remove_job_segments
from tierswap.tiers.ownership import LEASE_S, RootClaim
from tierswap.wire import Channel, Listener

if TYPE_CHECKING:
    from tierswap.cluster.election import Rendezvous


SIGNAL_EXITS = {143: "SIGTERM", 129: "SIGHUP"}
"""The exit codes cli.py turns those signals into, by name."""
SIGNAL_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
"""A job a signal stopped exits with 128 + its number, as a shell reports it."""
STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Signals that stop the job: ignored while it stops, so a second one cuts nothing short."""


def make_run_dir(run_dir: Path) -> None:
    """Make the job's folder (``--run-dir``) and check that this user can write in it; a
    ``UsageError`` naming the folder and the OS's reason where not, before anything runs."""
    doing = "made"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        doing = "written"
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=run_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        why = e.strerror or str(e)
        if isinstance(e, FileExistsError):
            why = "a file of that name is there, not a folder"
        raise UsageError(
            f"--run-dir {str(run_dir)!r}: the job's folder cannot be {doing} there ({why}): "
            "give a folder this user can write, or leave --run-dir out (the job then makes "
            "runs/<time>-<pid> in the current folder)"
        ) from None


def join_hint(address: tuple[str, int], run_dir: Path, multihost: bool) -> str:
    """The command that adds a host to this job, whole: with the job's key, which a host
    finds in ``TIERSWAP_SECRET`` where the job was started with a secret (on every host of a
    multi-host launch), else in the job's ``--run-dir`` on this machine (``join.json``)."""
    join = f"tierswap run --join {address[0]}:{address[1]}"
    if multihost or os.environ.get("TIERSWAP_SECRET"):
        return f"TIERSWAP_SECRET=<the job's secret> {join}"
    return f"{join} --run-dir {shlex.quote(str(run_dir.resolve()))}"


class Coordinator:
    def __init__(
        self,
        cfg: Config,
        script: list[str],
        run_dir: Path,
        *,
        hosts: HostLaunch | None = None,
        key: bytes | None = None,
        listener: Listener | None = None,
        leader: Rendezvous | None = None,
        takeover: TakeOver | None = None,
        own_agent: tuple[subprocess.Popen[bytes], str] | None = None,
    ) -> None:
        """``hosts``: a multi-host launch, whose coordinator listens on the endpoint
        (``listener``, keyed with the job's ``key``) and starts one agent for this host as
        asked (``hosts``); None simulates ``cfg.nodes`` hosts on this machine.
        ``leader``: ``--rdzv-backend etcd``, this coordinator leads while its etcd key
        holds, writes its state there before acting, and ``takeover`` (the state another
        leader wrote) is the job it continues; its host's agent runs already
        (``own_agent``)."""
        self.cfg = cfg
        self.run_dir = run_dir
        make_run_dir(run_dir)
        self.fence = leader
        self.takeover = takeover
        self._recorded: dict[str, Any] | None = None
        self.deposed = False
        self.finished = False
        """The job's end is written to etcd (``done``)."""
        self.job_id = new_job_id() if takeover is None else str(takeover.record["job_id"])
        self.secret = key or os.urandom(32)
        self.launch = hosts
        self.log = EventLog(run_dir / "events.jsonl")
        self.progress = Progress(cfg.console)
        # agents (including hosts that join later) and workers reach both on --bind
        self.listener = listener or Listener((cfg.bind, 0), self.secret)
        self._stop_accepting: Callable[[], None] = self.listener.close
        self._closing = False
        """Set once the job is closing: a signal then changes nothing."""
        self._outer: dict[int, Any] = {}
        """The launcher's handlers of the signals this coordinator drains on."""
        self.store = StoreServer(cfg.bind, self.secret)
        self.nodes = LocalNodes(cfg, script, run_dir, self.job_id, self.secret)
        if own_agent is not None:
            self.nodes.adopt(*own_agent)
        holder = None if takeover is None else takeover.record.get("claim")
        self.claim = (
            None
            if cfg.persist is None
            else RootClaim(cfg.persist, cfg.job_name, cfg.take_over_root, holder=holder)
        )
        """This launch's lease on the durable root: one job per root."""
        self._renewal_failing = False
        """Renewals of the lease fail (logged once a streak)."""
        self._renewed_at = time.monotonic()
        """When the lease was last written: once it has lapsed (``LEASE_S``) the root may be
        another job's, and tier 2 is given up."""
        self.events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.chans: dict[int, Channel] = {}
        self._freeing: list[threading.Thread] = []
        """Threads unlinking a lost host's segments (joined before the job's are swept)."""
        self.arrived: dict[int, float] = {}
        """connection -> when its newest message arrived (set by its reader thread)."""
        self._tokens = itertools.count(1)
        self.core = CoordinatorCore(
            cfg,
            job_id=self.job_id,
            script=script,
            address=self.address,
            store=f"{cfg.bind}:{self.store.address[1]}",
            tier2=None
            if cfg.persist is None or self.claim is None
            else DurableRoot(cfg.persist, self.claim.job)
            if leader is None
            else FencedRoot(cfg.persist, self.claim.job, leader.confirm),
            now=time.monotonic(),
            multihost=hosts is not None,
            rdzv_id=None if hosts is None else hosts.job,
        )
        self.core.join_hint = join_hint(self.address, run_dir, hosts is not None)
        self.code: int | None = None

    @property
    def address(self) -> tuple[str, int]:
        return self.listener.tcp_address

    # ---------------------------------------------------------------- main loop

    def run(self) -> int:
        """Run the job to its end; 0 when it finished, 1 when it stopped for good."""
        warning, self.core.reshard = check_durable(self.cfg)
        if self.cfg.init_from is not None and self.cfg.persist is None:
            check_init_from(self.cfg)
        if self.claim is not None and warning is None:
            self.claim.acquire()  # RootInUseError names the job that holds the root
            self._renewed_at = time.monotonic()
        next_renewal = time.monotonic() + LEASE_S / 3
        self._stop_accepting = serve(
            self.listener, self._on_channel, "tierswap-coord-accept", p.AgentToCoordinator
        )
        self._write_join_ticket()
        if self.launch is not None and not self.nodes.own:  # this host serves a node too
            env = agent_env(os.environ, self.address, self.secret, self.launch, self.run_dir)
            self.nodes.start_agent(
                dict(env, TIERSWAP_STARTUP_TIMEOUT=str(self.cfg.startup_timeout))
            )
        tick = min(0.5, self.cfg.heartbeat / 2)
        self._drain_on_signals()
        try:
            self._step(Begin(warning) if self.takeover is None else self.takeover, time.monotonic())
            next_tick = time.monotonic() + tick
            while self.code is None:
                try:
                    event = self.events.get(timeout=max(0.0, next_tick - time.monotonic()))
                except queue.Empty:
                    event = Tick()
                now = time.monotonic()
                if now >= next_tick:
                    # what arrived before the tick is handled first: a host's lost
                    # connection waiting in the queue is then seen before the tick acts
                    # on the time that passed (a replica cut off is given up on one)
                    if not isinstance(event, Tick):
                        self._step(event, now)
                        event = Tick()
                    self._drain(self.events.qsize())
                    if self.code is not None:
                        break
                    now = time.monotonic()
                    next_tick = now + tick
                    self._step(Tick(dict(self.arrived)), now)
                    self._check_hosts(now)
                    if self.claim is not None and now >= next_renewal:
                        next_renewal = now + LEASE_S / 3
                        self._renew(now)
                    if isinstance(event, Tick):
                        continue
                self._step(event, now)
            self._closing = True  # (a signal now changes nothing)
            if self.core.drained and self.core.draining is not None:  # stopped by a signal
                self._interrupted(self.core.draining.signal)
            return self.code
        except Deposed as e:  # another coordinator leads: act no further, say so, go
            self._closing = True
            self.deposed = True
            self.log.emit("coordinator_deposed", reason=str(e))
            self.progress.message(
                f"this coordinator no longer leads the job ({e}); this host goes on as one "
                "of its hosts"
            )
            # a signal that was stopping the job stops this host too
            return 1 if self.core.draining is None else self.core.draining.code
        except KeyboardInterrupt:  # Ctrl-C: no traceback, and what a resume would start from
            self._interrupted("SIGINT")
            return 130
        except SystemExit as e:  # SIGTERM, SIGHUP (cli.py: SystemExit(143), SystemExit(129))
            if e.code in SIGNAL_EXITS:
                self._interrupted(SIGNAL_EXITS[e.code])
            raise
        finally:
            self._closing = True
            self.shutdown()

    def _drain_on_signals(self) -> None:
        """The first SIGINT, SIGTERM or SIGHUP stops the job once its newest step in
        memory is in tier 2 (the core's ``Drain``, ``--stop-grace``); a second stops it at
        once, as the launcher's own handlers do; once the job is closing, none changes
        anything (``shutdown`` ignores them, and puts the launcher's back where the job
        goes on under another leader). A signal ignored at the start (``nohup``) stays
        ignored."""
        first = True

        def handler(signum: int, _frame: Any) -> None:
            nonlocal first
            sig = signal.Signals(signum)
            name, code = sig.name, SIGNAL_CODES[sig]
            if self._closing:
                return
            if not first:
                if signum == signal.SIGINT:
                    raise KeyboardInterrupt
                raise SystemExit(code)
            first = False
            self.events.put(Drain(name, code))  # (SimpleQueue.put: safe in a handler)

        with contextlib.suppress(ValueError):  # not the main thread: they stay as they are
            for s in STOPPING:
                if signal.getsignal(s) != signal.SIG_IGN:
                    self._outer[s] = signal.signal(s, handler)

    def _step(self, event: Any, now: float) -> None:
        """Hand ``event`` to the core and carry out what it says; with ``--rdzv-backend
        etcd``, once the state it decided on is in etcd (``Deposed`` if this coordinator
        leads no more: then nothing is carried out)."""
        cmds = self.core.handle(event, now)
        if self.fence is not None and cmds:
            self.fence.check()  # a leader paused past its lease finds out here, acting not
            record = self.core.record()
            record["claim"] = None if self.claim is None else self.claim.holder
            record["own"] = sorted(self.nodes.tags)
            if record != self._recorded:
                self.fence.write_state(record)
                self._recorded = record
            if any(isinstance(c, End) for c in cmds):
                code = next(c.code for c in cmds if isinstance(c, End))
                self.fence.finish(code)  # candidates see the job is over: nobody takes over
                self.finished = True
        self._carry_out(cmds)

    def _interrupted(self, signal_name: str) -> None:
        """The job was stopped from outside: log and say the newest step of each tier, and
        how to resume (memory tiers go with the job; tier 2 stays)."""
        durable = self.core.persister.committed
        tier2 = self.core.persister.tier2
        if durable < 0 and tier2 is not None:  # a resumed job: the step it resumed from
            with contextlib.suppress(OSError):
                reshard = self.core.reshard
                durable = max(
                    self.core.durable_steps(), default=-1 if reshard is None else reshard[0]
                )
        tiers = {t: c.committed for t, c in self.core.tiers.items()}
        self.log.emit(
            "job_interrupted",
            signal=signal_name,
            committed=tiers,
            durable_step=durable if durable >= 0 else None,
            root=self.cfg.persist,
        )
        if durable >= 0:
            hint = (
                f"newest durable step {durable} in {self.cfg.persist}; run again with the "
                "same --persist to resume from it"
            )
        elif self.cfg.persist:
            hint = f"no step reached {self.cfg.persist} yet: a new run starts from step 0"
        else:
            hint = "no --persist: nothing outlives the job, a new run starts from step 0"
        self.progress.message(f"interrupted ({signal_name}): {hint}")

    def _renew(self, now: float) -> None:
        assert self.claim is not None
        if self.fence is not None:
            self.fence.check()  # the root's lease is the leader's to renew
        try:
            lost = self.claim.renew()
        except OSError as e:  # a root full, read-only or unreachable for now: tried again
            if not self._renewal_failing:
                self.log.emit("lease_not_renewed", root=self.cfg.persist, error=str(e))
            self._renewal_failing = True
            if now - self._renewed_at < LEASE_S - 1.0:
                return  # the lease written last is still live: the root is still this job's
            lost = (
                f"the lease on {self.cfg.persist} lapsed (not renewed for "
                f"{now - self._renewed_at:.0f} s: {e}); another job may hold the root now"
            )
        else:
            if self._renewal_failing:
                self.log.emit("lease_renewed", root=self.cfg.persist)
            self._renewal_failing = False
            self._renewed_at = now
        if lost is not None:
            self.claim = None  # not ours any more: never released by this job
            self._step(DurableLost(lost), now)

    def _check_hosts(self, now: float) -> None:
        """A simulated host whose agent exited before it said hello."""
        for host, code in self.nodes.exited():
            self._step(HostExited(host, code), now)
        own = self.nodes.own_exited()
        hello = set(self.core.hosts.tags.values())  # every host that ever said hello
        if own is not None and not hello & self.nodes.tags:
            why = (
                f"this host's agent exited with code {own} before it joined the job; its "
                "output above says why"
            )
            self.log.emit("job_failed", reason=why)
            self.progress.message(f"job stopped: {why}")
            self.code = 1

    def _drain(self, count: int) -> None:
        """Handle up to ``count`` events already queued, without waiting for more."""
        for _ in range(count):
            if self.code is not None:
                return
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                return
            self._step(event, time.monotonic())

    def _write_join_ticket(self) -> None:
        """What ``tierswap run --join`` needs, readable by this user only."""
        ticket = self.run_dir / "join.json"
        fd = os.open(ticket, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"address": "{}:{}".format(*self.address), "key": self.secret.hex()}, f)

    def _on_channel(self, chan: Channel) -> None:
        token = next(self._tokens)
        self.chans[token] = chan

        def deliver(env: p.Envelope[Any] | None) -> None:
            if env is None:
                self.events.put(AgentClosed(token))
                return
            at = self.arrived[token] = time.monotonic()  # the lease is timed on arrival
            if not isinstance(env.msg, p.Beat):  # a beat says nothing but that
                self.events.put(AgentMessage(token, env, at))

        reader(chan, deliver, "tierswap-coord-agent")

    def _carry_out(self, commands: list[Any]) -> None:
        for cmd in commands:
            match cmd:
                case Send(conn=conn, msg=msg, gen=gen):
                    self._send(conn, p.Codec.encode(msg, gen))
                case Broadcast(conns=conns, msg=msg, gen=gen):
                    data = p.Codec.encode(msg, gen)
                    for conn in conns:
                        self._send(conn, data)
                case Log(event=event, fields=fields):
                    self.log.emit(event, **fields)
                case Say(text=text):
                    self.progress.message(text)
                case ShowProgress(step=step, loss=loss, stall=stall, committed=committed):
                    self.progress.total = cmd.total
                    self.progress.update(step, loss, stall, committed, cmd.behind)
                case StartHost(host=host):
                    self.nodes.start(host, self.address)
                case KillHost(host=host):
                    self.nodes.kill(host, self.core.hosts.tags.get(host))
                case KillProcess(pid=pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                case FreezeHost(host=host):
                    self.nodes.freeze(host)
                case FreeSegments(pid=pid, tag=tag) if self.nodes.started(tag):
                    self._free_segments(pid)  # another machine's are its own
                case Close(conn=conn):
                    chan = self.chans.pop(conn, None)
                    if chan is not None:
                        chan.close()
                case End(code=code):
                    self.code = code

    def _free_segments(self, pid: int) -> None:
        """Unlink a lost agent's segments on a thread: the kernel frees their pages as it
        goes (0.5 s for the 3 GiB of a 384 MiB-per-rank node here), which the spare's
        assignment must not wait for."""
        self._freeing = [t for t in self._freeing if t.is_alive()]
        t = threading.Thread(
            target=remove_job_segments, args=(self.job_id, pid), name="tierswap-free-segments"
        )
        t.start()
        self._freeing.append(t)

    def _send(self, conn: int, data: bytes) -> None:
        chan = self.chans.get(conn)
        if chan is not None:
            try:
                chan.send_encoded(data)
            except OSError:
                pass  # its reader reports the loss

    def shutdown(self) -> None:
        # a second Ctrl-C (or a SIGTERM) while the job stops must not cut the stop short:
        # agents run in process groups of their own and would be left running
        handlers: list[Any] = []
        with contextlib.suppress(ValueError):  # not the main thread: nothing to defer
            handlers = [self._outer.get(s, signal.getsignal(s)) for s in STOPPING]
            for s in STOPPING:
                signal.signal(s, signal.SIG_IGN)
        if self.fence is not None and not self.deposed and not self.finished:
            try:  # Ctrl-C, SIGTERM, a stop of the shell's own: the job's end, for everyone
                self.fence.finish(1 if self.code is None else self.code)
            except Deposed:
                self.deposed = True  # it found out only now: the job is the new leader's
        if self.deposed:  # the job is the new leader's: its hosts, its lease, its memory
            self._stop_accepting()
            for chan in list(self.chans.values()):
                chan.close()  # agents still here find the new leader (this host's too)
            self.store.close()
            self.log.close()
            if handlers:  # this launcher goes on as a candidate: Ctrl-C and SIGTERM work
                for s, handler in zip(STOPPING, handlers, strict=True):
                    signal.signal(s, handler)
            return
        if self.fence is not None:
            self.fence.resign()
        if self.claim is not None:
            self.claim.release()
        exit_msg = p.Codec.encode(p.Exit(code=1 if self.code is None else self.code), -1)
        for conn in list(self.core.hosts.conns.values()):
            self._send(conn, exit_msg)
        self.nodes.stop_all(told=set(self.core.hosts.conns), own=True)
        self._stop_accepting()
        self.store.close()
        for t in self._freeing:
            t.join()
        n = remove_job_segments(self.job_id)
        if n:
            self.log.emit("memory_released", segments=n)
        self.log.close()
