"""From a restore plan to what each worker is told, and to what a person reads."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from tierswap.errors import CorruptPartError
from tierswap.plan import Holdings, Plan, Tier, plan_restore
from tierswap.tiers import durable

Reported = Mapping[int, Mapping[str, Mapping[str, str]]]
"""node -> rank -> step -> checksum, as agents report what they hold."""


def collect(
    world_size: int,
    memory_by_node: Reported,
    peer_by_node: Reported,
    durable_steps: frozenset[int],
    bad: set[tuple[Tier, int, int]],
    peer_deltas: Reported | None = None,
) -> Holdings:
    """The planner's input from what agents reported (own tier 0, replicas held for
    others, which of those are deltas) and the committed durable steps."""
    memory: dict[int, frozenset[int]] = {}
    memory_node: dict[int, int] = {}
    for node, per_rank in memory_by_node.items():
        for rank, steps in per_rank.items():
            memory[int(rank)] = frozenset(int(s) for s in steps)
            memory_node[int(rank)] = node
    peers: dict[int, dict[int, frozenset[int]]] = {}
    for node, per_rank in peer_by_node.items():
        for rank, steps in per_rank.items():
            peers.setdefault(int(rank), {})[node] = frozenset(int(s) for s in steps)
    deltas: dict[int, dict[int, frozenset[int]]] = {}
    from_disk: dict[int, dict[int, frozenset[int]]] = {}
    for node, per_rank in (peer_deltas or {}).items():
        for rank, kinds in per_rank.items():
            deltas.setdefault(int(rank), {})[node] = frozenset(int(s) for s in kinds)
            from_disk.setdefault(int(rank), {})[node] = frozenset(
                int(s) for s, k in kinds.items() if k == "delta+durable"
            )
    return Holdings(
        world_size, memory, memory_node, peers, deltas, from_disk, durable_steps, frozenset(bad)
    )


def committed_steps(root: str, world_size: int) -> frozenset[int]:
    """Steps restorable from tier 2 (committed, with every base their delta parts need)
    written by a job of this world size. Raises OSError."""
    return frozenset(
        s.step for s in durable.list_steps(root) if s.restorable and s.world_size == world_size
    )


def rank_plans(
    plan: Plan, world_size: int, persist: str | None, peer_addresses: Mapping[int, Any]
) -> dict[int, dict[str, Any]]:
    """rank -> {step, source}: where each worker loads its part from.

    Raises CorruptPartError or OSError when the chosen durable step's COMMIT is unreadable.
    """
    if plan.step is None:
        return {r: {"step": None} for r in range(world_size)}
    parts: dict[int, durable.PartInfo] = {}
    if plan.ranks_from(Tier.DURABLE):
        assert persist is not None
        _, parts = durable.read_commit(persist, plan.step)
    out: dict[int, dict[str, Any]] = {}
    for r, src in plan.sources.items():
        source: dict[str, Any] = {"tier": int(src.tier)}
        if src.tier == Tier.DURABLE:
            source.update(root=persist, part=parts[r].to_json())
        elif src.tier == Tier.PEER:
            assert src.node is not None
            source.update(node=src.node, address=peer_addresses[src.node])
        out[r] = {"step": plan.step, "source": source}
    return out


def memory_lost(holdings: Holdings, plan: Plan) -> list[int]:
    """Ranks restored from disk because no live node holds them in memory any more."""
    return [
        r
        for r in plan.ranks_from(Tier.DURABLE)
        if not holdings.memory.get(r) and not any(holdings.peer.get(r, {}).values())
    ]


def lost_message(plan: Plan, persist: str | None) -> str:
    """Why no step can be restored, and what to do about it."""
    why = "; ".join(f"step {s}: {w}" for s, w in plan.skipped[:3]) or "no snapshot at all"
    if persist:
        hint = f" Tier 2 at {persist} is intact; start the job again to resume."
    else:
        hint = (
            " Without --persist only memory tiers hold state, and a lost node takes its"
            " ranks' snapshots with it: run with --persist URL to survive node loss."
        )
    return f"no step can be restored on every rank ({why}).{hint}"


class Reports:
    """What the agents reported holding when their workers stopped, and the parts found
    bad since: the coordinator's input to each restore plan."""

    def __init__(self, world_size: int, persist: str | None) -> None:
        self.world_size = world_size
        self.persist = persist
        self.memory: dict[int, dict[str, dict[str, str]]] = {}
        self.peer: dict[int, dict[str, dict[str, str]]] = {}
        self.peer_deltas: dict[int, dict[str, dict[str, str]]] = {}
        self.bad: set[tuple[Tier, int, int]] = set()

    def stopped(self, node: int, msg: Mapping[str, Any]) -> None:
        self.memory[node] = msg["holdings"]
        self.peer[node] = msg.get("peer", {})
        self.peer_deltas[node] = msg.get("peer_deltas", {})

    def forget(self, node: int | None = None) -> None:
        """A node is gone (or, with None, every node reports afresh)."""
        for reported in (self.memory, self.peer, self.peer_deltas):
            if node is None:
                reported.clear()
            else:
                reported.pop(node, None)

    def holdings(self, durable_steps: frozenset[int]) -> Holdings:
        return collect(
            self.world_size, self.memory, self.peer, durable_steps, self.bad, self.peer_deltas
        )

    def plan(
        self,
        durable_steps: Callable[[], frozenset[int]],
        peer_addresses: Mapping[int, Any],
        on_bad_commit: Callable[[int, str], None],
    ) -> tuple[Holdings, Plan, dict[int, dict[str, Any]]]:
        """The restore plan and each rank's part of it. A durable step whose COMMIT turns
        out unreadable is marked bad (``on_bad_commit(step, why)``) and planned past."""
        while True:
            holdings = self.holdings(durable_steps())
            plan = plan_restore(holdings)
            try:
                return (
                    holdings,
                    plan,
                    rank_plans(plan, self.world_size, self.persist, peer_addresses),
                )
            except (CorruptPartError, OSError) as e:
                assert plan.step is not None
                self.bad |= {(Tier.DURABLE, plan.step, r) for r in range(self.world_size)}
                on_bad_commit(plan.step, str(e))

    def restarted(self, step: int) -> None:
        """A new generation restores ``step``: memory parts of later steps will be new."""
        self.bad = {b for b in self.bad if b[0] == Tier.DURABLE or b[1] <= step}

    def durable_good(self, step: int) -> None:
        """``step`` was committed in tier 2 anew: its parts are no longer bad."""
        self.bad = {b for b in self.bad if not (b[0] == Tier.DURABLE and b[1] == step)}
