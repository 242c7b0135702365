import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


import pytest

from e2e import final_state, run_job

THREADS_END_S = 5.0
"""How long a test's own tierswap threads may take to end after it."""


def _ours() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("tierswap-")}


@pytest.fixture(autouse=True)
def no_thread_left() -> Iterator[None]:
    """A test ends every tierswap thread it started: one left running showed up in
    another test (a server whose client never closed its connection)."""
    before = _ours()
    yield
    deadline = time.monotonic() + THREADS_END_S
    while (left := _ours() - before) and time.monotonic() < deadline:
        time.sleep(0.02)
    names = sorted(t.name for t in left)
    assert not left, f"tierswap threads still running after the test: {names}"


@pytest.fixture(scope="session")
def baseline(tmp_path_factory):
    """Final states of uninterrupted runs, one run per shape, shared by the tests."""
    cache = {}

    def get(
        nodes: int = 2,
        mode: str = "ddp",
        steps: int = 12,
        nproc: int = 1,
        train_args: tuple[str, ...] = (),
    ):
        key = (nodes, mode, steps, nproc, train_args)
        if key not in cache:
            tmp = tmp_path_factory.mktemp("baseline")
            code, _, out = run_job(
                tmp,
                "base",
                nodes=nodes,
                nproc=nproc,
                steps=steps,
                mode=mode,
                train_args=train_args,
            )
            assert code == 0, out
            cache[key] = final_state(tmp, "base")
        return cache[key]

    return get


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--seed",
        type=int,
        default=None,
        help="replay one scenario of tests/test_sim.py (the seed a failure names)",
    )
