"""``tierswap simulate``'s accounting on hand-built traces, and the validation's predictor."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tierswap import goodput as g
from tierswap.bench.projection import predict, strikes, training_wall

H = 1 / 3600.0  # one second, in hours


def test_without_failures_each_strategy_pays_only_its_steady_cost() -> None:
    m = g.Model(gpus=64, hours=100.0)
    rs = g.restart(m, [], every_min=30)
    assert rs.goodput == pytest.approx(1800 / (1800 + m.ckpt_block_s))
    mem = g.memory(m, [], every_min=30, mem_every=5)
    copy_s = m.state_gb / m.mem_gbps
    assert mem.goodput == pytest.approx(5 * m.step_s / (5 * m.step_s + copy_s))
    ts = g.tierswap(m, [], spares=2)
    rate = m.step_s / (m.step_s * (1 + m.ts_overhead) + m.ts_stall_s)
    assert ts.goodput == pytest.approx(rate * m.nodes / (m.nodes + 2)), "spares are paid for"


def test_a_node_failure_costs_a_swap_and_a_step_then_waits_once_no_spare_is_left() -> None:
    m = g.Model(gpus=4, gpus_per_node=1, step_s=1.0, ts_overhead=0.0, ts_stall_s=0.0,
                ts_swap_s=3.0, replace_s=50.0, repair_h=1e9, hours=1e9)  # fmt: skip
    work = 100 * H
    one = g.tierswap(m, [g.Failure(10 * H, 0, True)], spares=1, work_h=work)
    assert one.wall_h == pytest.approx((100 + 3 + 1) * H), "swap 3 s, one step redone"
    two = g.tierswap(m, [g.Failure(10 * H, 0, True), g.Failure(40 * H, 1, True)], 1, work)
    assert two.wall_h == pytest.approx((100 + 2 * (3 + 1) + 50) * H), "no spare: 50 s wait"
    crash = g.tierswap(m, [g.Failure(10 * H, 2, False)], spares=0, work_h=work)
    assert crash.wall_h == pytest.approx((100 + m.ts_worker_s + 1) * H)
    assert g.tierswap(m, [g.Failure(200 * H, 0, True)], 1, work).wall_h == pytest.approx(work)


def test_restart_loses_the_work_since_its_checkpoint_and_a_restart() -> None:
    m = g.Model(gpus=8, ckpt_block_s=0.0, restart_s=60.0, replace_s=0.0, state_gb=0.0,
                hours=1.0)  # fmt: skip
    out = g.restart(m, [g.Failure(0.5 + 7 * 60 * H, 0, False)], every_min=10)
    # 37 minutes in: back to the checkpoint at 30, a minute to restart
    assert out.lost_h["redone"] == pytest.approx(7 / 60)
    assert out.lost_h["restarts"] == pytest.approx(1 / 60)
    assert out.useful_h == pytest.approx(1 - 8 / 60)


def test_a_projection_is_seeded_and_picks_each_strategys_best_parameter() -> None:
    m = g.Model(gpus=16384)
    a, b = g.project(m, seeds=2), g.project(m, seeds=2)
    assert a == b, "the same seeds, the same traces"
    assert g.trace(m, 10, 1) != g.trace(m, 10, 2)
    assert a["failures_per_month"] == pytest.approx(419 / 54 * 30, rel=1e-9)
    young = a["restart"]["young_min"]
    assert young / 2 <= a["restart"]["every_min"] <= young * 2, a["restart"]
    scores = a["tierswap"]["by_spares"]
    assert scores[a["tierswap"]["spares"]] == max(scores.values())
    # under the documented defaults, the order the README states at this size
    assert a["tierswap"]["goodput"] > a["memory"]["goodput"] > a["restart"]["goodput"]


def test_the_validation_predicts_from_costs_measured_elsewhere() -> None:
    """Costs: a step 0.1 s, a worker failure 2.1 s, a node failure 0.3 s, a boot 2 s."""
    trace = [(1.0, False), (4.0, True), (6.0, True)]  # the second node: no spare left
    want = 90 * 0.1 + 2.1 + 0.3 + (2.0 + 0.3)
    assert predict(2, 90, 0.1, 2.1, 0.3, 2.0, trace) == pytest.approx(want)
    # a node lost while a worker restarts: one stop takes both, and the spare
    both = [(1.0, False), (2.0, True)]
    assert predict(2, 90, 0.1, 2.1, 0.3, 2.0, both) == pytest.approx(90 * 0.1 + 2.1)
    evs = [
        {"event": "job_started", "time": 0.0},
        {"event": "generation_started", "time": 5.0},
        {"event": "fault_injected", "time": 6.5, "spec": "chaos:kill:node=1"},
        {"event": "fault_injected", "time": 7.0, "spec": "kill:rank=0:step=10"},
        {"event": "job_finished", "time": 20.0},
    ]
    assert training_wall(evs) == 15.0 and strikes(evs) == [(1.5, True), (2.0, False)]


def test_simulate_prints_its_table_and_refuses_what_cannot_be() -> None:
    cmd = [sys.executable, "-m", "tierswap.cli", "simulate", "--seeds", "1"]
    done = subprocess.run([*cmd, "--sweep", "512", "4096"], capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    lines = done.stdout.splitlines()
    assert lines[0].split()[:2] == ["GPUs", "failures"] and len(lines) == 3
    bad = subprocess.run([*cmd, "--step-s", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--step-s must be positive" in bad.stderr


def test_the_plot_is_drawn_where_matplotlib_is_installed(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot needs tierswap[bench]")
    rows = g.sweep(g.Model(), [512, 4096], seeds=1)
    g.plot(rows, str(tmp_path / "goodput.png"))
    assert (tmp_path / "goodput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_in_memory_goes_back_to_its_copy_or_to_storage_by_the_failures_kind() -> None:
    m = g.Model(gpus=8, step_s=60.0, state_gb=0.0, mem_restart_s=0.0, restart_s=0.0,
                replace_s=0.0, read_gbps=1.0, hours=10.0)  # fmt: skip
    crash = g.memory(m, [g.Failure(1.0 + 7 / 60, 0, False)], every_min=120, mem_every=5)
    assert crash.lost_h["redone"] == pytest.approx(2 / 60), "back to the copy at 1:05"
    node = g.memory(m, [g.Failure(1.0 + 7 / 60, 0, True)], every_min=45, mem_every=5)
    assert node.lost_h["redone"] == pytest.approx(22 / 60), "back to storage at 0:45"


def test_a_repaired_node_parks_again_and_a_spare_that_fails_leaves_the_pool() -> None:
    m = g.Model(gpus=2, gpus_per_node=1, step_s=1.0, ts_overhead=0.0, ts_stall_s=0.0,
                ts_swap_s=0.0, replace_s=1e6, repair_h=10 * H, hours=1e9)  # fmt: skip
    work = 100 * H
    # node 0 at 5 s takes the spare; it is repaired at 15 s and takes node 1's place at 20 s
    back = g.tierswap(m, [g.Failure(5 * H, 0, True), g.Failure(20 * H, 1, True)], 1, work)
    assert back.lost_h["waiting"] == 0 and back.wall_h == pytest.approx(102 * H)
    # the spare (node 2) fails at 1 s: node 0 at 5 s waits for its repair at 11 s
    gone = g.tierswap(m, [g.Failure(1 * H, 2, True), g.Failure(5 * H, 0, True)], 1, work)
    assert gone.lost_h["waiting"] == pytest.approx(6 * H)
