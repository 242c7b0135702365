"""Every message of the control plane, one typed record each, grouped by channel.

A message is a frozen, slotted, keyword-only ``msgspec.Struct`` (a dataclass that mypy
checks field by field and that msgspec validates in C as it decodes); its tag names it on
the wire, and a name means one thing whichever channel carries it. Messages travel in an
:class:`Envelope` that carries the sender's generation, so that messages of an ended
generation are dropped at one door (:class:`Door`), with a counter.

Channels (the unions below): worker -> agent (``WorkerToAgent``: requests on the worker's
request connection, attach / parked / beat on its control connection), agent -> worker
(``AgentToWorker``: replies and the control messages), agent -> coordinator
(``AgentToCoordinator``), coordinator -> agent (``CoordinatorToAgent``) and agent <-> agent
(``AgentToAgent``: replicas pushed to peers and fetched by restoring workers, and their
replies), worker <-> store (``WorkerToStore``, ``StoreToWorker``: the rendezvous store's
operations and their replies), agent <-> worker template (``AgentToTemplate``,
``TemplateToAgent``: a worker forked, and its exit). The wire is msgpack (``tierswap
bench control-plane`` measures it against JSON), never pickle. Some messages are defined in
modules of their own and named here too: a worker's with its agent (some of which the
agent passes on to the coordinator as they are) and the records of where a rank's step
comes from in ``worker_protocol.py``, the agents' in ``peer_protocol.py``, the store's in
``store_protocol.py``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, get_args

import msgspec

from tierswap.control.message import Address as Address
from tierswap.control.message import Envelope as Envelope
from tierswap.control.message import M as M
from tierswap.control.message import Message as Message
from tierswap.control.message import Tree as Tree
from tierswap.control.peer_protocol import Accepted as Accepted
from tierswap.control.peer_protocol import Fetch as Fetch
from tierswap.control.peer_protocol import FetchParity as FetchParity
from tierswap.control.peer_protocol import FetchRange as FetchRange
from tierswap.control.peer_protocol import Missing as Missing
from tierswap.control.peer_protocol import ParityMember as ParityMember
from tierswap.control.peer_protocol import ParityPart as ParityPart
from tierswap.control.peer_protocol import ParityServing as ParityServing
from tierswap.control.peer_protocol import Ranged as Ranged
from tierswap.control.peer_protocol import Replica as Replica
from tierswap.control.peer_protocol import ReplicaDelta as ReplicaDelta
from tierswap.control.peer_protocol import Room as Room
from tierswap.control.peer_protocol import Serving as Serving
from tierswap.control.store_protocol import StoreAdd as StoreAdd
from tierswap.control.store_protocol import StoreCheck as StoreCheck
from tierswap.control.store_protocol import StoreCompareSet as StoreCompareSet
from tierswap.control.store_protocol import StoreCount as StoreCount
from tierswap.control.store_protocol import StoreDelete as StoreDelete
from tierswap.control.store_protocol import StoreFlag as StoreFlag
from tierswap.control.store_protocol import StoreGet as StoreGet
from tierswap.control.store_protocol import StoreNumber as StoreNumber
from tierswap.control.store_protocol import StoreSet as StoreSet
from tierswap.control.store_protocol import StoreValue as StoreValue
from tierswap.control.store_protocol import StoreWait as StoreWait
from tierswap.control.worker_protocol import Abort as Abort
from tierswap.control.worker_protocol import Ack as Ack
from tierswap.control.worker_protocol import Alloc as Alloc
from tierswap.control.worker_protocol import Allocated as Allocated
from tierswap.control.worker_protocol import Assign as Assign
from tierswap.control.worker_protocol import Attach as Attach
from tierswap.control.worker_protocol import Beat as Beat
from tierswap.control.worker_protocol import Corrupt as Corrupt
from tierswap.control.worker_protocol import Error as Error
from tierswap.control.worker_protocol import Exit as Exit
from tierswap.control.worker_protocol import Fatal as Fatal
from tierswap.control.worker_protocol import Finished as Finished
from tierswap.control.worker_protocol import FromDurable as FromDurable
from tierswap.control.worker_protocol import FromMemory as FromMemory
from tierswap.control.worker_protocol import FromParity as FromParity
from tierswap.control.worker_protocol import FromPeer as FromPeer
from tierswap.control.worker_protocol import FromSlot as FromSlot
from tierswap.control.worker_protocol import InitFrom as InitFrom
from tierswap.control.worker_protocol import Initialized as Initialized
from tierswap.control.worker_protocol import InjectFired as InjectFired
from tierswap.control.worker_protocol import Joined as Joined
from tierswap.control.worker_protocol import Lagging as Lagging
from tierswap.control.worker_protocol import Parked as Parked
from tierswap.control.worker_protocol import PlanReply as PlanReply
from tierswap.control.worker_protocol import PlanRequest as PlanRequest
from tierswap.control.worker_protocol import Raised as Raised
from tierswap.control.worker_protocol import RankPlan as RankPlan
from tierswap.control.worker_protocol import Report as Report
from tierswap.control.worker_protocol import Reserve as Reserve
from tierswap.control.worker_protocol import Restored as Restored
from tierswap.control.worker_protocol import Settled as Settled
from tierswap.control.worker_protocol import SlotGranted as SlotGranted
from tierswap.control.worker_protocol import SlotRequest as SlotRequest
from tierswap.control.worker_protocol import Source as Source
from tierswap.control.worker_protocol import Stepped as Stepped
from tierswap.control.worker_protocol import WorkerSource as WorkerSource
from tierswap.control.worker_protocol import Written as Written
from tierswap.tiers.durable import PartInfo

# ==================================================================== agent -> coordinator


class Hello(Message, frozen=True, kw_only=True, tag="hello"):
    """A host connected; ``host`` is the id it was started with: a simulated host's, the
    node a host of a multi-host launch asked for (``--node-rank``), or -1 (any)."""

    scoped = False
    host: int
    pid: int
    spare: bool = False
    """It parks as a spare whatever nodes are free (``--join``, ``--spare``)."""
    nodes: int = 0
    """The ``--nnodes`` it was started with, 0 where none was given (``--join``)."""
    nproc_per_node: int = 0
    job: str | None = None
    """Its ``--rdzv-id``."""
    tag: str = ""
    """A random name its launcher gave it (pids repeat across machines, containers)."""
    rejoin: bool = False
    """An agent that served this job under a coordinator now gone, reconnecting to the
    one that took over (``--rdzv-backend etcd``): ``host`` is the id it had."""


class Ready(Message, frozen=True, kw_only=True, tag="ready"):
    """A host's agent runs and every worker it started with is parked."""

    scoped = False
    replica: Address
    """Where its replica server listens."""
    workers: list[int]


