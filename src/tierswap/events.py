"""The job's event log (``RUN_DIR/events.jsonl``) and its console."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console


class EventLog:
    """One JSON object a line, flushed at once so a reader sees a crash's last words."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: TextIO = path.open("a", encoding="utf-8")

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"time": time.time(), "event": event, **fields}
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()
        return record

    def close(self) -> None:
        self._file.close()


def read_events(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class Progress:
    """A progress line (rewritten in place on a terminal, every few seconds elsewhere)
    and plain messages for what happened."""

    def __init__(self, enabled: bool, total: int | None = None) -> None:
        self.enabled = enabled
        self.console = Console(file=sys.stderr, highlight=False, soft_wrap=True)
        self.live = self.console.is_terminal
        self._last = 0.0
        self.total = total

    def message(self, text: str) -> None:
        if self.enabled:
            if self.live:
                self.console.print(" " * 100, end="\r")
            said = "\n".join(f"[tierswap] {line}" for line in text.splitlines() or [""])
            self.console.print(said, markup=False, highlight=False)  # (each line greppable)

    def update(
        self,
        step: int,
        loss: float | None,
        stall: float,
        committed: dict[str, int],
        behind: int = 0,
    ) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not self.live and now - self._last < 5.0:
            return
        self._last = now
        total = f"/{self.total}" if self.total else ""
        loss_s = "" if loss is None else f" loss {loss:.4f}"
        tiers = " ".join(f"{t}@{s}" for t, s in committed.items())
        if behind:
            tiers += f" (tier 2 trails by {behind} steps)"
        line = f"step {step + 1}{total}{loss_s} stall {stall * 1e3:.2f} ms committed {tiers}"
        if self.live:
            self.console.print(line[:120].ljust(100), end="\r")
        else:
            self.console.print(f"[tierswap] {line}", markup=False, highlight=False)


def job_events(run_dir: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The events of the job run in ``run_dir`` so far (of one ``kind``); none before its
    log exists."""
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [e for e in read_events(path) if kind is None or e.get("event") == kind]
