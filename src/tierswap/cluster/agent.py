"""The per-node agent process: the shell around ``control/agent.py``'s core.

It owns what the core may not: the coordinator's connection, the workers' connections and
processes, the replica server, and the pools that checksum slots, send replicas and write
tier-2 parts. One loop reads a queue that all of them feed, hands each event to the core,
and carries out the commands it returns, so the node's state has a single writer.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierswap.affinity import parse_cpus, pin_process, worker_cpus
from tierswap.checksum import checksum_chunks
from tierswap.cluster.address import leaving_address, worker_env
from tierswap.cluster.election import POLL_S, wait_for_leader
from tierswap.cluster.multihost import ETCD_ENV, JOIN_CPUS_ENV, KEY_ENV, HostLaunch
from tierswap.cluster.reach import (
    Refused,
    connect,
    fence_on_silence,
    find_leader,
    greet,
    quietly,
)
from tierswap.cluster.replication import Replicator
from tierswap.cluster.template import TEMPLATE_ENV, TEMPLATE_PID_ENV
from tierswap.cluster.workers import Processes, own_template, stop_template, templates
from tierswap.cluster.writer import PartWriter
from tierswap.config import Config
from tierswap.control import protocol as p
from tierswap.control.agent import AgentCore
from tierswap.control.agent_events import (
    AnswerAsk,
    Ask,
    Boot,
    Checked,
    Checksum,
    ConfigureReplication,
    CoordinatorClosed,
    FromCoordinator,
    FromWorker,
    MakeSegment,
    Rejoined,
    Replicate,
    Reply,
    SegmentMade,
    Shutdown,
    Tick,
    ToCoordinator,
    WarmRefused,
    WarmSegments,
    WritePart,
)
from tierswap.control.workers import Kill, Spawn, Tell
from tierswap.handshake import AuthenticationError
from tierswap.serving import reader, serve
from tierswap.shm import Owner, SegmentPool, sweep_dead
from tierswap.tiers.delta_sender import BaseKeeper
from tierswap.tiers.deltas import MEMORY_BASES
from tierswap.tiers.memory import NodeRings
from tierswap.tiers.peer import ReplicaServer
from tierswap.tiers.replicas import PeerStore
from tierswap.wire import Channel, Listener

if TYPE_CHECKING:
    from tierswap.cluster.election import Rendezvous

ASK_LIMIT_S = 120.0
"""How long a replica-server thread waits for the loop to answer it."""


def gpu_count() -> int:
    """The GPUs a worker here may use, without importing torch (seconds of an agent's
    start): ``CUDA_VISIBLE_DEVICES`` where it is set, else the NVIDIA driver's list of
    GPUs; torch is asked only where another driver (ROCm's) is there."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v for v in visible.split(",") if v.strip()]
        return len(ids[: next((i for i, v in enumerate(ids) if v.strip() == "-1"), len(ids))])
    nvidia = Path("/proc/driver/nvidia/gpus")
    if nvidia.is_dir():
        return sum(1 for _ in nvidia.iterdir())
    if not os.path.exists("/dev/kfd"):
        return 0
    import torch

    return torch.cuda.device_count()


class Agent:
    def __init__(
        self,
        host: int,
        coord: Channel,
        secret: bytes,
        cfg: Config,
        run_dir: Path,
        job_id: str,
        script: list[str],
        address: str,
        coord_host: str,
        simulated: bool = False,
        rendezvous: Rendezvous | None = None,
        leader_id: str | None = None,
    ) -> None:
        """``rendezvous``: ``--rdzv-backend etcd``; a coordinator that goes is looked up
        there, and the host rejoins the one that took over (``leader_id`` is the one it
        joined)."""

        self.cfg = cfg
        self.coord = coord
        self.secret = secret
        self.rdzv = rendezvous
        self.leader_id = leader_id
        self._swap = threading.Lock()
        """Guards (coord, leader_id) while a host rejoins a new coordinator."""
        self._swaps = 0
        self.events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.chans: dict[int, Channel] = {}
        """Worker connections by token (the core's ``conn``)."""
        self._tokens = itertools.count(1)
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tierswap-check")
        self.maker = _SlotMaker(self.events.put, self._make_segment)
        """Makes the rings' slots after their first (``MakeSegment``), off the loop."""
        # tier-2 writes get their own threads: a slow disk must not hold up checksums
        self.writer = PartWriter(cfg, self.events.put)
        self.sock = str(run_dir / f"agent-{host}-{os.getpid()}.sock")
        self.listener = Listener(self.sock, secret)
        env = worker_env(address, dict(os.environ, **cfg.to_env()))
        env.update(TIERSWAP_AGENT=self.sock, TIERSWAP_HOST=str(host), **{KEY_ENV: secret.hex()})
        for name in (TEMPLATE_ENV, TEMPLATE_PID_ENV):  # the agent's, not its workers'
            env.pop(name, None)
        self.processes = Processes(script, env, self.events.put, templates(os.environ, secret))
        keeper = None
        if cfg.memory_tiers == "delta":
            keeper = BaseKeeper(cfg.base_every, cfg.delta_threshold)
        base_root = None
        if keeper is not None and cfg.persist is not None:
            base_root = f"{cfg.persist.rstrip('/')}/{MEMORY_BASES}"
        self.replicator = Replicator(
            secret,
            self.events.put,
            cfg.nproc_per_node,
            keeper,
            base_root,
            cfg.world_size,
            announce=self._announce,
            tls=cfg.tls,
            parity=cfg.parity_group > 0,
        )
        self.server = ReplicaServer(address, secret, self._ask, tls=cfg.tls)
        self.segments = SegmentPool(job_id, lambda why: self.events.put(WarmRefused(why)))
        """Where the rings' segments come from: made ahead while this host is a spare."""
        peers = PeerStore(
            job_id,
            cfg.peer_slots,
            cfg.max_peer_memory,
            lambda msg, gen: None,  # the core hands in its own
            cfg.memory_tiers,
            cfg.delta_threshold,
            create=self.segments.create,
        )
        self.core = AgentCore(
            host,
            cfg,
            rings=NodeRings(job_id, cfg.tier0_slots, create=self.segments.create),
            peers=peers,
            replica_address=self.server.address,
            coord_host=coord_host,
            simulated=simulated,
            devices=gpu_count() if simulated else 0,
        )
        self._stop_accepting = serve(
            self.listener, self._on_worker_channel, "tierswap-accept", p.WorkerToAgent
        )
        reader(coord, self._from_coordinator, "tierswap-coord")

    # ---------------------------------------------------------------- feeding the loop

    def _from_coordinator(self, env: p.Envelope[Any] | None) -> None:
        if env is not None:
            self.events.put(FromCoordinator(env))
        elif self.rdzv is None or self.core.exiting:
            self.events.put(CoordinatorClosed())
        else:  # the coordinator's host may be gone: another one takes the job over
            threading.Thread(target=self._rejoin, name="tierswap-rejoin", daemon=True).start()

    def _rejoin(self) -> None:
        """Find the coordinator that took the job over and reconnect to it, as the host
        this one is (its workers keep running meanwhile); give up after
        ``--startup-timeout``, or once the job is over."""
        assert self.rdzv is not None
        old = self.leader_id
        deadline = time.monotonic() + self.cfg.startup_timeout
        print(f"tierswap agent: host {self.core.host} lost its coordinator; looking for the next")
        while True:
            leader = wait_for_leader(self.rdzv, min(deadline, time.monotonic() + 1.0), old)
            if leader is None:
                done = quietly(self.rdzv.done)
                if done is not None:  # the job ended meanwhile: exit as it did
                    self.events.put(FromCoordinator(p.Envelope(-1, p.Exit(code=done["code"]))))
                    return
                # the coordinator records whom it fences before it acts: a host it closed
                # because it declared it lost stops, as it would without etcd
                state = quietly(self.rdzv.state) or {}
                fenced = self.core.host in state.get("fenced", ())
                if fenced or time.monotonic() >= deadline:
                    why = "was declared lost" if fenced else "found no coordinator in time"
                    print(f"tierswap agent: host {self.core.host} {why}: it stops", file=sys.stderr)
                    self.events.put(CoordinatorClosed())
                    return
                continue
            tag = os.environ.get("TIERSWAP_AGENT_TAG", "")
            hello = p.Hello(host=self.core.host, pid=os.getpid(), rejoin=True, tag=tag)
            try:
                address = (str(leader["address"][0]), int(leader["address"][1]))
                chan = Channel.connect(address, self.secret, p.CoordinatorToAgent)
                greet(chan, hello)
            except Refused as e:
                print(f"tierswap agent: {e}", file=sys.stderr)
                self.events.put(CoordinatorClosed())
                return
            except (OSError, AuthenticationError, EOFError):
                if time.monotonic() > deadline:
                    self.events.put(CoordinatorClosed())
                    return
                time.sleep(0.2)  # it may not be listening yet
                continue
            fence_on_silence(chan, self.cfg.lease)
            with self._swap:
                self.coord, self.leader_id = chan, leader["id"]
                self.core.coord_host = str(leader["address"][0])
                self._swaps += 1
            self.events.put(Rejoined())  # say again what the old leader may not have heard
            reader(chan, self._from_coordinator, "tierswap-coord")
            return

    def _watch_leader(self) -> None:
        """A coordinator whose host vanished without a word leaves the connection open
        until TCP gives up (a lease): once etcd names another leader, drop it now."""
        assert self.rdzv is not None
        while True:
            time.sleep(4 * POLL_S)
            swaps = self._swaps
            leader = quietly(self.rdzv.leader)
            with self._swap:  # (a rejoin since the read: the leader read may be stale)
                if swaps == self._swaps and leader and leader.get("id") != self.leader_id:
                    self.coord.close()  # its reader reports the loss: _rejoin follows

    def _on_worker_channel(self, chan: Channel) -> None:
        token = next(self._tokens)
        self.chans[token] = chan

        def deliver(env: p.Envelope[Any] | None) -> None:
            # stamped on arrival: a busy loop must not make a healthy worker look silent
            if env is not None:
                self.events.put(FromWorker(token, env, time.monotonic()))

        reader(chan, deliver, "tierswap-worker")

    def _ask(self, op: str, **fields: Any) -> Any:
        """Run a replica-store operation on the loop (from a server thread)."""
        done: Future[Any] = Future()

        def answer(value: Any, error: BaseException | None) -> None:
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(value)

        self.events.put(Ask(op, fields, answer))
        return done.result(timeout=ASK_LIMIT_S)

    def _announce(self, msg: p.Replicating, generation: int) -> None:
        """From a replication thread: a transfer of ``generation`` starts
        (``during=replication``)."""
        try:
            self.coord.send(msg, generation)
        except OSError:
            pass

    def _beat(self) -> None:
        """The lease with the coordinator: a silent agent is fenced and replaced."""
        while True:
            time.sleep(self.cfg.heartbeat)
            try:
                self.coord.send(p.Beat())
            except OSError:
                if self.rdzv is None:
                    return  # (with etcd, the next coordinator's channel is beaten)

    # ---------------------------------------------------------------- the loop

    def run(self) -> None:
        threading.Thread(target=self._beat, name="tierswap-heartbeat", daemon=True).start()
        if self.rdzv is not None:
            threading.Thread(target=self._watch_leader, name="tierswap-watch", daemon=True).start()
        self.events.put(Boot())
        next_tick = time.monotonic() + self.cfg.heartbeat
        try:
            while True:
                timeout = max(0.0, next_tick - time.monotonic())
                try:
                    event = self.events.get(timeout=timeout)
                except queue.Empty:
                    event = Tick()
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + self.cfg.heartbeat
                    if not isinstance(event, Tick):
                        self.events.put(Tick())
                if not self._carry_out(self.core.handle(event, now)):
                    return
        finally:
            self.shutdown()

    def _carry_out(self, commands: list[Any]) -> bool:
        """Do what the core said; False once it said to shut down."""
        for cmd in commands:
            match cmd:
                case ToCoordinator(msg=msg, gen=gen):
                    try:
                        self.coord.send(msg, gen)
                    except OSError:
                        pass  # its reader reports the loss
                case Reply(conn=conn, msg=msg, gen=gen) | Tell(conn=conn, msg=msg, gen=gen):
                    chan = self.chans.get(conn)
                    if chan is not None:
                        try:
                            chan.send(msg, gen)
                        except OSError:
                            pass  # a worker that died meanwhile is noticed by its watcher
                case Checksum(rank=rank, step=step, slot=slot, layout=layout):
                    self.pool.submit(self._checksum, rank, step, slot, layout)
                case Replicate():
                    self.replicator.submit(cmd)
                case ConfigureReplication():
                    self.replicator.configure(cmd)
                case WritePart(part=part, bases=bases, delay=delay):
                    self.writer.submit(part, bases, delay)
                case AnswerAsk(answer=answer, value=value, error=error):
                    answer(value, error)
                case MakeSegment():
                    self.maker.submit(cmd)
                case WarmSegments(sizes=sizes):
                    self.segments.warm(list(sizes))
                case Spawn(local=local, incarnation=incarnation):
                    self.processes.reap()
                    self.processes.spawn(local, incarnation)
                case Kill(local=local, incarnation=incarnation):
                    self.processes.kill(local, incarnation)
                case Shutdown():
                    return False
        return True

    def _make_segment(self, cmd: MakeSegment) -> SegmentMade:
        try:
            seg = self.segments.create(cmd.name, cmd.nbytes)
        except Exception as e:  # the loop must hear of every slot it waits for
            return SegmentMade(cmd.tier, cmd.rank, cmd.alloc, cmd.index, None, f"{e}")
        return SegmentMade(cmd.tier, cmd.rank, cmd.alloc, cmd.index, seg)

    def _checksum(self, rank: int, step: int, slot: Any, layout: Any) -> None:
        try:
            digest = checksum_chunks(layout.chunks(slot.segment.buf))
        except Exception as e:  # the loop must hear of every checksum it waits for
            self.events.put(Checked(rank, step, slot, "", f"{type(e).__name__}: {e}"))
            return
        self.events.put(Checked(rank, step, slot, digest))

    def shutdown(self) -> None:
        self.processes.close()
        self._stop_accepting()
        self.server.close()
        self.replicator.close()
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.writer.close()
        self.maker.close()
        while True:  # slots made that the loop never took: theirs to unlink, no one else's
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                break
            if isinstance(event, SegmentMade) and event.segment is not None:
                event.segment.unlink()
        self.core.rings.close()
        self.core.peers.close()
        self.segments.close()
        Path(self.sock).unlink(missing_ok=True)


class _SlotMaker:
    """One thread that makes rings' slots, lowest slot index first: every ring's second
    slot (what its next snapshot needs) before any ring's third, so a node of 8 ranks in
    lockstep does not wait for the first rank's whole ring before the last rank's second
    slot. ``close`` drops what is not begun (nothing is made, nothing leaks) and waits for
    the one being made."""

    def __init__(
        self, deliver: Callable[[Any], None], make: Callable[[MakeSegment], SegmentMade]
    ) -> None:
        self._deliver, self._make = deliver, make
        self._jobs: queue.PriorityQueue[tuple[int, int, MakeSegment | None]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._thread = threading.Thread(target=self._run, name="tierswap-slots", daemon=True)
        self._thread.start()

    def submit(self, cmd: MakeSegment) -> None:
        self._jobs.put((cmd.index, next(self._seq), cmd))

    def _run(self) -> None:
        while (cmd := self._jobs.get()[2]) is not None:
            self._deliver(self._make(cmd))

    def close(self) -> None:
        self._jobs.put((-1, -1, None))  # ahead of every slot still queued
        self._thread.join(timeout=60)


def main() -> None:
    env = os.environ
    secret = bytes.fromhex(env[KEY_ENV])
    # SIGTERM (a scheduler ending the job, a container stopping, a candidate stopping its
    # host) and Ctrl-C unwind: the loop's shutdown stops the workers and frees this host's
    # memory, and then the template and folder made here go too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:  # a --join host's closed terminal
        signal.signal(signal.SIGHUP, lambda *_: sys.exit(129))
    temp = own = None
    try:
        if not env.get("TIERSWAP_RUN_DIR"):
            temp = tempfile.mkdtemp(prefix="tierswap-agent-")
        run_dir = Path(temp or env["TIERSWAP_RUN_DIR"])
        own = own_template(run_dir, secret)
        code = _serve(env, secret, run_dir)
    finally:  # a refusal, an error, a SIGTERM: no template or folder of this agent's is left
        for stop in (signal.SIGTERM, signal.SIGHUP):  # and a second one stops no cleanup
            signal.signal(stop, signal.SIG_IGN)
        if own is not None:
            stop_template(*own)
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
    # Everything is released by now (workers killed, segments unlinked); do not wait at exit
    # for a replication thread whose peer is gone.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _sweep() -> int:
    """:func:`~tierswap.shm.sweep_dead`, which never keeps an agent from serving."""
    try:
        return sweep_dead()
    except OSError as e:
        print(f"tierswap: /dev/shm not swept of dead agents' segments: {e}", file=sys.stderr)
        return 0


def own_cpus(job: Config, launch: HostLaunch | None, env: Mapping[str, str]) -> Config:
    """The job's config as this host serves it. CPU numbers are a machine's own: a host of
    a multi-host launch pins its agent and workers by its own launch's ``--agent-cpus``
    and ``--worker-cpus`` (:class:`HostLaunch`), and a host that joined (``--join``) by
    its own (``JOIN_CPUS_ENV``); none given, none pinned. A host this machine simulates
    takes the job's."""
    if launch is not None:
        own = {"agent_cpus": launch.agent_cpus, "worker_cpus": launch.worker_cpus}
    elif JOIN_CPUS_ENV in env:
        own = json.loads(env[JOIN_CPUS_ENV])
    else:
        return job
    return dataclasses.replace(job, agent_cpus=own["agent_cpus"], worker_cpus=own["worker_cpus"])


def _serve(env: Mapping[str, str], secret: bytes, run_dir: Path) -> int:
    """Join the job, serve it as this host's agent until it ends; the exit code."""
    launch = HostLaunch.from_env(env)
    rdzv, leader = (None, None) if ETCD_ENV not in env else find_leader(env)
    if leader is not None:
        coord_host, port = str(leader["address"][0]), str(leader["address"][1])
    else:
        coord_host, port = env["TIERSWAP_COORD"].rsplit(":", 1)
    coord = connect(coord_host, int(port), secret, launch)
    # this host listens where others reach it: its own --bind (a host that joins), else
    # the address its connection to the coordinator leaves from
    address = env.get("TIERSWAP_HOST_ADDRESS") or leaving_address(coord)
    # the coordinator names this host and hands out the job's config and script, so a node
    # that joins later (tierswap run --join) runs exactly what the others run
    spare = env.get("TIERSWAP_SPARE") == "1"  # tierswap run --join
    tag = env.get("TIERSWAP_AGENT_TAG", "")
    hello = p.Hello(host=int(env.get("TIERSWAP_HOST", "-1")), pid=os.getpid(), spare=spare, tag=tag)
    if launch is not None:
        hello = p.Hello(
            host=hello.host,
            pid=hello.pid,
            spare=launch.spare,
            nodes=launch.nnodes,
            nproc_per_node=launch.nproc_per_node,
            job=launch.job,
            tag=tag,
        )
    try:
        w = greet(coord, hello)
    except Refused as e:
        raise SystemExit(f"tierswap run: {e}") from None
    cfg = own_cpus(Config.from_env(w.config), launch, env)
    if cfg.agent_cpus:  # before the agent's threads start: they inherit it
        try:  # the workers' CPUs are this machine's others, found before any pinning
            cfg.worker_cpus = worker_cpus(cfg.agent_cpus, cfg.worker_cpus)
            pin_process(parse_cpus(cfg.agent_cpus), "--agent-cpus")
        except ValueError as e:
            raise SystemExit(f"tierswap run: {e}") from None
    fence_on_silence(coord, cfg.lease)
    if swept := _sweep():
        print(f"tierswap: unlinked {swept} shared-memory segment(s) of tierswap agents "
              "killed on this machine before", file=sys.stderr)  # fmt: skip
    owner = Owner(w.job_id)  # (before any segment of this agent's is made)
    agent = Agent(
        host=w.host,
        coord=coord,
        secret=secret,
        cfg=cfg,
        run_dir=run_dir,
        job_id=w.job_id,
        script=sys.argv[1:] or list(w.script),
        address=address,
        coord_host=coord_host,
        simulated=env.get("TIERSWAP_SIMULATED") == "1",
        rendezvous=rdzv,
        leader_id=None if leader is None else leader["id"],
    )
    try:
        agent.run()
    except KeyboardInterrupt:
        agent.core.exit_code = 130
    except SystemExit as e:
        agent.core.exit_code = int(e.code or 0)
    finally:
        owner.close()  # (its segments are unlinked by now: the run's shutdown)
    if agent.core.coordinator_gone and launch is not None:
        print("tierswap run: the coordinator is gone; this host stops", file=sys.stderr)
    return agent.core.exit_code


if __name__ == "__main__":
    main()
