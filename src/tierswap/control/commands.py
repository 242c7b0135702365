"""What the coordinator's core asks its shell to do, and the events the shell feeds it.

The core (``control/coordinator.py``) has no sockets, threads, clocks or processes: its
shell (``cluster/coordinator.py``, or the simulation in ``control/sim.py``) turns each
command into I/O, and each thing that happens into an event, in one loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tierswap.control.protocol import Envelope, Message

# ==================================================================== events


@dataclass(frozen=True, slots=True)
class Begin:
    """The job starts; ``durable_warning`` says why tier 2 cannot be written, if so."""

    durable_warning: str | None = None


@dataclass(frozen=True, slots=True)
class AgentMessage:
    """A message from an agent's connection; ``at`` is when it arrived (leases)."""

    conn: int
    env: Envelope[Any]
    at: float


@dataclass(frozen=True, slots=True)
class AgentClosed:
    """An agent's connection closed."""

    conn: int


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed (leases and deadlines are checked). ``heard``: connection -> when its
    newest message arrived, as the shell's reader threads saw it (heartbeats included,
    which need not be handed in one by one): a loop that was busy, or a queue that is
    long, never makes a healthy host look silent."""

    heard: Mapping[int, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class HostExited:
    """A host's agent process, started by this launcher, exited before it said hello."""

    host: int
    code: int


@dataclass(frozen=True, slots=True)
class Drain:
    """The job is stopped from outside (``signal``, whose exit ``code`` the job ends with):
    its newest step in memory goes to tier 2 first (``--stop-grace``)."""

    signal: str
    code: int


@dataclass(frozen=True, slots=True)
class DurableLost:
    """This job lost its claim on the durable root (another job took it over): it must
    write no more COMMIT there."""

    why: str


@dataclass(frozen=True, slots=True)
class TakeOver:
    """This coordinator leads a job another one led (``--rdzv-backend etcd``): ``record``
    is what that one wrote last (``CoordinatorCore.record``); ``old_host`` the host of
    the old leader's own machine, which is not waited for; ``ignored`` the options this
    leader's own launch gave otherwise than the job's, which it does not use
    (``candidate.job_config``)."""

    record: Mapping[str, Any]
    old_host: int | None = None
    ignored: tuple[str, ...] = ()


CoordinatorEvent = (
    Begin | TakeOver | AgentMessage | AgentClosed | Tick | HostExited | DurableLost | Drain
)


# ==================================================================== commands


@dataclass(frozen=True, slots=True)
class Send:
    conn: int
    msg: Message
    gen: int


@dataclass(frozen=True, slots=True)
class Broadcast:
    """One message to many connections: encoded once."""

    conns: tuple[int, ...]
    msg: Message
    gen: int


@dataclass(frozen=True, slots=True)
class Close:
    conn: int


@dataclass(frozen=True, slots=True)
class StartHost:
    """Start a simulated host (an agent process) with this id."""

    host: int


@dataclass(frozen=True, slots=True)
class KillHost:
    """SIGKILL a host's process group: fencing, or an injected fault."""

    host: int


@dataclass(frozen=True, slots=True)
class KillProcess:
    """SIGKILL one worker process (chaos), by its id."""

    pid: int


@dataclass(frozen=True, slots=True)
class FreezeHost:
    """SIGSTOP a host's process group (an injected hang)."""

    host: int


@dataclass(frozen=True, slots=True)
class FreeSegments:
    """Unlink the shared memory a dead host's agent (``pid``) left, where it ran on this
    machine (its launcher gave it ``tag``: pids repeat across machines)."""

    pid: int
    tag: str = ""


@dataclass(frozen=True, slots=True)
class Log:
    """One line of the event log."""

    event: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Say:
    """A line on the console."""

    text: str


@dataclass(frozen=True, slots=True)
class ShowProgress:
    step: int
    loss: float | None
    stall: float
    committed: dict[str, int]
    total: int | None
    behind: int = 0
    """Steps tier 2 trails tier 0 by while it cannot keep up (0 while it can)."""


@dataclass(frozen=True, slots=True)
class End:
    """The job is over: 0 finished, 1 stopped for good (``reason`` says why)."""

    code: int
    reason: str | None = None


class JobStopped(Exception):
    """Raised by the coordinator core's decisions when the job cannot go on; the message
    says why and what is kept. ``handle`` turns it into ``End(1, why)``."""


CoordinatorCommand = (
    Send
    | Broadcast
    | Close
    | StartHost
    | KillHost
    | FreezeHost
    | KillProcess
    | FreeSegments
    | Log
    | Say
    | ShowProgress
    | End
)


class Out:
    """The commands one event produced, in order."""

    __slots__ = ("cmds",)

    def __init__(self) -> None:
        self.cmds: list[Any] = []

    def add(self, cmd: Any) -> None:
        self.cmds.append(cmd)

    def log(self, event: str, **fields: Any) -> None:
        self.cmds.append(Log(event, fields))

    def say(self, text: str) -> None:
        self.cmds.append(Say(text))

    def take(self) -> list[Any]:
        out, self.cmds = self.cmds, []
        return out
