"""The tables of ``docs/architecture.md`` that are made from the code: every message of the
protocol and the state machines' transitions. ``python -m tierswap.control.doc`` prints
them; a test checks that the page holds what this prints, so the page stays true."""

from __future__ import annotations

from typing import Any

from tierswap.control import protocol as p
from tierswap.control.states import AGENT_PHASES, PHASES, WORKER_STATES, table_rows

WHO = {
    "worker -> agent": ("worker", "agent core"),
    "agent -> worker": ("agent core", "worker"),
    "agent -> coordinator": ("agent core", "coordinator core"),
    "coordinator -> agent": ("coordinator core", "agent core"),
    "agent <-> agent": ("replicator, worker (fetch), replica server", "replica server"),
    "worker -> store": ("worker (its process group's store)", "store server (launcher)"),
    "store -> worker": ("store server (launcher)", "worker"),
    "agent -> template": ("agent (its worker processes)", "worker template"),
    "template -> agent": ("worker template", "agent (its worker processes)"),
}


def _fields(cls: type[Any]) -> str:
    return ", ".join(cls.__struct_fields__) or "-"


def protocol_table() -> str:
    """One row per message: its tag, the channels that carry it, its fields, who sends it
    and who handles it, and whether it is scoped to a generation."""
    rows = ["| message | channel | fields | sent by | handled by | generation |",
            "|---|---|---|---|---|---|"]  # fmt: skip
    seen: dict[type[Any], list[str]] = {}
    for channel, union in p.CHANNELS.items():
        for cls in p.members(union):
            seen.setdefault(cls, []).append(channel)
    for cls, channels in sorted(seen.items(), key=lambda kv: (kv[1][0], p.tag_of(kv[0]))):
        senders = " / ".join(dict.fromkeys(WHO[c][0] for c in channels))
        handlers = " / ".join(dict.fromkeys(WHO[c][1] for c in channels))
        scope = "dropped once ended" if cls.scoped else "any"
        call = " (call)" if cls.call else ""
        rows.append(
            f"| `{p.tag_of(cls)}`{call} | {', '.join(channels)} | {_fields(cls)} | {senders} "
            f"| {handlers} | {scope} |"
        )
    return "\n".join(rows)


def state_tables() -> str:
    out = []
    for name, rows in (
        ("coordinator phase", table_rows(PHASES)),
        ("agent phase", table_rows(AGENT_PHASES)),
        ("worker state (in its agent)", table_rows(WORKER_STATES)),
    ):
        out += [f"| {name} | may become |", "|---|---|"]
        out += [f"| {a} | {b} |" for a, b in rows]
        out.append("")
    return "\n".join(out).rstrip()


if __name__ == "__main__":
    print(protocol_table())
    print()
    print(state_tables())