class Held(Message, frozen=True, kw_only=True, tag="held"):
    """This node holds ``step`` in ``tier`` for every rank it has there (tier 0: its own
    ranks; tier 1: the ranks it protects) and keeps it until the coordinator commits it
    or a newer step, or releases it. One step per tier is held this way at a time."""

    tier: int
    step: int


class Unheld(Message, frozen=True, kw_only=True, tag="unheld"):
    """This node no longer holds the step it held in ``tier`` (its slots were made anew
    for another layout of the state): do not count it for a commit."""

    tier: int
    step: int


class Progress(Message, frozen=True, kw_only=True, tag="progress"):
    """The newest step any rank of this node wrote; ``stall`` is rank 0's, where it runs,
    and ``gate`` the part of it that waited for tier 1."""

    step: int
    stall: float | None
    gate: float | None = None


class Stopped(Message, frozen=True, kw_only=True, tag="stopped"):
    """Every worker of the ended generation has parked (or died): what the rings hold."""

    holdings: dict[int, dict[int, str]]
    """rank -> step -> checksum in this node's tier 0."""
    peer: dict[int, dict[int, str]]
    """rank -> step -> checksum of the replicas this node holds for others."""
    peer_deltas: dict[int, dict[int, str]]
    """rank -> step -> "delta" or "delta+durable" for replicas held as deltas."""
    verified: list[int] | None
    """The ranks whose replicas were read again first (None: every rank's): a report that
    does not cover what the stops of this recovery asked is an earlier one, crossed."""


def ranks_union(a: list[int] | None, b: list[int] | None) -> list[int] | None:
    """The ranks two stops ask to read again, together (None: every rank)."""
    return None if a is None or b is None else sorted({*a, *b})


def covers(verified: list[int] | None, asked: list[int] | None) -> bool:
    """Whether a report made after reading ``verified`` again answers stops that asked
    for ``asked`` (None: every rank)."""
    if verified is None:
        return True
    return asked is not None and set(asked) <= set(verified)


