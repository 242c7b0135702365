"""The records of where a rank's step comes from, and the messages between a worker and
its agent (``WorkerToAgent``, ``AgentToWorker``): its requests, their replies, and the
control messages a parked or training worker is sent. Part of
:mod:`tierswap.control.protocol`, which carries them on those channels and names them all."""

from __future__ import annotations

import msgspec

from tierswap.control.message import Address, Message, Tree
from tierswap.layout import Layout
from tierswap.tiers.durable import PartInfo

# ==================================================================== shared records


class FromMemory(msgspec.Struct, frozen=True, kw_only=True, tag="memory"):
    """A rank restores from its own node's tier 0 (the agent turns this into a slot)."""


class FromPeer(msgspec.Struct, frozen=True, kw_only=True, tag="peer"):
    """A rank restores from the replica a peer node holds in its memory."""

    node: int
    address: Address


class FromDurable(msgspec.Struct, frozen=True, kw_only=True, tag="durable"):
    """A rank restores from its part in tier 2 (checked against COMMIT's checksums)."""

    root: str
    part: PartInfo


class FromSlot(msgspec.Struct, frozen=True, kw_only=True, tag="slot"):
    """The agent's answer for a tier-0 source: the leased slot to read."""

    segment: str
    layout: Layout
    tree: Tree
    checksum: str


class FromParity(msgspec.Struct, frozen=True, kw_only=True, tag="parity"):
    """A rank restores by rebuilding its snapshot from tier-1 parity (``--peer-parity``):
    each stripe from the parity a peer of its group holds, XORed with the stripes the
    set's other ranks hold in their own tier 0."""

    keys: list[int]
    """The parity holding each of its stripes, in stripe order."""
    holders: list[Address]
    """Where each of those is held (the holder node's replica server)."""
    members: dict[int, Address]
    """The set's other ranks -> the replica server of the node whose tier 0 holds them."""


Source = FromMemory | FromPeer | FromDurable | FromParity
WorkerSource = FromSlot | FromPeer | FromDurable | FromParity


class InitFrom(msgspec.Struct, frozen=True, kw_only=True):
    """No tier holds a step of the job: load this DCP checkpoint first (``--init-from``)."""

    path: str
    step: int | None = None
    """The step it holds; None reads its saved ``step`` value."""
    world_size: int | None = None
    """Set: ``path`` is the job's own tier-2 root, whose ``step`` was written by a job of
    this world size (a resume at another size). None: a DCP folder (``--init-from``)."""


class RankPlan(msgspec.Struct, frozen=True, kw_only=True):
    """Where one rank loads its state from at the start of a generation."""

    step: int | None
    """None: nothing to restore, the rank starts at step 0."""
    source: Source | None = None

    @property
    def tier(self) -> int | None:
        return _tier_of(self.source)


def _tier_of(source: object) -> int | None:
    if isinstance(source, FromMemory | FromSlot):
        return 0
    if isinstance(source, FromPeer | FromParity):
        return 1
    if isinstance(source, FromDurable):
        return 2
    return None


# ==================================================================== worker -> agent


class Alloc(Message, frozen=True, kw_only=True, tag="alloc"):
    """A rank's state has a new layout: its tier-0 slots for it."""

    call = True
    rank: int
    layout: Layout


class SlotRequest(Message, frozen=True, kw_only=True, tag="slot"):
    """A slot to write the snapshot of ``step`` into (None in the reply: skip it)."""

    call = True
    rank: int
    step: int
    alloc: int
    retry: bool = False
    """The worker asks again if refused (the last step of a job waits for a slot): a
    refusal is not a skip yet."""
    wait: bool = True
    """While the ring's slots are still being made, a refusal is ``filling`` (the worker
    asks again), not a skip; False once the worker gave up waiting: then it is a skip."""


class Written(Message, frozen=True, kw_only=True, tag="written"):
    """The worker copied ``step`` into ``slot`` (and checksummed it as it copied)."""

    rank: int
    step: int
    slot: int
    alloc: int
    tree: Tree
    stall: float
    """Seconds this rank's loop waited for the copy of its last step."""
    gate: float = 0.0
    """The part of ``stall`` its optimizer step waited for tier 1 (``--max-redo``)."""
    checksum: str = ""
    """xxh3 of the slot's tensor bytes, hashed by the copy as it wrote them (one pass per
    byte); empty: the agent reads the slot to compute it."""


class PlanRequest(Message, frozen=True, kw_only=True, tag="plan"):
    """Where to restore from, in this generation."""

    call = True
    rank: int


class Restored(Message, frozen=True, kw_only=True, tag="restored"):
    rank: int
    step: int
    tier: int
    seconds: float
    live: bool = False
    """Tier 0's step was taken from the state the rank trained, proven equal to the slot
    by its checksum (``live.py``): nothing was read."""


class Initialized(Message, frozen=True, kw_only=True, tag="initialized"):
    """A rank loaded the job's ``--init-from`` checkpoint, which holds ``step``."""

    rank: int
    step: int
    missing: list[str]
    """Keys of its state the checkpoint lacks: left as built."""
    seconds: float


class Report(Message, frozen=True, kw_only=True, tag="report"):
    """A rank's metrics of a step (``job.report``), or with ``total`` its step count."""

    rank: int
    step: int
    metrics: dict[str, float] = {}
    total: int | None = None
    stall: float = 0.0


