"""An agent's side of the memory tiers' commits (``control/commits.py``): the one step per
tier it holds for a commit, when it takes a newer one, and when it lets one go.

A part of the agent's core (``control/agent.py``), apart so that its rules read in one
place: no I/O; what it tells the coordinator goes through ``tell``.

With tier 1 as parity (``--peer-parity``) a node holds a step for tier 1 only while its
own ranks' tier 0 holds it too, and tier 0 keeps it from then (``peer_held``): a parity is
of use only while the other ranks of its set still hold its step. When that keeps every
slot of a rank's tier 0, the node asks to let the hold go (``letting_go``) and keeps the
step until the coordinator answers (docs/architecture.md, "Tier 1 as parity").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tierswap.control import protocol as p
from tierswap.tiers.memory import NodeRings
from tierswap.tiers.replicas import PeerStore


@dataclass(slots=True)
class Hold:
    """This node's side of one tier's commits (``control/commits.py``)."""

    committed: int = -1
    held: int | None = None
    """The step held for a commit (reported in ``Held``), until committed or released."""
    passed: int = -1
    """The newest step released: never held again."""


class Holds:
    """The steps this node holds for tier 0's and tier 1's commits."""

    def __init__(
        self,
        rings: NodeRings,
        peers: PeerStore,
        tell: Callable[[p.Message], None],
        serving: Callable[[], bool],
    ) -> None:
        self.rings, self.peers, self.tell, self.serving = rings, peers, tell, serving
        self.tiers = {0: Hold(), 1: Hold()}
        self.letting_go: int | None = None
        """A tier-1 hold (parity) this node asked to let go (``unheld``): kept, and no
        other held, until the coordinator answers."""

    def __getitem__(self, tier: int) -> Hold:
        return self.tiers[tier]

    def start(self, memory: int, replicated: int, restart: int) -> None:
        """A generation starts from ``restart``, each tier's commit as given. With parity,
        the restored step and older ones are never held for tier 1 again: no node sends
        their stripes anew, so a node that lost them (a new one) never holds them, and a
        hold of one would keep a tier-0 slot for nothing."""
        passed = restart if self.peers.parity else -1
        self.tiers = {0: Hold(committed=memory), 1: Hold(committed=replicated, passed=passed)}
        self.letting_go = None

    def maybe(self, tier: int) -> None:
        """Hold the newest step complete on this node for the tier's commit, when none is
        held (one at a time; see ``control/commits.py``)."""
        hold = self.tiers[tier]
        if not self.serving() or hold.held is not None:
            return
        if tier == 1 and self.letting_go is not None:  # tier 0 keeps that one meanwhile
            return
        if tier == 0:
            newest = self.rings.newest_complete()
        elif self.peers.parity:  # a parity is of use while the set's tier 0 holds the step
            newest = max(self.peers.complete() & self.rings.complete(), default=-1)
        else:
            newest = self.peers.newest_complete()
        if newest <= max(hold.committed, hold.passed):
            return
        ok = self.rings.propose(newest) if tier == 0 else self.peers.propose(newest)
        assert ok, f"tier {tier}: step {newest} is complete but cannot be held"
        if tier == 1 and self.peers.parity:
            self.rings.peer_hold(newest)
        hold.held = newest
        self.tell(p.Held(tier=tier, step=newest))

    def lost(self) -> None:
        """A held step no longer on every ring (slots made anew for another layout): the
        coordinator stops counting it, and the next complete step is held instead."""
        for tier, hold in self.tiers.items():
            rings = self.rings if tier == 0 else self.peers
            if hold.held is None:
                continue
            backed = tier == 0 or not self.peers.parity or self.rings.holds_everywhere(hold.held)
            if not (rings.holds_everywhere(hold.held) and backed):
                self.tell(p.Unheld(tier=tier, step=hold.held))
                hold.held = None
                if tier == 1:
                    self.rings.peer_hold(-1)
                self.maybe(tier)

    def committed(self, tier: int, step: int) -> None:
        """``step`` is committed in ``tier`` (the rings were told): hold the next."""
        hold = self.tiers[tier]
        hold.committed = max(hold.committed, step)
        if hold.held is not None and hold.held <= step:
            hold.held = None
            if tier == 1:
                self.rings.peer_hold(-1)  # kept as tier 1's commit, or of no use
        if tier == 1 and self.letting_go is not None and self.letting_go <= step:
            self.letting_go = None
            self.rings.peer_hold(-1)
        self.maybe(tier)

    def ask_to_let_go(self, step: int) -> None:
        """A rank's tier 0 has every slot kept, one for the step this node holds for tier
        1 (parity): the node says it holds it no more (``unheld``) and never holds it
        again, and keeps it, parity and tier 0, until the coordinator's answer: a
        ``release`` frees it, a ``committed`` that crossed the request keeps it as tier 1's
        commit (freed at once, a commit could find a tier 0 without its step)."""
        hold = self.tiers[1]
        if hold.held != step:
            return
        hold.held, self.letting_go = None, step
        hold.passed = max(hold.passed, step)
        self.tell(p.Unheld(tier=1, step=step))

    def release(self, tier: int, step: int) -> None:
        """``step`` held in ``tier`` can never be committed: let it go, hold a newer one."""
        hold = self.tiers[tier]
        if tier == 1 and self.letting_go == step:  # the answer to an unheld: it is free
            self.letting_go = None
            self.peers.abort(step)
            self.rings.peer_hold(-1)
        if hold.held == step:
            if tier == 0:
                self.rings.abort(step)
            else:
                self.peers.abort(step)
                self.rings.peer_hold(-1)
            hold.held = None
        hold.passed = max(hold.passed, step)
        self.maybe(tier)
