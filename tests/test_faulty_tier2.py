"""Tier 2 broken in-process, by substitution: the real writer and the coordinator's core
over a ``faulty://`` store that fills up, fails or fails only its COMMIT."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tierswap.config import Config
from tierswap.control import commands as cc
from tierswap.control import protocol as p
from tierswap.control.coordinator import CoordinatorCore
from tierswap.control.ports import DurableRoot
from tierswap.state import flatten
from tierswap.tiers import catalog, durable, faulty
from tierswap.tiers.durable import PartInfo

ROOT = "faulty://ckpt"


@pytest.fixture
def faults() -> Iterator[faulty.Faults]:
    f = faulty.install()
    faulty.wipe()
    yield f
    faulty.wipe()


def _part(step: int, rank: int, seed: int = 0) -> PartInfo:
    flat = flatten({"w": torch.randn(256, generator=torch.Generator().manual_seed(seed))})
    return durable.write_flat(ROOT, step, rank, 2, flat)


def test_a_full_store_fails_the_part_and_leaves_no_half_file(faults: faulty.Faults) -> None:
    _part(1, 0)
    faults.capacity = faulty.FaultyFileSystem().used() + 100  # less than one more part
    with pytest.raises(OSError, match="no space left"):
        _part(1, 1)
    names = [n.rsplit("/", 1)[-1] for n in faulty.FaultyFileSystem().find("/ckpt")]
    assert all(".tmp" not in n for n in names), f"a temporary file was left: {names}"
    assert not any(n.startswith("rank-00001") for n in names), "a half part is visible"
    assert [s.step for s in catalog.list_steps(ROOT) if s.committed] == []


def _coordinator(keep: int = 1) -> CoordinatorCore:
    cfg = Config(nodes=2, console=False, persist=ROOT, persist_every=1, keep=keep)
    core = CoordinatorCore(cfg, job_id="t", script=["x.py"], address=("h", 1), store="h:2",
                           tier2=DurableRoot(ROOT), now=0.0)  # fmt: skip
    core.handle(cc.Begin(), 0.0)
    for host in (0, 1):
        core.handle(cc.AgentMessage(host + 1, p.Envelope(-1, p.Hello(host=host, pid=1)), 0), 0)
        ready = p.Ready(replica=("h", 9), workers=[])
        core.handle(cc.AgentMessage(host + 1, p.Envelope(-1, ready), 0), 0)
    return core


def _persist(core: CoordinatorCore, step: int) -> list[dict[str, object]]:
    """Commit ``step`` in tier 0 on both nodes and deliver both nodes' parts."""
    out: list[object] = []
    for host in (0, 1):
        held = cc.AgentMessage(host + 1, p.Envelope(0, p.Held(tier=0, step=step)), 0)
        out += core.handle(held, 0)
    (persist,) = [
        c.msg for c in out if isinstance(c, cc.Broadcast) and isinstance(c.msg, p.Persist)
    ]
    for host in (0, 1):
        parts = p.Parts(token=persist.token, step=step, parts=[_part(step, host)], errors={})
        out += core.handle(cc.AgentMessage(host + 1, p.Envelope(0, parts), 0), 0)
    return [c.fields | {"event": c.event} for c in out if isinstance(c, cc.Log)]


def test_a_commit_that_cannot_be_written_is_reported_and_the_older_step_kept(
    faults: faulty.Faults,
) -> None:
    core = _coordinator()
    logged = _persist(core, 0)
    assert {"event": "snapshot_committed", "tier": 2, "step": 0, "deleted": []} in logged
    faults.fail_names = ("COMMIT",)
    logged = _persist(core, 1)
    failing = [e for e in logged if e["event"] == "durability_failing"]
    assert failing and "COMMIT not written" in str(failing[0]["reason"])
    assert [s.step for s in catalog.list_steps(ROOT) if s.committed] == [0], "step 0 is kept"
    assert core.persister.committed == 0
    # the parts of step 1, which never got their COMMIT, are gone at once
    assert {"event": "step_discarded", "step": 1, "tier": 2} in logged
    assert [s.step for s in catalog.list_steps(ROOT)] == [0]
    faults.fail_names = ()
    logged = _persist(core, 2)
    assert {"event": "snapshot_committed", "tier": 2, "step": 2, "deleted": [0]} in logged
    assert [s.step for s in catalog.list_steps(ROOT) if s.committed] == [2]


