"""What an agent's core is told (events) and asks its shell to do (commands).

The core (``control/agent.py``) keeps the node's bookkeeping: workers, tier-0 rings, the
replicas it holds, what to replicate and persist. Its shell (``cluster/agent.py``) owns
the processes, sockets and threads: it spawns and kills workers, checksums slots, sends
replicas and writes tier-2 parts on its pools, and feeds each result back as an event.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tierswap.control import protocol as p
from tierswap.control.workers import Kill, Spawn, Tell
from tierswap.layout import Layout
from tierswap.shm import Segment
from tierswap.tiers.durable import PartInfo
from tierswap.tiers.durable_deltas import Part
from tierswap.tiers.memory import Slot

# ==================================================================== events


@dataclass(frozen=True, slots=True)
class Boot:
    """The agent starts: its first workers are spawned."""


@dataclass(frozen=True, slots=True)
class FromCoordinator:
    env: p.Envelope[Any]


@dataclass(frozen=True, slots=True)
class CoordinatorClosed:
    """The coordinator's connection closed: the job is over for this host."""


@dataclass(frozen=True, slots=True)
class Rejoined:
    """This host reconnected to a coordinator that took the job over
    (``--rdzv-backend etcd``): what it said that may have gone to the old one is said
    again."""


@dataclass(frozen=True, slots=True)
class FromWorker:
    conn: int
    env: p.Envelope[Any]
    at: float
    """When it arrived (heartbeats)."""


@dataclass(frozen=True, slots=True)
class WorkerExited:
    local: int
    incarnation: int
    code: int


@dataclass(frozen=True, slots=True)
class Checked:
    """A slot's checksum is computed (or, with ``error``, could not be)."""

    rank: int
    step: int
    slot: Slot
    checksum: str
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Sent:
    """What a replica cost (delta mode)."""

    kind: str
    nbytes: int
    full: int
    encode_s: float


@dataclass(frozen=True, slots=True)
class Replicated:
    """A replica transfer of ``step`` ended (each peer's failure was its own event)."""

    rank: int
    step: int
    slot: Slot
    generation: int
    sent: Sent | None = None


@dataclass(frozen=True, slots=True)
class ReplicationFailed:
    rank: int
    step: int
    peer: int | None
    """None: a base to tier 2."""
    error: str
    generation: int
    cut: bool = False
    """The connection failed (the peer may be dying), not the encoding."""


@dataclass(frozen=True, slots=True)
class PartWritten:
    """A tier-2 part is written (``part``) or failed (``error``)."""

    rank: int
    step: int
    token: int
    slot: Slot
    part: PartInfo | None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Ask:
    """A replica-server thread asks the loop (room for a replica, a lease to serve one);
    ``answer(value, error)`` hands the result back to it."""

    op: str
    fields: dict[str, Any]
    answer: Callable[[Any, BaseException | None], None]


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed: silent and overdue workers are dealt with."""


@dataclass(frozen=True, slots=True)
class SegmentMade:
    """A slot of a tier's ring (0: a rank of this node, 1: a replica held for a peer's
    rank) was made off the loop (``MakeSegment``): ``segment``, or ``error`` saying why
    not."""

    tier: int
    rank: int
    alloc: int
    index: int
    segment: Segment | None
    error: str = ""


@dataclass(frozen=True, slots=True)
class WarmRefused:
    """Segments a spare was told to make ahead were not made (``why``)."""

    why: str


AgentEvent = (
    Boot
    | FromCoordinator
    | CoordinatorClosed
    | Rejoined
    | FromWorker
    | WorkerExited
    | Checked
    | Replicated
    | ReplicationFailed
    | PartWritten
    | Ask
    | Tick
    | SegmentMade
    | WarmRefused
)


# ==================================================================== commands


@dataclass(frozen=True, slots=True)
class ToCoordinator:
    msg: p.Message
    gen: int


@dataclass(frozen=True, slots=True)
class Reply:
    """An answer on a worker's request connection."""

    conn: int
    msg: p.Message
    gen: int


@dataclass(frozen=True, slots=True)
class Checksum:
    rank: int
    step: int
    slot: Slot
    layout: Layout


@dataclass(frozen=True, slots=True)
class Replicate:
    """Send ``slot`` (leased) of ``rank`` to its peers; ``Replicated`` when done."""

    rank: int
    step: int
    slot: Slot
    layout: Layout
    generation: int


@dataclass(frozen=True, slots=True)
class ConfigureReplication:
    """A generation starts from ``restart``: where each rank's replicas go, and how."""

    targets: dict[int, tuple[int, ...]]
    addresses: dict[int, p.Address]
    generation: int
    restart: int
    delay: float
    """Seconds each transfer is held (an injected slow network)."""
    announce: bool
    """Tell the coordinator as each transfer starts (an injection waits for one)."""
    world_size: int = 0
    """The job's size in this generation (fewer while shrunk): what a base written to
    tier 2 records."""


@dataclass(frozen=True, slots=True)
class WritePart:
    part: Part
    bases: dict[int, dict[int, str]]
    delay: float = 0.0
    """Seconds to wait first (``slow:persist`` fault injection: slow storage)."""


@dataclass(frozen=True, slots=True)
class AnswerAsk:
    answer: Callable[[Any, BaseException | None], None]
    value: Any
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class MakeSegment:
    """Make a ring's slot on a thread (``name``, ``nbytes``); ``SegmentMade`` when done."""

    tier: int
    rank: int
    alloc: int
    index: int
    name: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class WarmSegments:
    """Hold shared-memory segments of these sizes, made ahead (``SegmentPool.warm``);
    empty frees those not taken."""

    sizes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Shutdown:
    """The job is over (or the coordinator is gone): release everything and exit."""


AgentCommand = (
    ToCoordinator
    | Reply
    | Tell
    | Spawn
    | Kill
    | Checksum
    | Replicate
    | ConfigureReplication
    | WritePart
    | AnswerAsk
    | MakeSegment
    | WarmSegments
    | Shutdown
)
