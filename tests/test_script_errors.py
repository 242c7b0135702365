"""An exception of the training script's: named, retried once, and the job stopped when a
restore of the same state raises it again (a bug is not a fault, and a restart cannot
mend it); one that does not come back is recovered from like any failure."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e import events, leaked_segments, run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPT = """
import os, torch, tierswap
from pathlib import Path

ONCE = Path(__file__).with_suffix(".raised")

def train(job):
    torch.manual_seed(0)
    state = {"model": torch.nn.Linear(4, 4)}
    total = 4 if MODE == "short" and job.rank == 1 else 6
    for step in job.steps(state, total=total):
        if MODE in ("always", "once") and job.rank == 1 and step == 3 and not (
            MODE == "once" and ONCE.exists()
        ):
            ONCE.touch()
            raise ValueError(f"boom in step {step}\\nsecond line")

if __name__ == "__main__":
    MODE = os.environ["RAISE_MODE"]
    tierswap.launch(train)
"""


@pytest.fixture(autouse=True)
def _no_leaked_memory(tmp_path: Path):
    yield
    assert not leaked_segments(tmp_path), "a job left shared-memory segments behind"


def _run(tmp_path: Path, mode: str) -> tuple[int, Path, str]:
    script = tmp_path / f"{mode}.py"
    script.write_text(SCRIPT)
    import os

    os.environ["RAISE_MODE"] = mode  # (the launcher's environment reaches the workers)
    try:
        return run_job(tmp_path, mode, nodes=2, steps=6, script=script)
    finally:
        del os.environ["RAISE_MODE"]


def test_the_same_error_in_the_same_step_twice_stops_the_job_naming_it(tmp_path: Path) -> None:
    code, run_dir, out = _run(tmp_path, "always")
    assert code == 1, out[-3000:]
    raised = events(run_dir, "worker_raised")
    assert [(e["rank"], e["step"], e["error"]) for e in raised] == [
        (1, 3, "ValueError: boom in step 3")
    ] * 2, "told with its step and first line, once per attempt"
    assert len(events(run_dir, "failure_detected")) == 1, "retried once, not --max-restarts"
    assert "raised ValueError: boom in step 3 in step 3 again, with the same state" in out
    assert "Fix the script" in out


def test_ranks_that_disagree_on_their_steps_stop_the_job_at_once(tmp_path: Path) -> None:
    code, run_dir, out = _run(tmp_path, "short")
    assert code == 1, out[-3000:]
    assert "different totals (rank 0: 6, rank 1: 4)" in out
    assert not events(run_dir, "failure_detected"), "not retried: a restart cannot mend it"


def test_an_error_that_does_not_come_back_is_recovered_from(tmp_path: Path) -> None:
    code, run_dir, out = _run(tmp_path, "once")
    assert code == 0, out[-3000:]
    assert len(events(run_dir, "worker_raised")) == 1
    assert len(events(run_dir, "failure_detected")) == 1
    assert events(run_dir, "job_finished")


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("a broken __str__")


class _Chan:
    def __init__(self) -> None:
        self.told: list[object] = []

    def call(self, msg: object, reply: object, timeout: float | None = None) -> object:
        self.told.append(msg)
        raise OSError("the agent is gone")  # (what it says then must not matter)


@pytest.mark.parametrize(
    "error, code, said",
    [
        (ValueError("bad\nmore"), 1, "ValueError: bad"),
        (SystemExit(7), 7, "SystemExit: 7"),
        (SystemExit("why"), 1, "SystemExit: why"),
        (SystemExit(0), 1, "SystemExit: 0"),  # inside train(job): its steps are not done
        (KeyError(), 1, "KeyError"),
        (SystemExit(256), 1, "SystemExit: 256"),  # an exit status is a byte
        (SystemExit(300), 44, "SystemExit: 300"),
        (_Unprintable(), 1, "_Unprintable"),
    ],
)
def test_a_raise_is_told_with_its_step_and_exits_with_a_system_exits_code(
    error: BaseException, code: int, said: str
) -> None:
    from types import SimpleNamespace

    from tierswap.control import protocol as p
    from tierswap.worker import _raised

    chan = _Chan()
    try:
        raise error
    except BaseException as e:
        assert _raised(chan, SimpleNamespace(rank=2, step=9), e) == code  # type: ignore[arg-type]
    assert chan.told == [p.Raised(rank=2, step=9, error=said)]
