"""The restore planner: what every tier holds in, one step and one source per rank out.

A pure function, so every case can be tested without processes. Rules:

- The step is the newest one that *every* rank can reach from some tier; a restore never
  mixes steps across ranks.
- For each rank the fastest tier holding that step wins: its own node's memory (tier 0),
  then a peer's memory (tier 1), then durable storage (tier 2). Among the peers that hold
  it, the cheapest: a replica held as a delta costs a decode against its base on top of
  the transfer (``DECODE_COST`` transfers), one whose base the peer must first read back
  from tier 2 costs that read too (``BASE_READ_COST``; when tier 2 holds the step itself,
  its part is read instead), and each rank already given to a peer costs one transfer
  more there, so the ranks spread over the holders and are fetched in parallel.
- With tier 1 as parity (``--peer-parity``), a rank no peer holds a copy of is rebuilt
  from parity where every parity of its stripes is held at that step and every other
  rank of its set holds the step in its own tier 0 (read by the rebuild); before tier 2.
- Parts known to be corrupt are not sources; a step passed over is named with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum

DECODE_COST = 1.0
"""A delta's decode in units of one full transfer: the codec rebuilds at about the speed of
the loopback network (``tierswap bench delta``), so base + delta costs about two."""
BASE_READ_COST = 1.0
"""Reading a delta's base back from tier 2 (its peer lost it from memory), in the same
units: a local disk read measured about as fast as a peer fetch (``bench replication``)."""


class Tier(IntEnum):
    MEMORY = 0
    PEER = 1
    DURABLE = 2


@dataclass(frozen=True, slots=True)
class Source:
    tier: Tier
    node: int | None = None
    """The node whose memory holds the part (tiers 0 and 1); None for durable storage."""
    parity: tuple[int, ...] = ()
    """Rebuilt from tier-1 parity: the node holding the parity of each of its stripes."""


@dataclass(frozen=True, slots=True)
class Holdings:
    """What each tier holds at the moment of a restore."""

    world_size: int
    memory: Mapping[int, frozenset[int]] = field(default_factory=dict)
    """rank -> steps its own node's tier 0 holds, checksummed."""
    memory_node: Mapping[int, int] = field(default_factory=dict)
    """rank -> the node whose tier 0 holds its parts."""
    peer: Mapping[int, Mapping[int, frozenset[int]]] = field(default_factory=dict)
    """rank -> node -> steps that node holds as tier-1 replicas of the rank."""
    peer_delta: Mapping[int, Mapping[int, frozenset[int]]] = field(default_factory=dict)
    """rank -> node -> the steps of ``peer`` held as a delta against a base."""
    peer_durable_base: Mapping[int, Mapping[int, frozenset[int]]] = field(default_factory=dict)
    """rank -> node -> the steps of ``peer_delta`` whose base only tier 2 still holds."""
    durable: frozenset[int] = frozenset()
    """Steps committed in tier 2 by a job of the same world size."""
    bad: frozenset[tuple[Tier, int, int]] = frozenset()
    """(tier, step, rank) parts known to be corrupt or missing."""
    parity_keys: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    """``--peer-parity``: rank -> the parity holding each of its stripes, in order."""
    parity_members: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    """rank -> the other ranks of its parity set (a rebuild reads their tier 0)."""
    parity_held: Mapping[int, Mapping[int, frozenset[int]]] = field(default_factory=dict)
    """parity key -> node -> the steps that node holds that parity of, complete."""


@dataclass(frozen=True, slots=True)
class Plan:
    step: int | None
    """The step to restore; None when no step is reachable by every rank."""
    sources: Mapping[int, Source]
    skipped: tuple[tuple[int, str], ...] = ()
    """Newer steps passed over, each with the reason."""

    def ranks_from(self, tier: Tier) -> list[int]:
        return sorted(r for r, s in self.sources.items() if s.tier == tier)


def _source(h: Holdings, step: int, rank: int, load: dict[int, float]) -> Source | None:
    if step in h.memory.get(rank, ()) and (Tier.MEMORY, step, rank) not in h.bad:
        return Source(Tier.MEMORY, h.memory_node.get(rank))
    holders = sorted(n for n, steps in h.peer.get(rank, {}).items() if step in steps)
    durable_ok = step in h.durable and (Tier.DURABLE, step, rank) not in h.bad
    if holders and (Tier.PEER, step, rank) not in h.bad:
        deltas = h.peer_delta.get(rank, {})
        from_disk = h.peer_durable_base.get(rank, {})
        if durable_ok and all(step in from_disk.get(n, ()) for n in holders):
            return Source(Tier.DURABLE)  # one read of the part beats base read + delta

        def cost(n: int) -> float:
            c = 1.0 + (DECODE_COST if step in deltas.get(n, ()) else 0.0)
            return c + (BASE_READ_COST if step in from_disk.get(n, ()) else 0.0)

        node = min(holders, key=lambda n: (load.get(n, 0.0) + cost(n), n))
        load[node] = load.get(node, 0.0) + cost(node)
        return Source(Tier.PEER, node)
    via = _rebuild_from(h, step, rank)
    if via is not None:
        return Source(Tier.PEER, parity=via)
    if durable_ok:
        return Source(Tier.DURABLE)
    return None


def _rebuild_from(h: Holdings, step: int, rank: int) -> tuple[int, ...] | None:
    """The nodes holding the parity of each stripe of ``rank`` at ``step``, where it can be
    rebuilt from them and its set's tier 0; else None."""
    keys = h.parity_keys.get(rank)
    if not keys or (Tier.PEER, step, rank) in h.bad:
        return None
    for q in h.parity_members.get(rank, ()):
        if step not in h.memory.get(q, ()) or (Tier.MEMORY, step, q) in h.bad:
            return None
    via = []
    for key in keys:
        holders = sorted(n for n, steps in h.parity_held.get(key, {}).items() if step in steps)
        if not holders:
            return None
        via.append(holders[0])
    return tuple(via)


def plan_restore(h: Holdings) -> Plan:
    """Pick the newest step every rank can reach, and each rank's fastest source for it."""
    if h.world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {h.world_size}")
    candidates = set(h.durable)
    for steps in h.memory.values():
        candidates |= steps
    for by_node in h.peer.values():
        for steps in by_node.values():
            candidates |= steps
    skipped: list[tuple[int, str]] = []
    own: dict[int | None, Source] = {}
    """One Source per node for the common case, a rank back from its own tier 0."""
    for step in sorted(candidates, reverse=True):
        load: dict[int, float] = {}
        sources: dict[int, Source] = {}
        lost: list[int] = []
        for r in range(h.world_size):
            mem = h.memory.get(r)
            if mem is not None and step in mem and not (h.bad and (Tier.MEMORY, step, r) in h.bad):
                node = h.memory_node.get(r)
                src: Source | None = own.get(node) or own.setdefault(
                    node, Source(Tier.MEMORY, node)
                )
            else:
                src = _source(h, step, r, load)
            if src is None:
                lost.append(r)
            else:
                sources[r] = src
        if not lost:
            return Plan(step, sources, tuple(skipped))
        skipped.append((step, f"no tier holds a good part of ranks {_ranges(lost)}"))
    return Plan(None, {}, tuple(skipped))


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``: short enough for a log line at any world size."""
    out: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(out)
