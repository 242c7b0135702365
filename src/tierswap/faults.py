"""Fault injection, for tests and the demo: one plan, parsed once, asked at named hooks.

``--inject SPEC`` (repeatable) adds a fault to the job's plan. The forms:

- ``kill:node=I:step=S``: kill node I (agent and workers) when the job reaches step S;
- ``kill:node=I:gen=G``: kill node I as soon as generation G starts (a spare taking
  over, say);
- ``kill:node=I:step=S:during=replication``: kill it while a replica of step S or later
  is in flight to or from it;
- ``kill:node=I:step=S:during=persist``: kill it the moment its agent is asked to write
  its tier-2 parts of step S or later (a node lost with a tier-2 write in flight);
- ``kill:node=I:step=S:during=commit``: kill it once its tier-2 parts of step S or later
  are written, before they are reported (so before that step's COMMIT);
- ``kill:rank=R:step=S``: kill one worker after step S;
- ``kill:rank=R:step=S:during=snapshot``: kill it half way through the background copy
  of its snapshot of step S;
- ``kill:rank=R:gen=G:during=restore``: kill it as it restores at the start of
  generation G (it has its plan; the other ranks are restoring);
- ``stop:rank=R:step=S``, ``stop:node=I:step=S``: freeze a worker or a whole node with
  SIGSTOP (a hang);
- ``corrupt:rank=R:step=S:where=flight|memory|base|parity``: flip a byte of every tier-1
  replica of rank R from step S on, as it arrives (before its checksum is checked), once
  stored, or (``--memory-tiers delta``) in the base its deltas are made against; or
  (``--peer-parity``) of every parity the node of rank R holds for R's set, once made;
- ``delay:node=I:seconds=F``: hold every tier-1 transfer from node I for F seconds
  before it is sent (a slow network);
- ``fail:persist:step=S``: node agents fail their tier-2 writes of step S (a store that
  refuses them), so that step never gets a COMMIT;
- ``slow:rank=R:seconds=F``: the worker of rank R takes F seconds more for every step (a
  slow node: the others wait for it in their collectives);
- ``slow:persist:seconds=F``: every tier-2 part write waits F seconds first (slow
  storage).

A durable root that fills up or turns read-only is a real filesystem's doing: the tests
mount a small ``tmpfs`` as the root, and remount it read-only mid-run.

Hooks, and who asks them: the coordinator at a step reached (:meth:`FaultPlan.at_step`),
at a generation's start (:meth:`FaultPlan.at_generation`), at a replica transfer
(:meth:`FaultPlan.at_transfer`), at a tier-2 write (:meth:`FaultPlan.at_persist`) and at
a node's tier-2 parts (:meth:`FaultPlan.at_parts`);
an agent for the replicas it stores (:meth:`FaultPlan.corruptions`) and sends
(:meth:`FaultPlan.delay_of`, :meth:`FaultPlan.watches_transfers`) and for the parts it
persists (:meth:`FaultPlan.fails_persist`, :meth:`FaultPlan.persist_delay`); a worker
after each step, in its snapshot copy and in its restore (:meth:`FaultPlan.of_rank`).
A fault fires once: the coordinator drops it from the plan it hands to the next
generation.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass

FORMS = (
    "kill:node=I:step=S",
    "kill:node=I:gen=G",
    "kill:node=I:step=S:during=replication",
    "kill:node=I:step=S:during=persist",
    "kill:node=I:step=S:during=commit",
    "kill:rank=R:step=S",
    "kill:rank=R:step=S:during=snapshot",
    "kill:rank=R:gen=G:during=restore",
    "stop:node=I:step=S",
    "stop:rank=R:step=S",
    "corrupt:rank=R:step=S:where=flight|memory|base|parity",
    "delay:node=I:seconds=F",
    "fail:persist:step=S",
    "slow:rank=R:seconds=F",
    "slow:persist:seconds=F",
)

_NUMBER = r"(\d*\.?\d+(?:[eE][-+]?\d+)?|\d+\.)"


@dataclass(frozen=True, slots=True)
class Injection:
    """One fault of the plan (see the module's text for the forms)."""

    action: str
    """kill, stop, corrupt, delay, fail or slow."""
    target: str
    """node, rank or persist."""
    index: int
    step: int
    where: str = ""
    """For corrupt: flight, memory, base or parity."""
    gen: int = -1
    """For ``kill:node=I:gen=G``: the generation whose start fires it (step is -1)."""
    during: str = ""
    """For ``during=replication``: fire only as a replica of step S or later is being sent
    to or from node I, so the kill cuts a transfer in flight; ``commit``, ``snapshot``,
    ``restore``: at that moment (see the forms)."""
    seconds: float = 0.0
    """For delay and slow: how long each transfer, step or write is held."""

    @staticmethod
    def parse(spec: str) -> Injection:
        text = spec.strip()
        if m := re.fullmatch(r"(kill|stop):(node|rank)=(\d+):step=(\d+)", text):
            return Injection(m.group(1), m.group(2), int(m.group(3)), int(m.group(4)))
        if m := re.fullmatch(
            r"kill:node=(\d+):step=(\d+):during=(replication|persist|commit)", text
        ):
            node, step = int(m.group(1)), int(m.group(2))
            return Injection("kill", "node", node, step, during=m.group(3))
        if m := re.fullmatch(r"kill:rank=(\d+):step=(\d+):during=snapshot", text):
            return Injection("kill", "rank", int(m.group(1)), int(m.group(2)), during="snapshot")
        if m := re.fullmatch(r"kill:rank=(\d+):gen=(\d+):during=restore", text):
            rank, gen = int(m.group(1)), int(m.group(2))
            return Injection("kill", "rank", rank, -1, gen=gen, during="restore")
        if m := re.fullmatch(rf"slow:rank=(\d+):seconds={_NUMBER}", text):
            return Injection("slow", "rank", int(m.group(1)), -1, seconds=float(m.group(2)))
        if m := re.fullmatch(rf"slow:persist:seconds={_NUMBER}", text):
            return Injection("slow", "persist", -1, -1, seconds=float(m.group(1)))
        if m := re.fullmatch(r"kill:node=(\d+):gen=(\d+)", text):
            return Injection("kill", "node", int(m.group(1)), -1, gen=int(m.group(2)))
        if m := re.fullmatch(rf"delay:node=(\d+):seconds={_NUMBER}", text):
            return Injection("delay", "node", int(m.group(1)), -1, seconds=float(m.group(2)))
        corrupt = r"corrupt:rank=(\d+):step=(\d+):where=(flight|memory|base|parity)"
        if m := re.fullmatch(corrupt, text):
            return Injection("corrupt", "rank", int(m.group(1)), int(m.group(2)), m.group(3))
        if m := re.fullmatch(r"fail:persist:step=(\d+)", text):
            return Injection("fail", "persist", -1, int(m.group(1)))
        raise ValueError(f"--inject {spec!r}: expected one of {', '.join(FORMS)}")

    def __str__(self) -> str:
        if self.action == "delay":
            return f"delay:node={self.index}:seconds={self.seconds!r}"
        if self.target == "persist":
            if self.action == "slow":
                return f"slow:persist:seconds={self.seconds!r}"
            return f"fail:persist:step={self.step}"
        if self.action == "slow":
            return f"slow:{self.target}={self.index}:seconds={self.seconds!r}"
        where = f":where={self.where}" if self.where else ""
        when = f"gen={self.gen}" if self.gen >= 0 else f"step={self.step}"
        during = f":during={self.during}" if self.during else ""
        return f"{self.action}:{self.target}={self.index}:{when}{where}{during}"

    @property
    def on_node(self) -> bool:
        """A kill or freeze of a whole node, carried out by the launcher."""
        return self.target == "node" and self.action in ("kill", "stop")


class FaultPlan:
    """The faults still to fire."""

    def __init__(self, faults: Iterable[Injection] = ()) -> None:
        self.faults = list(faults)

    @classmethod
    def parse(cls, specs: Iterable[str]) -> FaultPlan:
        return cls(Injection.parse(s) for s in specs)

    def specs(self) -> list[str]:
        return [str(f) for f in self.faults]

    def __bool__(self) -> bool:
        return bool(self.faults)

    def unfired(self) -> list[str]:
        """The kills and stops still in the plan: each leaves it when it fires (a node's
        here, a rank's as its worker says so); the other kinds stay in it for good."""
        return [str(f) for f in self.faults if f.action in ("kill", "stop")]

    def fired(self, spec: str) -> None:
        """A fault carried out elsewhere (a worker's): it does not fire again."""
        self.faults = [f for f in self.faults if str(f) != spec]

    def _take(self, due: list[Injection]) -> list[Injection]:
        self.faults = [f for f in self.faults if f not in due]
        return due

    # ---------------------------------------------------------------- the coordinator's hooks

    def at_step(self, step: int) -> list[Injection]:
        """Node faults due now that the job reached ``step`` (taken from the plan)."""
        due = [
            f for f in self.faults if f.on_node and not f.during and f.gen < 0 and step >= f.step
        ]
        return self._take(due)

    def at_generation(self, generation: int) -> list[Injection]:
        due = [f for f in self.faults if f.on_node and f.gen >= 0 and f.gen == generation]
        return self._take(due)

    def at_transfer(self, src: int | None, dst: int, step: int) -> list[Injection]:
        """Node faults due as a replica of ``step`` starts from node ``src`` to ``dst``."""
        due = [
            f
            for f in self.faults
            if f.on_node and f.during == "replication" and step >= f.step and f.index in (src, dst)
        ]
        return self._take(due)

    # ---------------------------------------------------------------- an agent's hooks

    def at_persist(self, step: int, nodes: Collection[int]) -> list[Injection]:
        """Faults due on ``nodes`` (those that can be killed) as the nodes are asked to
        write ``step`` to tier 2."""
        due = [
            f
            for f in self.faults
            if f.on_node and f.during == "persist" and step >= f.step and f.index in nodes
        ]
        return self._take(due)

    def at_parts(self, node: int | None, step: int) -> list[Injection]:
        """Node faults due as node ``node`` reports its tier-2 parts of ``step``."""
        due = [
            f
            for f in self.faults
            if f.on_node and f.during == "commit" and step >= f.step and f.index == node
        ]
        return self._take(due)

    def corruptions(self) -> list[Injection]:
        return [f for f in self.faults if f.action == "corrupt"]

    def delay_of(self, node: int | None) -> float:
        """Seconds each tier-1 transfer from ``node`` is held."""
        return max(
            (f.seconds for f in self.faults if f.action == "delay" and f.index == node),
            default=0.0,
        )

    def fails_persist(self, step: int) -> bool:
        """Whether this node's tier-2 writes of ``step`` fail."""
        return any(
            f.target == "persist" and f.action == "fail" and f.step == step for f in self.faults
        )

    def persist_delay(self) -> float:
        """Seconds each tier-2 part write waits first (slow storage)."""
        return max(
            (f.seconds for f in self.faults if f.target == "persist" and f.action == "slow"),
            default=0.0,
        )

    def watches_transfers(self) -> bool:
        """Whether agents must announce each transfer (a fault waits for one)."""
        return any(f.during == "replication" for f in self.faults)

    # ---------------------------------------------------------------- a worker's hook

    def of_rank(self, rank: int) -> list[Injection]:
        """The kills, freezes and slowness a worker of ``rank`` carries out itself."""
        return [
            f
            for f in self.faults
            if f.action in ("kill", "stop", "slow") and f.target == "rank" and f.index == rank
        ]


@dataclass(frozen=True, slots=True)
class Chaos:
    """``--chaos SEED[:RATE[:COUNT]]``: kill random nodes and workers at random moments,
    about RATE a minute (default 6), COUNT in all (default: no end), each logged. The
    choices come from SEED; the moments from the clock, so two runs differ in their
    timing, not in what they choose."""

    seed: int
    rate: float = 6.0
    count: int | None = None

    @staticmethod
    def parse(spec: str) -> Chaos:
        m = re.fullmatch(rf"(\d+)(?::{_NUMBER})?(?::(\d+))?", spec.strip())
        if m is None or (m.group(2) is not None and float(m.group(2)) <= 0):
            raise ValueError(
                f"--chaos {spec!r}: expected SEED[:RATE[:COUNT]] (RATE failures a minute > 0)"
            )
        rate = 6.0 if m.group(2) is None else float(m.group(2))
        return Chaos(int(m.group(1)), rate, None if m.group(3) is None else int(m.group(3)))

    def __str__(self) -> str:
        return f"{self.seed}:{self.rate!r}" + ("" if self.count is None else f":{self.count}")
