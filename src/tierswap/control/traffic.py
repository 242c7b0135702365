"""What delta-mode replication sent, tallied by the coordinator for the event log."""

from __future__ import annotations

from collections import Counter
from typing import Any


class Traffic:
    """The coordinator's tally of what delta-mode replication sent, for the event log."""

    def __init__(self) -> None:
        self.count: Counter[str] = Counter()
        self.sent: Counter[str] = Counter()
        self.full = 0
        self.encode_s = 0.0

    def add(self, kind: str, nbytes: int, full: int, encode_s: float) -> None:
        self.count[kind] += 1
        self.sent[kind] += nbytes
        self.full += full
        self.encode_s += encode_s

    def summary(self) -> dict[str, Any]:
        """Deltas and bases sent, their bytes against full snapshots, and encode speed."""
        deltas = self.count["delta"]
        return {
            "deltas": deltas,
            "bases": self.count["base"],
            "bytes_sent": sum(self.sent.values()),
            "bytes_full": self.full,
            "ratio": sum(self.sent.values()) / self.full if self.full else None,
            "encode_s": round(self.encode_s, 4),
        }