class Exited(Message, frozen=True, kw_only=True, tag="exited"):
    """A worker running a rank of this generation died."""

    rank: int
    code: int


class Left(Message, frozen=True, kw_only=True, tag="left"):
    """A worker left its generation by itself."""

    rank: int
    reason: str
    why: str


class Hung(Message, frozen=True, kw_only=True, tag="hung"):
    """A worker was silent past its lease, or did not leave in time: killed."""

    rank: int
    pid: int
    why: str


class StartFailed(Message, frozen=True, kw_only=True, tag="start_failed"):
    """A worker exited before it ever attached: the script itself fails."""

    scoped = False
    local: int
    code: int


class SpareWorkerExited(Message, frozen=True, kw_only=True, tag="spare_worker_exited"):
    scoped = False
    local: int
    code: int


class ExitedAfterFinish(Message, frozen=True, kw_only=True, tag="exited_after_finish"):
    """A worker that had finished its steps exited with an error (logged only)."""

    scoped = False
    rank: int
    code: int


class Paused(Message, frozen=True, kw_only=True, tag="paused"):
    """The agent did not run for ``seconds`` (SIGSTOP, a suspended VM): it renewed its
    workers' leases rather than take them for hung."""

    scoped = False
    seconds: float


class PeerMemoryExceeded(Message, frozen=True, kw_only=True, tag="peer_memory_exceeded"):
    scoped = False
    rank: int
    need: int
    limit: int
    ranks: list[int]


class Parts(Message, frozen=True, kw_only=True, tag="parts"):
    """This node's parts of a tier-2 step, written (``parts``) or failed (``errors``)."""

    token: int
    step: int
    parts: list[PartInfo]
    errors: dict[int, str]


class Replicating(Message, frozen=True, kw_only=True, tag="replicating"):
    """A replica transfer starts (sent only when an injection waits for one)."""

    rank: int
    step: int
    peer: int


class ReplicaSent(Message, frozen=True, kw_only=True, tag="replica_sent"):
    """Delta mode: what a replica cost to send, against a full snapshot."""

    scoped = False
    rank: int
    step: int
    kind: str
    nbytes: int
    full: int
    encode_s: float


class ReplicaServed(Message, frozen=True, kw_only=True, tag="replica_served"):
    scoped = False
    rank: int
    step: int
    kind: str
    base_step: int


class ReplicaBaseLost(Message, frozen=True, kw_only=True, tag="replica_base_lost"):
    scoped = False
    rank: int
    step: int
    kept: list[int]


CUT_OFF = "transfer cut off"
"""The ``why`` of a :class:`ReplicaRejected` whose bytes stopped coming: its sender may
be dying, and the coordinator gives it time to hear of that (``settling.doubt``)."""


class ReplicaRejected(Message, frozen=True, kw_only=True, tag="replica_rejected"):
    """A replica of ``step`` (sent in the envelope's generation) is not held here."""

    rank: int
    step: int
    why: str


class ReplicateFailed(Message, frozen=True, kw_only=True, tag="replicate_failed"):
    """A replica of ``step`` did not reach ``peer`` (None: a base to tier 2); ``cut``: the
    connection failed, so the peer may be dying (``settling.doubt``)."""

    rank: int
    step: int
    peer: int | None
    error: str
    cut: bool = False


class Skipped(Message, frozen=True, kw_only=True, tag="skipped"):
    """A rank's snapshot of ``step`` was skipped (no tier-0 slot was free), or written over
    by the next one before its node held it for a commit (every other slot was kept)."""

    rank: int
    step: int


class AgentError(Message, frozen=True, kw_only=True, tag="agent_error"):
    scoped = False
    rank: int
    request: str
    error: str


class Memory(Message, frozen=True, kw_only=True, tag="memory"):
    """Bytes a tier holds on this node, for a rank or (``scope`` "node") in all."""

    scoped = False
    rank: int
    tier: int
    nbytes: int
    scope: str = "rank"
    segments: list[int] = []
    """Sizes of the shared-memory segments a rank's ring is made of: what a parked spare
    makes ahead (``Warm``)."""


# ==================================================================== coordinator -> agent


class Welcome(Message, frozen=True, kw_only=True, tag="welcome"):
    scoped = False
    host: int
    config: dict[str, str]
    job_id: str
    script: list[str]


