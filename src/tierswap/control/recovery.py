"""How long a recovery took, phase by phase, and which workers kept their processes.

The coordinator tells a :class:`RecoveryClock` what happens and when (a fault injected, a
failure detected, a generation started, workers joined, restored, stepped); the clock
answers with the fields of the ``rebuilt`` and ``resumed`` events once every rank has
reported. Time is an argument: the clock reads no clock.
"""

from __future__ import annotations

from typing import Any


class RecoveryClock:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.fault_time: float | None = None
        """When the newest injected fault fired, if one did (else detection is the start)."""
        self.record: dict[str, Any] | None = None
        self.pids: dict[int, int] = {}
        """rank -> process id of its worker in this generation."""
        self.pids_seen: dict[int, int] = {}
        """rank -> the newest process id that joined a generation for it."""
        self.joined: dict[int, float] = {}
        self.stepped: dict[int, float] = {}
        self.timelines: dict[int, dict[str, float]] = {}
        """rank -> its own account of the way to its first step (``Job.timeline``)."""

    def fault(self, now: float) -> None:
        self.fault_time = now

    def failed(self, last_step: int, now: float) -> float | None:
        """A failure is detected; returns the seconds since the injected fault, if any."""
        detect = None if self.fault_time is None else now - self.fault_time
        self.record = {
            "fault": self.fault_time if self.fault_time is not None else now,
            "detected": now,
            "pids": dict(self.pids_seen),
            "last_step": last_step,
        }
        self.fault_time = None
        return detect

    def generation_started(self, now: float) -> None:
        self.pids.clear()
        self.joined.clear()
        self.stepped.clear()
        self.timelines.clear()
        if self.record is not None:
            self.record["decided"] = now

    def restored(self, now: float) -> None:
        if self.record is not None:
            self.record["restored"] = now

    def _kept(self) -> list[int]:
        before = self.record["pids"] if self.record is not None else {}
        return sorted(r for r, p in self.pids.items() if before.get(r) == p)

    def worker_joined(self, rank: int, pid: int, now: float) -> dict[str, Any] | None:
        """A worker joined its process group; the ``rebuilt`` fields once all have."""
        self.joined[rank] = now
        self.pids[rank] = self.pids_seen[rank] = pid
        if len(self.joined) < self.world_size:
            return None
        rec = self.record
        return {
            "pids": {str(r): p for r, p in sorted(self.pids.items())},
            "kept": self._kept(),
            "seconds": None
            if rec is None or "decided" not in rec
            else max(self.joined.values()) - rec["decided"],
        }

    def worker_stepped(
        self, rank: int, restored_step: int, now: float, timeline: dict[str, float] | None = None
    ) -> dict[str, Any] | None:
        """A worker finished its first step of the generation; once all have, after a
        failure, the ``resumed`` fields: the time from the fault, split into phases, and
        each rank's own timeline of restore and resume (``ranks``). A rank reports after
        its step's snapshot was taken: the step itself ended ``timeline["snapshot"]``
        seconds (by its own clock) before ``now``, and that is when it counts as done."""
        self.timelines[rank] = dict(timeline or {})
        self.stepped[rank] = now - max(0.0, self.timelines[rank].get("snapshot", 0.0))
        rec = self.record
        if len(self.stepped) < self.world_size or rec is None or "decided" not in rec:
            return None
        rebuilt = max(self.joined.values(), default=rec["decided"])
        restored = rec.get("restored", rebuilt)
        resumed = max(self.stepped.values())
        fields = {
            "seconds": resumed - rec["fault"],
            "phases": {
                "detect": rec["detected"] - rec["fault"],
                "decide": rec["decided"] - rec["detected"],
                "rebuild": rebuilt - rec["decided"],
                "restore": restored - rebuilt,
                "resume": resumed - restored,
            },
            "redone": max(0, int(rec["last_step"]) - restored_step),
            "kept": self._kept(),
            "replaced": sorted(r for r in self.pids if r not in self._kept()),
            "ranks": {str(r): t for r, t in sorted(self.timelines.items())},
        }
        self.record = None
        return fields
