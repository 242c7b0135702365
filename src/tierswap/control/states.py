"""The control plane's state machines: each an enum and one table of legal transitions.

``Machine.move`` is the only way a state changes; a transition the table does not list
raises :class:`IllegalTransition` naming both states, so a message that arrives in a
state nobody planned for fails loudly in a test instead of corrupting the job.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Generic, TypeVar

S = TypeVar("S", bound=Enum)


class IllegalTransition(RuntimeError):
    """A state machine was asked for a transition its table does not allow."""


class Phase(Enum):
    """The coordinator's job phase."""

    STARTING = "starting"
    """Waiting for the first generation's hosts."""
    RUNNING = "running"
    """A generation trains."""
    RECOVERING = "recovering"
    """A failure ended the generation: stopping workers, waiting for spares, planning."""
    FINISHING = "finishing"
    """Every rank finished: the last step's commits and durable write."""
    DONE = "done"
    FAILED = "failed"


PHASES: Mapping[Phase, frozenset[Phase]] = {
    Phase.STARTING: frozenset({Phase.RUNNING, Phase.FAILED}),
    Phase.RUNNING: frozenset({Phase.RECOVERING, Phase.FINISHING, Phase.FAILED}),
    Phase.RECOVERING: frozenset({Phase.RUNNING, Phase.FAILED}),
    Phase.FINISHING: frozenset({Phase.DONE, Phase.FAILED}),
    Phase.DONE: frozenset(),
    Phase.FAILED: frozenset(),
}


class WorkerState(Enum):
    """One worker process, as its agent sees it."""

    STARTING = "starting"
    """Spawned, importing the script; not attached yet."""
    PARKED = "parked"
    """Attached, waiting for a rank."""
    ASSIGNED = "assigned"
    """Running a rank of the current generation."""
    LEAVING = "leaving"
    """Told to leave its generation; not parked yet."""
    FINISHED = "finished"
    """Ran its last step; exits."""


WORKER_STATES: Mapping[WorkerState, frozenset[WorkerState]] = {
    WorkerState.STARTING: frozenset({WorkerState.PARKED}),
    WorkerState.PARKED: frozenset({WorkerState.ASSIGNED}),
    WorkerState.ASSIGNED: frozenset(
        {WorkerState.LEAVING, WorkerState.PARKED, WorkerState.FINISHED}
    ),
    WorkerState.LEAVING: frozenset({WorkerState.PARKED, WorkerState.FINISHED}),
    WorkerState.FINISHED: frozenset(),
}


class AgentPhase(Enum):
    """An agent's part in the current generation."""

    IDLE = "idle"
    """No generation yet: booting, or parked as a spare."""
    SERVING = "serving"
    """Its node runs a generation."""
    STOPPING = "stopping"
    """Told to stop: waiting for its workers to park and its checksums to finish."""
    STOPPED = "stopped"
    """Reported what it holds; until the next start no rank is handed out."""


AGENT_PHASES: Mapping[AgentPhase, frozenset[AgentPhase]] = {
    AgentPhase.IDLE: frozenset({AgentPhase.SERVING}),
    AgentPhase.SERVING: frozenset({AgentPhase.STOPPING}),
    AgentPhase.STOPPING: frozenset({AgentPhase.STOPPED}),
    AgentPhase.STOPPED: frozenset({AgentPhase.SERVING}),
}


class Machine(Generic[S]):
    """A state and the table that says where it may go."""

    __slots__ = ("name", "state", "table")

    def __init__(self, name: str, state: S, table: Mapping[S, frozenset[S]]) -> None:
        self.name = name
        self.state = state
        self.table = table

    def move(self, to: S) -> None:
        if to not in self.table[self.state]:
            raise IllegalTransition(
                f"{self.name}: no transition from {self.state.value} to {to.value}"
            )
        self.state = to

    def __eq__(self, other: object) -> bool:
        return self.state == other if isinstance(other, Enum) else NotImplemented

    def __hash__(self) -> int:
        return hash(self.state)

    def __repr__(self) -> str:
        return f"{self.name}={self.state.value}"


def table_rows(table: Mapping[S, frozenset[S]]) -> list[tuple[str, str]]:
    """(from, to) pairs of a transition table, for docs and tests."""
    return [(a.value, ", ".join(sorted(b.value for b in bs)) or "(end)") for a, bs in table.items()]