class Refused(Message, frozen=True, kw_only=True, tag="refused"):
    """The coordinator does not take this host; ``why`` says why and what to change."""

    scoped = False
    why: str


class Start(Message, frozen=True, kw_only=True, tag="start"):
    """A generation (the envelope's) starts: this host serves ``node``."""

    node: int
    world_size: int
    ranks: list[int]
    store: str
    backend: str
    plans: dict[int, RankPlan]
    inject: list[str]
    restart_step: int
    committed: tuple[int, int]
    """The newest step committed in tiers 0 and 1 at the start."""
    max_redo: int
    placement: dict[int, list[int]]
    """rank -> the nodes holding its replicas, for this node's ranks."""
    protects: list[int]
    """The ranks this node holds replicas of (with ``--peer-parity``, the keys of the
    parities it holds)."""
    peers: dict[int, Address]
    init: InitFrom | None = None
    """No tier holds a step: the ranks start from this checkpoint (``--init-from``)."""
    parity: dict[int, list[int]] = {}
    """``--peer-parity``: each parity this node holds (by key) -> the ranks whose stripes
    it is the XOR of."""


class Stop(Message, frozen=True, kw_only=True, tag="stop"):
    """End the generation: the workers leave ``train(job)``; then report Stopped."""

    verify: list[int] | None = None
    """The ranks whose full replicas and parities held here are read again before the
    node reports them: those of a lost node, whose restore may read them from here
    (``None``: every one, when the coordinator cannot tell). Delta replicas are read
    again at every stop."""


class Committed(Message, frozen=True, kw_only=True, tag="committed"):
    """``step`` is committed in ``tier`` on every rank (tier 1: it is also settled)."""

    tier: int
    step: int


class Warm(Message, frozen=True, kw_only=True, tag="warm"):
    """To a parked spare host: make shared-memory segments of these sizes ahead, those
    a node of the job holds (its ranks' tier-0 slots and the tier-1 rings of the ranks it
    protects), so that taking over a node allocates none. Empty: free them."""

    scoped = False
    segments: list[int]


class Release(Message, frozen=True, kw_only=True, tag="release"):
    """``step`` held in ``tier`` can never be committed: let it go, hold a newer one."""

    tier: int
    step: int


class Persist(Message, frozen=True, kw_only=True, tag="persist"):
    """Write this node's parts of ``step`` (committed in tier 0) to tier 2."""

    step: int
    root: str
    world_size: int
    token: int
    bases: dict[int, dict[int, str]]
    """step -> rank -> data checksum of full parts in tier 2 (``--persist-deltas``)."""
    replicas: dict[int, int] = {}
    """rank -> node: ranks of lost nodes whose parts that node writes from the replica it
    holds (before the job shrinks, so that it goes on from the newest step)."""


# ==================================================================== the worker template


class Fork(Message, frozen=True, kw_only=True, tag="fork"):
    """Start a worker as a fork of this machine's worker template (``cluster/template.py``):
    ``argv`` (a script and its arguments) runs as ``__main__`` in ``cwd`` with exactly
    ``env``, in process group ``pgid`` (the asking agent's: killing the host kills it), on
    ``cpus`` where given."""

    scoped = False
    key: int
    """The asking agent's name for this worker, in the replies."""
    argv: list[str]
    env: dict[str, str]
    cwd: str
    pgid: int
    cpus: list[int] = []


class Forked(Message, frozen=True, kw_only=True, tag="forked"):
    """Worker ``key`` runs as process ``pid``, started at ``start`` (clock ticks after
    boot, ``/proc/PID/stat``'s 22nd field): with the pid, which process it is, so that the
    agent's kill never reaches a process that took the pid after the worker was reaped."""

    scoped = False
    key: int
    pid: int
    start: int


class ForkRefused(Message, frozen=True, kw_only=True, tag="fork_refused"):
    """Worker ``key`` was not started: the agent starts it as a process of its own."""

    scoped = False
    key: int
    why: str


class Reaped(Message, frozen=True, kw_only=True, tag="reaped"):
    """Worker ``key`` exited: ``code`` as ``subprocess`` gives it (``-N``: signal N)."""

    scoped = False
    key: int
    code: int


# ==================================================================== the channels