class Finished(Message, frozen=True, kw_only=True, tag="finished"):
    """A rank ran its last step; its state is snapshotted."""

    call = True
    rank: int
    step: int


class Joined(Message, frozen=True, kw_only=True, tag="joined"):
    """A rank joined its generation's process group."""

    rank: int
    pid: int
    seconds: float


class Stepped(Message, frozen=True, kw_only=True, tag="stepped"):
    """A rank completed its first step of the generation."""

    rank: int
    step: int
    phases: dict[str, float] = {}
    """Seconds this rank spent on the way there, part by part (``Job.timeline``)."""


class Fatal(Message, frozen=True, kw_only=True, tag="fatal"):
    """A usage error in the script: the job stops (a restart would fail the same way)."""

    call = True
    rank: int
    message: str


class Raised(Message, frozen=True, kw_only=True, tag="raised"):
    """``train(job)`` raised ``error`` (its type and first line) in ``step`` (-1: before
    ``job.steps`` gave it one): the worker exits, a failure like any other, unless the same
    error comes again in the same step (:func:`tierswap.control.failures.raised`)."""

    call = True
    rank: int
    step: int
    error: str


class Corrupt(Message, frozen=True, kw_only=True, tag="corrupt"):
    """A rank's restore source failed its check; the part is marked bad."""

    call = True
    rank: int
    where: str
    why: str
    step: int | None
    tier: int | None


class InjectFired(Message, frozen=True, kw_only=True, tag="inject_fired"):
    """A rank carries out an injected fault now (it kills or stops itself next)."""

    call = True
    rank: int
    spec: str


class Lagging(Message, frozen=True, kw_only=True, tag="lagging"):
    """A rank's optimizer step gave up waiting for tier 1 (a bug: logged)."""

    rank: int
    step: int
    seconds: float


class Attach(Message, frozen=True, kw_only=True, tag="attach"):
    """A worker's control connection is up: it is parked, ready for a rank."""

    scoped = False
    local: int
    incarnation: int
    """Which process started in that place (its agent's count)."""
    pid: int


class Parked(Message, frozen=True, kw_only=True, tag="parked"):
    """A worker left ``generation`` and waits for the next one."""

    scoped = False
    generation: int
    rank: int
    reason: str
    """"ended" (told to leave), "collective" (a collective failed under it), "corrupt"
    (its restore source was bad)."""
    why: str


class Beat(Message, frozen=True, kw_only=True, tag="beat"):
    """A heartbeat: the sender is alive (workers to agents, agents to the coordinator)."""

    scoped = False


# ==================================================================== agent -> worker


class Ack(Message, frozen=True, kw_only=True, tag="ack"):
    scoped = False


class Error(Message, frozen=True, kw_only=True, tag="error"):
    """A request failed; the message says why."""

    scoped = False
    message: str


class Allocated(Message, frozen=True, kw_only=True, tag="allocated"):
    scoped = False
    alloc: int
    segments: list[str]


class SlotGranted(Message, frozen=True, kw_only=True, tag="slot_granted"):
    scoped = False
    slot: int | None
    filling: bool = False
    """No slot now, but the ring's slots are still being made: ask again soon (not a
    skip)."""


class PlanReply(Message, frozen=True, kw_only=True, tag="plan_reply"):
    scoped = False
    step: int | None
    source: WorkerSource | None = None
    init: InitFrom | None = None
    """With no step: the checkpoint to start from, if the job was given one."""

    @property
    def tier(self) -> int | None:
        return _tier_of(self.source)


class Assign(Message, frozen=True, kw_only=True, tag="assign"):
    """A parked worker's rank in a generation (the envelope's)."""

    scoped = False

    rank: int
    local_rank: int
    """Its index among the ranks on its machine (the GPU it uses: ``job.device``)."""
    local_world_size: int
    node: int
    """The node it serves (torchrun's ``GROUP_RANK``)."""
    world_size: int
    store: str
    backend: str
    inject: list[str]
    max_redo: int
    settled: int
    """The newest step tier 1 is done with, at the start."""


class Settled(Message, frozen=True, kw_only=True, tag="settled"):
    """Tier 1 is done with ``step`` (committed, or it never will be): optimizer steps
    waiting for it (``--max-redo``) go on."""

    step: int


class Reserve(Message, frozen=True, kw_only=True, tag="reserve"):
    """To a parked worker: fault in ``nbytes`` of private memory ahead, the largest state
    of a rank it may be given, so that a restore reads into memory that is ready and
    the restored state keeps it (0: hold none); and map the node's tier-0 slots
    ``slots`` (segment names) ahead, read-only with their page tables filled, so that a
    restore from one of them reads at once (a list drops the mappings it no longer
    names)."""

    scoped = False
    nbytes: int
    slots: tuple[str, ...] = ()


class Abort(Message, frozen=True, kw_only=True, tag="abort"):
    """The generation ends: leave ``train(job)`` and park."""


class Exit(Message, frozen=True, kw_only=True, tag="exit"):
    """The job is over: exit, with the job's exit code (a multi-host launch's agents exit
    with it, as its coordinator's launcher does)."""

    scoped = False
    code: int = 0
