"""The optimizer step waits for tier 1 (``--max-redo``): how far training may run ahead
of replication, through torch's real optimizer pre-hook."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tierswap import snapshot
from tierswap.control.protocol import Lagging
from tierswap.snapshot import Snapshotter, Watermark

pytestmark = pytest.mark.timeout(60)


class _Chan:
    """What the Snapshotter sends its agent, kept."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, msg: Any, gen: int | None = None) -> None:
        self.sent.append(msg)


def _optimizer() -> torch.optim.Optimizer:
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.ones(4)
    return torch.optim.SGD([p], lr=0.1)


@pytest.fixture
def gated() -> Iterator[tuple[Snapshotter, Watermark, _Chan]]:
    chan, mark = _Chan(), Watermark()
    snap = Snapshotter(chan, rank=0, watermark=mark, max_redo=1)  # type: ignore[arg-type]
    try:
        yield snap, mark, chan
    finally:
        snap.close()


def _step_in_thread(opt: torch.optim.Optimizer) -> threading.Thread:
    t = threading.Thread(target=opt.step, daemon=True)
    t.start()
    return t


def test_the_step_waits_until_tier1_is_done_with_the_last_snapshot(gated) -> None:
    snap, mark, _ = gated
    opt = _optimizer()
    opt.step()  # nothing snapshotted yet (a generation's first step): no wait
    snap.last_taken = 5  # as take(5) does
    mark.advance(4)
    t = _step_in_thread(opt)
    t.join(0.3)
    assert t.is_alive(), "stepped while tier 1 had only step 4 of 5"
    mark.advance(5)
    t.join(5)
    assert not t.is_alive()
    assert snap.stats.tier1_waits[-1] >= 0.25
    snap._end_step(0.001)  # as the next take does: the step's stall, its tier-1 part apart
    assert snap.stats.last_gate() == snap.stats.tier1_waits[-1]
    assert snap.stats.last_stall() == pytest.approx(snap.stats.last_gate() + 0.001)
    t0 = time.monotonic()
    opt.step()  # a second optimizer in the same step: already through
    assert time.monotonic() - t0 < 0.2


def test_max_redo_2_lets_training_run_one_step_further_ahead() -> None:
    mark = Watermark(3)
    snap = Snapshotter(_Chan(), rank=0, watermark=mark, max_redo=2)  # type: ignore[arg-type]
    try:
        snap.last_taken = 4
        t0 = time.monotonic()
        _optimizer().step()
        assert time.monotonic() - t0 < 0.2, "tier 1 holds step 3 = 4 - (2 - 1)"
        snap.last_taken = 5
        t = _step_in_thread(_optimizer())
        t.join(0.3)
        assert t.is_alive()
        mark.advance(4)
        t.join(5)
        assert not t.is_alive()
    finally:
        snap.close()


def test_an_ended_generation_releases_the_wait(gated) -> None:
    snap, mark, chan = gated
    snap.last_taken = 2
    t = _step_in_thread(_optimizer())
    t.join(0.2)
    assert t.is_alive()
    mark.close()
    t.join(5)
    assert not t.is_alive()
    assert chan.sent == [], "an ended generation is not a late tier 1"


def test_a_wait_nobody_ends_is_bounded_and_reported(gated, monkeypatch) -> None:
    snap, _, chan = gated
    monkeypatch.setattr(snapshot, "GATE_LIMIT_S", 0.2)
    snap.last_taken = 7
    _optimizer().step()
    lagging, *_ = chan.sent
    assert isinstance(lagging, Lagging) and lagging.step == 7 and lagging.seconds >= 0.2


def test_without_tier1_nothing_waits() -> None:
    snap = Snapshotter(_Chan(), rank=0, watermark=Watermark(), max_redo=0)  # type: ignore[arg-type]
    try:
        snap.last_taken = 9
        t0 = time.monotonic()
        _optimizer().step()
        assert time.monotonic() - t0 < 0.2
        assert snap.stats.tier1_waits == []
    finally:
        snap.close()


@pytest.mark.timeout(180)
def test_a_job_whose_training_keeps_waiting_for_tier_1_is_told_why(tmp_path) -> None:
    """Node 1's replicas held back 0.25 s each, far longer than a step: every optimizer
    step waits for tier 1, each worker says how long in its ``written`` and the
    coordinator, from rank 0's, says once what to do about it."""
    from e2e import events, run_job

    slow = "delay:node=1:seconds=0.25"
    code, run_dir, out = run_job(tmp_path, "slow", steps=16, extra=("--inject", slow))
    assert code == 0, out[-3000:]
    (behind,) = events(run_dir, "tier1_behind")
    assert behind["share"] > 0.05 and behind["step"] >= 10, behind
    assert "tier 1 is behind" in out and "(--agent-cpus)" in out and "--max-redo 2 " in out
