"""From what agents reported holding to a restore plan, what each worker is told, and what
a person reads."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from tierswap.control.ports import Tier2
from tierswap.control.protocol import (
    Address,
    FromDurable,
    FromMemory,
    FromParity,
    FromPeer,
    RankPlan,
)
from tierswap.errors import CorruptPartError
from tierswap.plan import Holdings, Plan, Source, Tier, plan_restore
from tierswap.tiers import parity
from tierswap.tiers.durable import PartInfo

Reported = Mapping[int, Mapping[int, Mapping[int, str]]]
"""node -> rank -> step -> checksum (or kind), as agents report what they hold."""


def collect(
    world_size: int,
    memory_by_node: Reported,
    peer_by_node: Reported,
    durable_steps: frozenset[int],
    bad: set[tuple[Tier, int, int]],
    peer_deltas: Reported | None = None,
    placement: parity.Placement | None = None,
) -> Holdings:
    """The planner's input from what agents reported (own tier 0, replicas or parities
    held for others, which of those are deltas) and the committed durable steps."""
    memory: dict[int, frozenset[int]] = {}
    memory_node: dict[int, int] = {}
    for node, per_rank in memory_by_node.items():
        for rank, steps in per_rank.items():
            memory[rank] = frozenset(steps)
            memory_node[rank] = node
    peers: dict[int, dict[int, frozenset[int]]] = {}
    held: dict[int, dict[int, frozenset[int]]] = {}
    for node, per_rank in peer_by_node.items():
        for rank, steps in per_rank.items():
            into = held if parity.is_key(rank) else peers
            into.setdefault(rank, {})[node] = frozenset(steps)
    deltas: dict[int, dict[int, frozenset[int]]] = {}
    from_disk: dict[int, dict[int, frozenset[int]]] = {}
    for node, per_rank in (peer_deltas or {}).items():
        for rank, kinds in per_rank.items():
            deltas.setdefault(rank, {})[node] = frozenset(kinds)
            from_disk.setdefault(rank, {})[node] = frozenset(
                s for s, k in kinds.items() if k == "delta+durable"
            )
    return Holdings(
        world_size, memory, memory_node, peers, deltas, from_disk, durable_steps, frozenset(bad),
        parity_keys={} if placement is None else placement.keys,
        parity_members={} if placement is None else placement.members,
        parity_held=held,
    )  # fmt: skip


def rank_plans(
    plan: Plan,
    world_size: int,
    tier2: Tier2 | None,
    address_of: Callable[[int], Address | None],
    holdings: Holdings | None = None,
) -> dict[int, RankPlan]:
    """rank -> where its worker loads its part from.

    Raises CorruptPartError or OSError when the chosen durable step's COMMIT is unreadable.
    """
    if plan.step is None:
        return {r: RankPlan(step=None) for r in range(world_size)}
    parts: dict[int, PartInfo] = {}
    if plan.ranks_from(Tier.DURABLE):
        assert tier2 is not None
        parts = tier2.read_commit(plan.step)
    out: dict[int, RankPlan] = {}
    memory = RankPlan(step=plan.step, source=FromMemory())
    for r, src in plan.sources.items():
        if src.tier == Tier.MEMORY:
            out[r] = memory
        elif src.tier == Tier.PEER and src.parity:
            assert holdings is not None
            out[r] = RankPlan(step=plan.step, source=_from_parity(r, src, holdings, address_of))
        elif src.tier == Tier.PEER:
            assert src.node is not None
            address = address_of(src.node)
            assert address is not None, f"node {src.node} holds replicas but has no address"
            out[r] = RankPlan(step=plan.step, source=FromPeer(node=src.node, address=address))
        else:
            assert tier2 is not None
            if r not in parts:
                raise CorruptPartError(f"{tier2.url} step {plan.step}", f"COMMIT lacks rank {r}")
            out[r] = RankPlan(step=plan.step, source=FromDurable(root=tier2.url, part=parts[r]))
    return out


def _from_parity(
    rank: int, src: Source, h: Holdings, address_of: Callable[[int], Address | None]
) -> FromParity:
    """Where a worker rebuilding ``rank`` from parity reads: each stripe's parity, and the
    tier 0 of the set's other ranks."""

    def at(node: int | None) -> Address:
        address = None if node is None else address_of(node)
        assert address is not None, f"node {node} holds what a rebuild reads but has no address"
        return address

    return FromParity(
        keys=list(h.parity_keys[rank]),
        holders=[at(n) for n in src.parity],
        members={q: at(h.memory_node.get(q)) for q in h.parity_members.get(rank, ())},
    )


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
        hint = (
            f" Tier 2 at {persist} keeps every step it holds: `tierswap verify {persist}` "
            "names the parts that fail their checks; a job started again resumes from the "
            "newest step whose parts all pass."
        )
    else:
        hint = (
            " Without --persist only memory tiers hold state, and a lost node takes its"
            " ranks' snapshots with it: run with --persist URL to survive node loss."
        )
    return f"no step can be restored on every rank ({why}).{hint}"


class Reports:
    """What the agents reported holding when their workers stopped, and the parts found
    bad since: the coordinator's input to each restore plan."""

    def __init__(self, world_size: int, tier2: Tier2 | None) -> None:
        self.world_size = world_size
        self.tier2 = tier2
        self.memory: dict[int, dict[int, dict[int, str]]] = {}
        self.peer: dict[int, dict[int, dict[int, str]]] = {}
        self.peer_deltas: dict[int, dict[int, dict[int, str]]] = {}
        self.bad: set[tuple[Tier, int, int]] = set()
        self.parity: parity.Placement | None = None
        """``--peer-parity``: the placement the parities reported follow."""

    def stopped(
        self,
        node: int,
        holdings: dict[int, dict[int, str]],
        peer: dict[int, dict[int, str]],
        peer_deltas: dict[int, dict[int, str]],
    ) -> None:
        self.memory[node] = holdings
        self.peer[node] = peer
        self.peer_deltas[node] = peer_deltas

    def forget(self, node: int | None = None) -> None:
        """A node is gone (or, with None, every node reports afresh)."""
        for reported in (self.memory, self.peer, self.peer_deltas):
            if node is None:
                reported.clear()
            else:
                reported.pop(node, None)

    def holdings(self, durable_steps: frozenset[int]) -> Holdings:
        return collect(
            self.world_size, self.memory, self.peer, durable_steps, self.bad, self.peer_deltas,
            self.parity,
        )  # fmt: skip

    def plan(
        self,
        durable_steps: Callable[[], frozenset[int]],
        address_of: Callable[[int], Address | None],
        on_bad_commit: Callable[[int, str], None],
    ) -> tuple[Holdings, Plan, dict[int, RankPlan]]:
        """The restore plan and each rank's part of it. A durable step whose COMMIT turns
        out unreadable is marked bad (``on_bad_commit(step, why)``) and planned past."""
        while True:
            holdings = self.holdings(durable_steps())
            plan = plan_restore(holdings)
            try:
                plans = rank_plans(plan, self.world_size, self.tier2, address_of, holdings)
                return holdings, plan, plans
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