def test_a_store_that_went_away_leaves_training_on_the_memory_tiers(
    faults: faulty.Faults,
) -> None:
    core = _coordinator()
    faults.fail_writes = True
    with pytest.raises(OSError, match="write failed"):
        _part(0, 0)
    errors = {0: "OSError: write failed", 1: "OSError: write failed"}
    out: list[object] = []
    for host in (0, 1):
        out += core.handle(cc.AgentMessage(host + 1, p.Envelope(0, p.Held(tier=0, step=0)), 0), 0)
    (persist,) = [
        c.msg for c in out if isinstance(c, cc.Broadcast) and isinstance(c.msg, p.Persist)
    ]
    for host in (0, 1):
        parts = p.Parts(token=persist.token, step=0, parts=[], errors={host: errors[host]})
        out += core.handle(cc.AgentMessage(host + 1, p.Envelope(0, parts), 0), 0)
    assert any(isinstance(c, cc.Log) and c.event == "durability_failing" for c in out)
    assert core.phase.state.value == "running" and core.tiers[0].committed == 0


def test_a_full_root_leaves_no_half_step_and_tier_2_moves_on(faults: faulty.Faults) -> None:
    """Issue 14: a full durable root left its half-written step behind, and tier 2 stayed
    at the last step that fit. Now the half step goes, older steps beyond the newest make
    room, and the next step is committed."""
    core = _coordinator(keep=2)
    _persist(core, 0)
    _persist(core, 1)
    assert [s.step for s in catalog.list_steps(ROOT) if s.committed] == [0, 1]
    fs = faulty.FaultyFileSystem()
    faults.capacity = fs.used() + (fs.used() // 4) * 3 // 2  # one more part, not two

    out: list[object] = []
    for host in (0, 1):
        out += core.handle(cc.AgentMessage(host + 1, p.Envelope(0, p.Held(tier=0, step=2)), 0), 0)
    (persist,) = [
        c.msg for c in out if isinstance(c, cc.Broadcast) and isinstance(c.msg, p.Persist)
    ]
    written = _part(2, 0)
    with pytest.raises(OSError) as full:
        _part(2, 1)
    logged: list[object] = []
    for host, parts, errors in ((0, [written], {}), (1, [], {1: f"OSError: {full.value}"})):
        msg = p.Parts(token=persist.token, step=2, parts=parts, errors=errors)
        logged += core.handle(cc.AgentMessage(host + 1, p.Envelope(0, msg), 0), 0)
    events = {c.event: c.fields for c in logged if isinstance(c, cc.Log)}
    assert events["durable_root_full"] == {"step": 2, "discarded": True, "deleted": [0]}
    assert [s.step for s in catalog.list_steps(ROOT)] == [1], "no half step, step 1 kept"

    logged = _persist(core, 3)  # there is room for one step now
    assert {"event": "snapshot_committed", "tier": 2, "step": 3, "deleted": []} in logged
    assert [s.step for s in catalog.list_steps(ROOT) if s.committed] == [1, 3]


class _SlowRoot:
    """A tier 2 that keeps every step asked of it (the parts are the test's business)."""

    url = "slow://root"

    def __init__(self) -> None:
        self.commits: list[int] = []

    def restorable_steps(self, world_size: int) -> frozenset[int]:
        return frozenset(self.commits)

    def read_commit(self, step: int) -> dict[int, PartInfo]:
        return {}

    def write_commit(self, step: int, world_size: int, parts: object) -> None:
        self.commits.append(step)

    def retain(self, keep: int) -> list[int]:
        return []

    def discard(self, step: int) -> bool:
        return False


def test_a_tier_2_that_cannot_keep_up_never_skips_a_step_silently() -> None:
    """--persist-every 5 while step 0 takes 13 steps to write: step 5 is deferred, then
    skipped when step 10 comes due (tier 0 keeps no step that old), 10 is deferred and
    written as the newest step once step 0 is done; each of those is an event and a
    console line, and the progress line says how far tier 2 trails."""
    from tierswap.control.persistence import Persistence

    out = cc.Out()
    asked: list[p.Persist] = []
    root = _SlowRoot()
    persister = Persistence(Config(nodes=1, persist_every=5), root, out, asked.append)
    persister.maybe_persist(0)
    for step in range(1, 13):
        persister.maybe_persist(step)
    assert [a.step for a in asked] == [0]
    assert persister.trailing(12) == 13  # nothing committed yet: all 13 steps
    info = PartInfo(rank=0, data="d", json="j", nbytes=1)
    assert persister.on_parts(asked[0].token, [info], {}) == 0
    persister.maybe_persist(13)
    assert [a.step for a in asked] == [0, 13]
    cmds = out.take()
    logged = [(c.event, c.fields) for c in cmds if isinstance(c, cc.Log)]
    said = [c.text for c in cmds if isinstance(c, cc.Say)]
    assert logged[:3] == [
        ("durable_step_deferred", {"step": 5, "writing": 0, "newest": -1}),
        ("durable_step_skipped", {"step": 5, "superseded_by": 10}),
        ("durable_step_deferred", {"step": 10, "writing": 0, "newest": -1}),
    ]
    assert ("durable_step_deferred_written", {"due": 10, "step": 13}) in logged
    assert any("step 5 was never persisted" in s for s in said), said
    assert sum("step 10 is due while step 0 is still being written" in s for s in said) == 1
    assert persister.trailing(13) == 0  # keeping up again
