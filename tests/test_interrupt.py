"""A survivor leaves an ended generation at once: the signal the control thread sends cuts
the training loop's step short, but never one of tierswap's own calls halfway."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tierswap import worker
from tierswap.errors import GenerationEnded
from tierswap.interrupt import SIGNAL, in_own_call, own_call
from tierswap.job import Job

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def job() -> Iterator[Job]:
    """A job whose end is signalled the way the worker's control thread does it, to the
    worker's own handler, which acts only inside ``train(job)`` (``worker._enter``)."""
    j = Job(ended=threading.Event(), interrupt_steps=True)
    old = signal.signal(SIGNAL, worker.cut_short([j]))
    try:
        yield j
    finally:
        signal.signal(SIGNAL, old)


def _end_soon(job: Job, after: float = 0.2) -> None:
    main = threading.main_thread().ident
    assert main is not None

    def end() -> None:
        time.sleep(after)
        job._ended.set()
        signal.pthread_kill(main, SIGNAL)

    threading.Thread(target=end, daemon=True).start()


def test_a_step_is_cut_short_as_its_generation_ends(job: Job) -> None:
    seen = []

    def train(job: Job) -> None:
        for step in job.steps({}, total=100):
            seen.append(step)
            if step == 3:
                _end_soon(job)
                time.sleep(30)  # the loop's own work: a long forward, say

    t0 = time.monotonic()
    with pytest.raises(GenerationEnded, match="cut short"):
        worker._enter(train, job)
    assert seen == [0, 1, 2, 3]
    assert time.monotonic() - t0 < 10, "left during the step, not after it"
    assert not job.interruptible


def test_a_cpu_backward_pass_is_cut_short_between_two_gradients(job: Job) -> None:
    """On a CPU the backward pass is C++ on the loop's thread: the end of the generation
    cuts it short at the next parameter whose gradient is accumulated, not once every
    gradient is (most of the parameters still have none); the hooks go with the job."""
    import torch
    from torch import nn

    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(24)])
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(512, 1024)
    took: list[float] = []

    def train(job: Job) -> None:
        for step in job.steps({"model": model, "optim": opt}, total=100):
            loss = model(x).square().mean()
            if step == 1:  # a tenth into the pass, as long as step 0's
                _end_soon(job, took[0] / 10)
            t = time.monotonic()
            loss.backward()
            took.append(time.monotonic() - t)
            opt.step()
            opt.zero_grad(set_to_none=True)

    with pytest.raises(GenerationEnded, match="cut short"):
        worker._enter(train, job)
    params = list(model.parameters())
    present = [q for q in params if q.grad is not None]
    assert 0 < len(present) < len(params) // 2, "cut short inside the pass, early in it"
    assert len(job._points) == len(params) == 48
    job.close()
    assert not job._points
    assert not any(q._post_accumulate_grad_hooks for q in model.parameters())


def test_an_end_signalled_once_train_has_raised_is_not_raised_again(job: Job) -> None:
    """A collective's error leaves the loop mid-step; the worker then waits for the
    generation's end, which the signal brings: raising there would escape the handling."""

    def train(job: Job) -> None:
        for step in job.steps({}, total=100):
            if step == 2:
                raise RuntimeError("gloo: Connection reset by peer")

    with pytest.raises(RuntimeError, match="reset"):
        worker._enter(train, job)
    assert not job.interruptible
    job.interruptible = True  # even so: the signal comes outside train(job)
    _end_soon(job, 0.0)
    assert job._ended.wait(5)
    time.sleep(0.3)  # the handler has run by now, and raised nothing


def test_tierswaps_own_call_runs_to_its_end_and_raises_after(job: Job) -> None:
    sent: list[Any] = []

    class Chan:
        def send(self, msg: Any, gen: int | None = None) -> None:
            assert in_own_call()
            _end_soon(job, 0.0)
            time.sleep(0.5)  # the signal comes while the message is going out
            sent.append(msg)

    job._chan = Chan()  # type: ignore[assignment]

    def train(job: Job) -> None:
        job.interruptible = True  # in the loop's body
        job.report(3, loss=1.0)

    with pytest.raises(GenerationEnded):
        worker._enter(train, job)
    assert len(sent) == 1, "the message went out whole before the end was raised"


def test_outside_the_loops_body_an_end_waits_for_the_next_step(job: Job) -> None:
    job._ended.set()
    job.interrupt()  # tierswap's code (restore, snapshots) or before the first step
    with own_call():
        job.interruptible = True
        job.interrupt()  # inside tierswap's own call
    with pytest.raises(GenerationEnded):
        next(iter(job.steps({}, total=5)))


def test_with_no_interrupt_steps_nothing_ends_a_step_before_its_boundary() -> None:
    job = Job(ended=threading.Event(), interrupt_steps=False)
    old = signal.signal(SIGNAL, worker.cut_short([job]))
    sent: list[Any] = []

    class Chan:
        def send(self, msg: Any, gen: int | None = None) -> None:
            sent.append(msg)

    seen = []

    def train(job: Job) -> None:
        for step in job.steps({}, total=10):
            seen.append(step)
            if step == 1:
                assert not job.interruptible
                _end_soon(job, 0.0)
                time.sleep(0.5)  # the signal comes, and is let be
                job._chan = Chan()  # type: ignore[assignment]
                job.report(step, loss=1.0)  # runs, and does not raise either

    try:
        with pytest.raises(GenerationEnded, match=r"ended$"):  # at the step boundary
            worker._enter(train, job)
    finally:
        signal.signal(SIGNAL, old)
    assert seen == [0, 1] and len(sent) == 1


def test_restoring_raises_what_asking_for_the_plan_raised() -> None:
    class Chan:
        def call(self, msg: Any, reply: Any, timeout: float | None = 60.0) -> Any:
            raise RuntimeError("generation 3 ended")

    job = Job(ended=threading.Event())
    job._chan = Chan()  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="ended"):  # no guess each rank might make alike
        assert job.restoring
