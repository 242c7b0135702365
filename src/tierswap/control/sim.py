"""A deterministic simulation of the whole control plane, for tests that generate failures.

The coordinator and every agent run as their real cores (``control/coordinator.py``,
``control/agent.py``) with the real codec between them; workers run as small models of
``worker.py`` and ``job.py`` that speak the same protocol (attach, park, rendezvous,
restore, train with a collective per step, snapshot, finish). Time, the network and
process deaths are a seeded scheduler: every message goes through a link that delivers
in order with a random latency (so messages on different connections are reordered),
a process killed loses what it had not sent and its links close after what it had, and
a chaos plan kills hosts and workers, freezes hosts and cuts links at random moments.
The same seed replays the same run exactly.

The state a worker trains is one integer per rank, updated each step from its own value
and the sum over all ranks (the step's collective), so a restore that mixed steps or
lost one would end with other numbers than a run without failures: the same oracle as
the end-to-end tests, at the cost of microseconds a step.

:meth:`Sim.check` states the invariants; a violation raises :class:`Violation` naming the
seed and the time.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import random
from collections.abc import Callable, Generator, Iterable
from typing import Any

from tierswap.config import Config
from tierswap.control import commands as cc
from tierswap.control import protocol as p
from tierswap.control.coordinator import CoordinatorCore
from tierswap.control.simhost import SimHost
from tierswap.control.simworker import Ask, ProcessDied, SimWorker, Until
from tierswap.control.simworld import (
    FROM_AGENT,
    MASK,
    Chaos,
    FakeTier2,
    MemorySegment,
    Violation,
    reference,
)
from tierswap.control.states import AgentPhase, Phase, WorkerState

__all__ = ["Sim", "spare_of"]


class Sim:
    """The whole job, simulated. ``run()`` until it ends; ``check()`` after every event."""

    def __init__(
        self,
        cfg: Config,
        seed: int,
        steps: int = 10,
        chaos: Chaos | None = None,
        tier2: FakeTier2 | None = None,
        step_time: float = 0.005,
    ) -> None:
        self.cfg = cfg
        self.seed = seed
        self.step_time = step_time
        """Simulated seconds of a training step's compute."""
        self.rng = random.Random(seed)
        self.steps = steps
        self.chaos = chaos or Chaos()
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        """(when, order of scheduling, action): compared as tuples, in C."""
        self._seq = itertools.count()
        self.conns = itertools.count(1)
        self.pids = itertools.count(50_000)
        self.segments: dict[str, MemorySegment] = {}
        self.tier2 = tier2 if tier2 is not None or cfg.persist is None else FakeTier2(cfg.persist)
        self.hosts: dict[int, SimHost] = {}
        self.by_conn: dict[int, SimHost] = {}
        self.log: list[tuple[float, str, dict[str, Any]]] = []
        self.said: list[str] = []
        self.ended: cc.End | None = None
        self.final: dict[int, int] = {}
        self._arrived: dict[int, set[int]] = {}
        self._restored: dict[int, dict[int, int]] = {}
        self._members: dict[int, dict[int, SimWorker]] = {}
        self._contrib: dict[tuple[int, int], dict[int, int]] = {}
        self.training: dict[SimWorker, int] = {}
        """Workers inside a generation (arrived, not parked), by generation."""
        self.committed: dict[int, int] = {0: -1, 1: -1}
        self.events = 0
        self.paused_until = 0.0
        """The coordinator does nothing before this time (``pause_coordinator``)."""
        self.kills: dict[tuple[str, int], int] = {}
        """("rank" or "node", index) -> the step after which it is killed (once)."""
        self.coordinator = CoordinatorCore(
            cfg,
            job_id=f"sim{seed}",
            script=["train.py"],
            address=("sim", 0),
            store="sim:1",
            tier2=self.tier2,
            now=0.0,
        )
        self._coordinate(cc.Begin())
        self._coordinator_tick()
        self._schedule_chaos()

    # ------------------------------------------------------------ scheduling

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (when, next(self._seq), action))

    def after(self, delay: float, action: Callable[[], None]) -> None:
        self.at(self.now + delay, action)

    def latency(self) -> float:
        return self.rng.uniform(0.0001, 0.005)

    def boot_time(self) -> float:
        return self.rng.uniform(0.2, 3.0)  # imports: a worker or agent ready in seconds

    def start(self, alive: Callable[[], bool], coroutine: Generator[Any, Any, Any]) -> None:
        """Run a process's coroutine: it yields delays, ``Ask`` or ``Until``. Once
        ``alive()`` is false it gets ``ProcessDied`` thrown in, to clean up what a real
        peer would see of its death."""

        def step(value: Any = None) -> None:
            try:
                # a process that died gets the answer it was waiting for with the exception,
                # to give back what its peer set aside for it (a slot)
                wait = coroutine.send(value) if alive() else coroutine.throw(ProcessDied(value))
            except (StopIteration, ProcessDied):
                return
            match wait:
                case float() | int():
                    self.after(float(wait), step)
                case Ask(host=peer, op=op, fields=fields):
                    peer.ask(op, fields, step)
                case Until(worker=w, ready=ready):
                    self._until(w, ready, step)
                case _:
                    raise TypeError(f"a simulated process waits on {wait!r}")

        self.after(0.0, step)

    def _until(self, w: SimWorker, ready: Callable[[], bool], go: Callable[[Any], None]) -> None:
        """Resume ``go`` once ``ready()`` holds: re-checked whenever the worker is poked
        (a message for it, a peer arriving at or leaving a generation)."""

        def check() -> None:
            if not w.alive:
                return
            if ready():
                go(None)
            else:
                w.wake = check

        check()

    def run(self, horizon: float = 900.0) -> str:
        """Until the job ends; a job still going at ``horizon`` simulated seconds hangs.
        Returns :meth:`outcome`."""
        self.run_for(horizon - self.now)
        if self.ended is None:
            raise Violation(self._where(f"the job neither finished nor stopped by t={horizon:g} s"))
        return self.outcome()

    def run_for(self, seconds: float) -> None:
        """Every event of the next ``seconds``, each followed by :meth:`check`."""
        until = self.now + seconds
        while self._heap and self.ended is None and self._heap[0][0] <= until:
            self.now, _, action = heapq.heappop(self._heap)
            action()
            self.events += 1
            self.check()
        if self.ended is None:
            self.now = max(self.now, until)

    def _where(self, what: str) -> str:
        return f"seed {self.seed}, t={self.now:.3f} s: {what}"

    # ------------------------------------------------------------ the coordinator

    def _coordinate(self, event: Any) -> None:
        if self.ended is not None:
            return
        if self.now < self.paused_until:  # SIGSTOP of the launcher: it reads on later
            self.at(self.paused_until, lambda: self._coordinate(event))
            return
        for cmd in self.coordinator.handle(event, self.now):
            self._coordinator_does(cmd)

    def _coordinator_tick(self) -> None:
        if self.ended is None:
            self._coordinate(cc.Tick())
            self.after(min(0.5, self.cfg.heartbeat / 2), self._coordinator_tick)

    def coordinator_connected(self, host: SimHost) -> None:
        self.by_conn[host.conn] = host

    def to_coordinator(self, host: SimHost, data: bytes | None) -> None:
        if data is None:
            self._coordinate(cc.AgentClosed(host.conn))
            return
        env = FROM_AGENT.decode(data)
        self._coordinate(cc.AgentMessage(host.conn, env, self.now))

    def _coordinator_does(self, cmd: Any) -> None:
        match cmd:
            case cc.Send(conn=conn, msg=msg, gen=gen):
                self._down(conn, p.Codec.encode(msg, gen))
            case cc.Broadcast(conns=conns, msg=msg, gen=gen):
                data = p.Codec.encode(msg, gen)
                for conn in conns:
                    self._down(conn, data)
            case cc.StartHost(host=host):
                self.after(self.boot_time(), lambda: self._boot(host))
            case cc.KillHost(host=host):
                if host in self.hosts:
                    self.hosts[host].die()
            case cc.KillProcess(pid=pid):
                for sim_host in self.hosts.values():
                    for w in list(sim_host.workers.values()):
                        if w.pid == pid:
                            w.die(-9)
            case cc.FreezeHost(host=host):
                if host in self.hosts:
                    self.hosts[host].frozen = True
            case cc.Close(conn=conn):
                if conn in self.by_conn:
                    self.by_conn[conn].down.close()
            case cc.Log(event=event, fields=fields):
                self.log.append((self.now, event, fields))
                self._logged(event, fields)
            case cc.Say(text=text):
                self.said.append(text)
            case cc.End():
                self.ended = cmd

    def _down(self, conn: int, data: bytes) -> None:
        host = self.by_conn.get(conn)
        if host is not None:
            host.down.send(data)

    def _boot(self, host: int) -> None:
        if self.ended is None:
            self.hosts[host] = SimHost(self, host)

    def host_at(self, address: p.Address | None) -> SimHost | None:
        if address is None:
            return None
        host = self.hosts.get(address[1])
        return host if host is not None and host.alive and not host.frozen else None

    # ------------------------------------------------------------ what workers share

    def arrive(self, gen: int, rank: int, w: SimWorker) -> None:
        """The generation's rendezvous (its store prefix)."""
        self._arrived.setdefault(gen, set()).add(rank)
        self._members.setdefault(gen, {})[rank] = w
        self.training[w] = gen
        self._wake_all()

    def arrived(self, gen: int) -> int:
        return len(self._arrived.get(gen, ()))

    def restored(self, gen: int, rank: int, step: int) -> None:
        steps = self._restored.setdefault(gen, {})
        steps[rank] = step
        if len(set(steps.values())) > 1:
            raise Violation(self._where(f"generation {gen} restored mixed steps {steps}"))

    def collective(
        self, w: SimWorker, gen: int, step: int, world_size: int
    ) -> Generator[Any, Any, int | None]:
        """The step's all-reduce: the sum of every rank's state before ``step``; None when
        a member of the generation died or left it (its sockets closed) first."""
        key = (gen, step)
        contrib = self._contrib.setdefault(key, {})
        assert w.value is not None
        contrib[w.rank] = w.value
        self._wake_all()
        yield Until(w, lambda: len(contrib) >= world_size or self._broken(gen))
        if len(contrib) < world_size:
            return None
        return sum(contrib.values()) & MASK

    def _broken(self, gen: int) -> bool:
        return any(not w.alive or self.training.get(w) != gen for w in self._members[gen].values())

    def left(self, w: SimWorker) -> None:
        """A worker left its generation (parked, finished or died)."""
        self.training.pop(w, None)
        self._wake_all()

    def kill_after(self, what: str, index: int, step: int) -> None:
        """Kill rank ``index``'s worker, or node ``index``'s host, once a worker of it has
        done ``step`` (as ``--inject kill:rank=R:step=S`` does); ``what`` "mid-node": the
        host, once a worker of it has exchanged ``step``'s gradients, before its optimizer
        step (its snapshot of the step before may still be on its way to a peer)."""
        self.kills[(what, index)] = step

    def pause_coordinator(self, at: float, seconds: float) -> None:
        """Freeze the launcher (SIGSTOP) from ``at`` for ``seconds``: what arrives meanwhile
        waits in its sockets, and no tick runs."""
        self.at(at, lambda: setattr(self, "paused_until", at + seconds))

    def kill_at_generation(self, node: int, generation: int) -> None:
        """Kill the host serving ``node`` as soon as ``generation`` starts."""
        self.kills[("gen", generation)] = node

    def fault_mid(self, w: SimWorker, step: int) -> bool:
        return self._kill_host(w, "mid-node", step)

    def fault_after(self, w: SimWorker, rank: int, step: int) -> bool:
        if self.kills.get(("rank", rank)) == step:
            del self.kills[("rank", rank)]
            w.die(-9)
            return True
        return self._kill_host(w, "node", step)

    def _kill_host(self, w: SimWorker, what: str, step: int) -> bool:
        """Kill ``w``'s host if a kill of its node is due at ``step`` (``kill_after``)."""
        node = w.host.core.node if w.host.core is not None else None
        if node is None or self.kills.get((what, node)) != step:
            return False
        del self.kills[(what, node)]
        w.host.die()
        return True

    def finished(self, rank: int, value: int) -> None:
        self.final[rank] = value

    def _wake_all(self) -> None:
        for host in self.hosts.values():
            for w in host.workers.values():
                if w.wake is not None:
                    self.after(0.0, w.poke)

    # ------------------------------------------------------------ chaos

    def _schedule_chaos(self) -> None:
        kinds = [
            ("host", self.chaos.host_kills),
            ("worker", self.chaos.worker_kills),
            ("freeze", self.chaos.freezes),
            ("cut", self.chaos.link_cuts),
        ]
        for kind, rate in kinds:
            t = 0.0
            while rate > 0:
                t += self.rng.expovariate(rate)
                if t > self.chaos.until:
                    break
                self.at(t, functools.partial(self._fault, kind))

    def _fault(self, kind: str) -> None:
        live = [h for h in self.hosts.values() if h.alive]
        if not live or self.ended is not None:
            return
        host = self.rng.choice(live)
        match kind:
            case "host":
                host.die()
            case "freeze":
                host.frozen = True
            case "cut":
                host.up.close()
            case "worker":
                workers = [w for w in host.workers.values() if w.alive]
                if workers:
                    self.rng.choice(workers).die(-9)

    # ------------------------------------------------------------ invariants

    def _logged(self, event: str, fields: dict[str, Any]) -> None:
        if event == "snapshot_committed" and fields.get("tier") in (0, 1):
            self.committed[fields["tier"]] = max(self.committed[fields["tier"]], fields["step"])
        elif event == "generation_started":
            self._check_plan(fields.get("step"))
            self.committed = {t: self.coordinator.tiers[t].committed for t in (0, 1)}
            node = self.kills.pop(("gen", fields["generation"]), None)
            host = None if node is None else self.hosts.get(fields["members"][str(node)])
            if host is not None:
                host.die()

    def _check_plan(self, step: int | None) -> None:
        """A step committed in a tier that still holds it on every rank is never planned
        away for an older one."""
        planned = -1 if step is None else step
        ws = self.cfg.world_size
        for tier, committed in self.committed.items():
            if committed > planned and self._holds(tier, committed, ws):
                raise Violation(self._where(
                    f"step {committed} is committed in tier {tier} and still held there on "
                    f"every rank, but generation starts from {step}"
                ))  # fmt: skip
        if self.tier2 is not None:
            newest = max(self.tier2.restorable_steps(ws), default=-1)
            if newest > planned:
                raise Violation(self._where(f"tier 2 holds step {newest}, restart is {step}"))

    def _holds(self, tier: int, step: int, ws: int) -> bool:
        cores = [h.core for h in self.hosts.values() if h.alive and not h.frozen and h.core]
        if tier == 0:
            held = {r for c in cores if c.node is not None for r, ring in c.rings.items()
                    if step in ring.held() and r in c.ranks}  # fmt: skip
        else:
            held = {r for c in cores if c.node is not None for r, s in c.peers.holdings().items()
                    if step in s}  # fmt: skip
        return held >= set(range(ws))

    def check(self) -> None:
        """The invariants, after every event."""
        coord = self.coordinator
        members, spares = set(coord.hosts.members.values()), set(coord.hosts.spares)
        if members & spares:
            raise Violation(self._where(f"hosts {members & spares} are both member and spare"))
        if len(members) != len(coord.hosts.members):
            raise Violation(self._where(f"a host serves two nodes: {coord.hosts.members}"))
        running: dict[int, set[int]] = {}
        for host in self.hosts.values():
            if not host.alive or host.core is None:
                continue
            for w in host.core.workers.procs.values():
                if w.machine.state is WorkerState.ASSIGNED and w.rank is not None:
                    running.setdefault(w.generation, set())
                    if w.rank in running[w.generation]:
                        raise Violation(self._where(f"rank {w.rank} has two workers in "
                                                    f"generation {w.generation}"))  # fmt: skip
                    running[w.generation].add(w.rank)
        if len(running) > 1:
            raise Violation(self._where(f"generations {sorted(running)} run at once"))
        if coord.phase.state is Phase.RUNNING:  # (the machines' states: no __eq__ per event)
            for host in self.hosts.values():
                core = host.core
                if core is None or not host.alive or core.phase.state is not AgentPhase.SERVING:
                    continue
                if core.ranks and set(core.workers.by_rank) != set(core.ranks):
                    raise Violation(self._where(
                            f"host {host.host} serves ranks {core.ranks} with workers for "
                            f"{sorted(core.workers.by_rank)}"
                        ))  # fmt: skip

    def outcome(self) -> str:
        """ "finished" (the final state checked against a run without failures) or the
        reason the job stopped."""
        assert self.ended is not None
        if self.ended.code != 0:
            return self.ended.reason or "stopped without a reason"
        want = reference(self.cfg.world_size, self.steps)
        got = [self.final.get(r) for r in range(self.cfg.world_size)]
        if got != want:
            raise Violation(self._where(f"finished with {got}, a run without failures ends {want}"))
        return "finished"


def spare_of(hosts: Iterable[SimHost]) -> list[SimHost]:
    return [h for h in hosts if h.alive and h.core is not None and h.core.node is None]
