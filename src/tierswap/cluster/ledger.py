"""The coordinator's ledger: what agents report about snapshots (held in tier 0, dropped,
replicas held in tier 1, votes, durable parts), turned into commits per tier, and the
step tier 1 is done with, which trainers wait for under ``--max-redo``.

Membership, generations and recovery decisions stay in the coordinator; it hands the
ledger the records it shares (``Commits``, ``Persistence``, ``Reports``) and tells it when a
generation starts.
"""

from __future__ import annotations

from collections.abc import Callable

from tierswap.cluster.commits import Commits
from tierswap.cluster.persistence import Persistence
from tierswap.cluster.restore import Reports
from tierswap.events import EventLog
from tierswap.wire import Message

NEVER_IN_TIER1 = frozenset({"skipped", "replicate_failed", "replica_rejected"})
"""Logged messages that mean their step will never commit in tier 1 (a rank's snapshot
skipped, a replica not sent or refused): trainers waiting for it (``--max-redo``) go on."""


class Ledger:
    def __init__(
        self,
        commits: Commits,
        persister: Persistence,
        reports: Reports,
        log: EventLog,
        broadcast: Callable[..., None],
        proposing: Callable[[], bool],
        changed: Callable[[], None],
    ) -> None:
        self.commits = commits
        self.persister = persister
        self.reports = reports
        self.log = log
        self.broadcast = broadcast
        self.proposing = proposing
        """Whether commits may be proposed now (a generation runs or finishes)."""
        self.changed = changed
        """Called after a vote or a durable part: the job may be done."""
        self.generation = -1
        self.ever_committed = False
        self.settled = -1
        """The newest step tier 1 committed or gave up on in this generation."""

    def restart(self, generation: int) -> None:
        """A generation starts (``commits`` already reset to its restart step)."""
        self.generation = generation
        self.settled = self.commits.committed[1]

    def tiers(self) -> dict[str, int]:
        """The newest committed step per tier, by name, where there is one."""
        c = self.commits.committed
        named = {"memory": c[0], "peer": c[1], "durable": self.persister.committed}
        return {k: v for k, v in named.items() if v >= 0}

    def logged(self, op: str, msg: Message) -> None:
        """A message that only goes to the event log may still settle its step in tier 1
        (node -1: a base to tier 2; another generation: a step of another timeline)."""
        current = msg.get("generation") == self.generation
        if op in NEVER_IN_TIER1 and msg.get("node", 0) >= 0 and current:
            self._settle(int(msg["step"]))

    def propose(self, tier: int) -> None:
        if self.proposing():
            self.commits.maybe_propose(tier)

    def _settle(self, step: int) -> None:
        """Tier 1 is done with ``step``, committed or never to be: agents tell their
        trainers, whose ``optimizer.step()`` waits for it (``--max-redo``)."""
        if step > self.settled:
            self.settled = step
            self.broadcast("settled", generation=self.generation, step=step)

    # ---------------------------------------------------------------- agents' messages

    def on_held(self, node: int | None, msg: Message) -> None:
        self.commits.held_add(int(msg["rank"]), int(msg["step"]))
        self.propose(0)

    def on_dropped(self, node: int | None, msg: Message) -> None:
        self.commits.dropped(int(msg["rank"]), [int(s) for s in msg["steps"]])

    def on_replica_held(self, node: int | None, msg: Message) -> None:
        assert node is not None
        self.commits.replica_add(int(msg["rank"]), node, int(msg["step"]))
        self.propose(1)

    def on_replica_dropped(self, node: int | None, msg: Message) -> None:
        assert node is not None
        self.commits.replica_dropped(int(msg["rank"]), node, [int(s) for s in msg["steps"]])

    def on_vote(self, node: int | None, msg: Message) -> None:
        assert node is not None
        tier, step = int(msg["tier"]), int(msg["step"])
        asked = self.commits.proposals[tier]
        current = asked is not None and asked.step == step and node in asked.voters
        done = self.commits.vote(tier, node, step, bool(msg["ok"]))
        if tier == 1 and (done is not None or (current and not msg["ok"])):
            self._settle(step)  # committed, or a holder no longer has it
        if done is not None:
            self.ever_committed = True
            self.log.emit("snapshot_committed", tier=tier, step=done)
            if tier == 0:
                self.persister.maybe_persist(done)
        self.propose(tier)
        self.changed()

    def on_part(self, node: int | None, msg: Message) -> None:
        step = self.persister.on_part(msg)
        if step is not None:
            self.ever_committed = True
            self.reports.durable_good(step)
        self.changed()
