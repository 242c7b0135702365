"""Messages between agents: replicas pushed to peers, and fetched (whole, by parity or by
range) by restoring workers, with their replies. Part of :mod:`tierswap.control.protocol`,
which carries them as ``AgentToAgent``."""

from __future__ import annotations

import msgspec

from tierswap.control.message import Message, Tree
from tierswap.layout import Layout


class Replica(Message, frozen=True, kw_only=True, tag="replica"):
    """A full replica follows (``layout.nbytes`` raw bytes after a Room reply)."""

    rank: int
    step: int
    layout: Layout
    tree: Tree
    checksum: str


class ReplicaDelta(Message, frozen=True, kw_only=True, tag="replica_delta"):
    """A delta against ``base_step`` follows (``nbytes`` raw bytes after Room)."""

    rank: int
    step: int
    base_step: int
    base_checksum: str
    base_durable: str | None
    nbytes: int
    tree: Tree
    checksum: str


class Fetch(Message, frozen=True, kw_only=True, tag="fetch"):
    """A restoring worker asks a peer for its replica of ``step``."""

    scoped = False
    rank: int
    step: int


class Room(Message, frozen=True, kw_only=True, tag="room"):
    """Whether the peer takes the bytes; ``need`` "base": send the base first."""

    scoped = False
    ok: bool
    need: str = ""


class Accepted(Message, frozen=True, kw_only=True, tag="accepted"):
    """The bytes arrived and their checksum matched (``ok``)."""

    scoped = False
    ok: bool


class Serving(Message, frozen=True, kw_only=True, tag="serving"):
    """The replica follows as ``layout.nbytes`` raw bytes."""

    scoped = False
    layout: Layout
    tree: Tree
    checksum: str


class ParityMember(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's stripe in a parity: which stripe, where it lies in the rank's snapshot
    (stripe ``stripe`` starts at ``stripe * unit``), and what the whole snapshot is."""

    rank: int
    stripe: int
    nbytes: int
    """Bytes of the stripe (the last one of a snapshot may be shorter than ``unit``)."""
    unit: int
    layout: Layout
    tree: Tree
    checksum: str
    """Of the rank's whole snapshot (its layout's chunks): a rebuilt one is checked."""


class ParityPart(Message, frozen=True, kw_only=True, tag="parity_part"):
    """A stripe of ``member.rank``'s snapshot of ``step`` for the parity the peer holds
    (``member.nbytes`` raw bytes follow a Room reply), its own checksum beside it."""

    member: ParityMember
    step: int
    stripe_checksum: str


class FetchParity(Message, frozen=True, kw_only=True, tag="fetch_parity"):
    """A rebuilding worker asks a peer for the parity ``key`` of ``step``."""

    scoped = False
    key: int
    step: int


class ParityServing(Message, frozen=True, kw_only=True, tag="parity_serving"):
    """The parity follows as ``nbytes`` raw bytes; ``members`` are the stripes in it."""

    scoped = False
    nbytes: int
    checksum: str
    members: list[ParityMember]


class FetchRange(Message, frozen=True, kw_only=True, tag="fetch_range"):
    """A rebuilding worker asks a node for bytes of one of its ranks' tier-0 snapshots."""

    scoped = False
    rank: int
    step: int
    start: int
    nbytes: int


class Ranged(Message, frozen=True, kw_only=True, tag="ranged"):
    """The asked bytes of a tier-0 snapshot follow, raw."""

    scoped = False
    nbytes: int


class Missing(Message, frozen=True, kw_only=True, tag="missing"):
    scoped = False
    why: str = "the peer no longer holds it"