WorkerToAgent = (
    Alloc
    | SlotRequest
    | Written
    | PlanRequest
    | Restored
    | Initialized
    | Report
    | Finished
    | Joined
    | Stepped
    | Fatal
    | Raised
    | Corrupt
    | InjectFired
    | Lagging
    | Attach
    | Parked
    | Beat
)
AgentToWorker = (
    Ack | Error | Allocated | SlotGranted | PlanReply | Assign | Settled | Reserve | Abort | Exit
)
AgentToCoordinator = (
    Hello
    | Ready
    | Beat
    | Held
    | Unheld
    | Progress
    | Stopped
    | Exited
    | Left
    | Hung
    | StartFailed
    | SpareWorkerExited
    | ExitedAfterFinish
    | Paused
    | PeerMemoryExceeded
    | Parts
    | Replicating
    | ReplicaSent
    | ReplicaServed
    | ReplicaBaseLost
    | ReplicaRejected
    | ReplicateFailed
    | Skipped
    | AgentError
    | Memory
    | Restored
    | Initialized
    | Report
    | Finished
    | Joined
    | Stepped
    | Fatal
    | Raised
    | Corrupt
    | InjectFired
    | Lagging
)
CoordinatorToAgent = (
    Welcome | Refused | Start | Stop | Committed | Release | Settled | Persist | Warm | Exit
)
AgentToAgent = (
    Replica
    | ReplicaDelta
    | Fetch
    | Room
    | Accepted
    | Serving
    | Missing
    | ParityPart
    | FetchParity
    | ParityServing
    | FetchRange
    | Ranged
    | Error
)

WorkerToStore = (
    StoreSet
    | StoreGet
    | StoreAdd
    | StoreCompareSet
    | StoreWait
    | StoreCheck
    | StoreDelete
    | StoreCount
)
StoreToWorker = StoreValue | StoreNumber | StoreFlag | Ack | Error
AgentToTemplate = Fork
TemplateToAgent = Forked | ForkRefused | Reaped


def members(channel: Any) -> tuple[type[Message], ...]:
    """The message classes of a channel (a union, or one class)."""
    return get_args(channel) or (channel,)


CHANNELS: dict[str, Any] = {
    "worker -> agent": WorkerToAgent,
    "agent -> worker": AgentToWorker,
    "agent -> coordinator": AgentToCoordinator,
    "coordinator -> agent": CoordinatorToAgent,
    "agent <-> agent": AgentToAgent,
    "worker -> store": WorkerToStore,
    "store -> worker": StoreToWorker,
    "agent -> template": AgentToTemplate,
    "template -> agent": TemplateToAgent,
}


# ==================================================================== the codec


class ProtocolError(ValueError):
    """Bytes that are not a message of the channel (malformed, unknown tag, bad field)."""


class Codec:
    """Encode any message; decode the messages of one channel (a union of classes)."""

    _encoder = msgspec.msgpack.Encoder()

    def __init__(self, incoming: Any) -> None:
        self.incoming = incoming
        self._decoder: msgspec.msgpack.Decoder[Envelope[Any]] = msgspec.msgpack.Decoder(
            Envelope[incoming]
        )

    @classmethod
    def encode(cls, msg: Message, gen: int) -> bytes:
        return cls._encoder.encode(Envelope(gen, msg))

    def decode(self, data: bytes | bytearray | memoryview) -> Envelope[Any]:
        try:
            return self._decoder.decode(data)
        except (msgspec.DecodeError, ValueError) as e:  # a ValidationError; bad UTF-8
            raise ProtocolError(f"not a message of this channel: {e}") from None


def tag_of(msg: Message | type[Message]) -> str:
    cls = msg if isinstance(msg, type) else type(msg)
    tag = cls.__struct_config__.tag
    assert isinstance(tag, str), cls
    return tag


class Door:
    """Where a receiver drops messages of generations that have ended, and counts them."""

    def __init__(self) -> None:
        self.generation = -1
        self.dropped: Counter[str] = Counter()

    def admit(self, env: Envelope[Any]) -> bool:
        """True for a message to handle; False (counted) for a scoped message sent in a
        generation older than the receiver's."""
        if env.msg.scoped and env.gen < self.generation:
            self.dropped[tag_of(env.msg)] += 1
            return False
        return True

    def take_counts(self) -> dict[str, int]:
        """The drops since the last call, by tag."""
        out = dict(self.dropped)
        self.dropped.clear()
        return out
