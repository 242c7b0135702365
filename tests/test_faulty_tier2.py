"""Tier 2 broken in-process, by substitution: the real writer and the coordinator's core
over a ``faulty://`` store that fills up, fails or fails only its COMMIT."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tierswap.checksum import checksum_chunks
from tierswap.config import Config
from tierswap.control import commands as cc
from tierswap.control import protocol as p
from tierswap.control.coordinator import CoordinatorCore
from tierswap.control.ports import DurableRoot
from tierswap.state import flatten, make_layout, tensor_view
from tierswap.tiers import durable, faulty
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
    layout = make_layout(flat)
    buf = memoryview(bytearray(layout.nbytes))
    for e, t in zip(layout.entries, flat.tensors, strict=True):
        tensor_view(buf, e).copy_(t)
    checksum = checksum_chunks(layout.chunks(buf))
    return durable.write_part(ROOT, step, rank, 2, layout, flat.tree, buf, checksum)


def test_a_full_store_fails_the_part_and_leaves_no_half_file(faults: faulty.Faults) -> None:
    _part(1, 0)
    faults.capacity = faulty.FaultyFileSystem().used() + 100  # less than one more part
    with pytest.raises(OSError, match="no space left"):
        _part(1, 1)
    names = [n.rsplit("/", 1)[-1] for n in faulty.FaultyFileSystem().find("/ckpt")]
    assert all(".tmp" not in n for n in names), f"a temporary file was left: {names}"
    assert not any(n.startswith("rank-00001") for n in names), "a half part is visible"
    assert [s.step for s in durable.list_steps(ROOT) if s.committed] == []


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
    assert [s.step for s in durable.list_steps(ROOT) if s.committed] == [0], "step 0 is kept"
    assert core.persister.committed == 0
    # the parts of step 1, which never got their COMMIT, are gone at once
    assert {"event": "step_discarded", "step": 1, "tier": 2} in logged
    assert [s.step for s in durable.list_steps(ROOT)] == [0]
    faults.fail_names = ()
    logged = _persist(core, 2)
    assert {"event": "snapshot_committed", "tier": 2, "step": 2, "deleted": [0]} in logged
    assert [s.step for s in durable.list_steps(ROOT) if s.committed] == [2]


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
    assert [s.step for s in durable.list_steps(ROOT) if s.committed] == [0, 1]
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
    assert [s.step for s in durable.list_steps(ROOT)] == [1], "no half step, step 1 kept"

    logged = _persist(core, 3)  # there is room for one step now
    assert {"event": "snapshot_committed", "tier": 2, "step": 3, "deleted": []} in logged
    assert [s.step for s in durable.list_steps(ROOT) if s.committed] == [1, 3]
