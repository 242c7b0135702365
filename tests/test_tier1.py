"""Tier 1: a lost node's ranks come back from peer memory, bit for bit, without disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e import assert_same_bits, events, final_state, leaked_segments, run_job
from tierswap.bench.hostmem import node_memory
from tierswap.tiers import catalog

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.fixture(autouse=True)
def _no_leaked_memory(tmp_path: Path):
    yield
    assert not leaked_segments(tmp_path), "a job left shared-memory segments behind"


SLOW = ("--sleep", "0.05")
"""Steps long enough for replication to keep up on 2 busy cores, as on real hardware."""


def _restored(run_dir: Path) -> dict[int, int]:
    return {int(r): t for r, t in events(run_dir, "restored")[-1]["tiers"].items()}


def _kill_exact(tmp_path: Path, baseline, *extra: str, nproc: int = 1) -> Path:
    """A 3-node exact-DDP job of 12 slowed steps run with ``extra`` (its kills among them):
    it ends well and bit for bit as the same job without failures; its run folder."""
    base = baseline(nodes=3, nproc=nproc, mode="ddp-exact")
    code, run_dir, out = run_job(
        tmp_path, "kill", nodes=3, nproc=nproc, steps=12, mode="ddp-exact", train_args=SLOW,
        extra=extra,
    )  # fmt: skip
    assert code == 0, out
    assert_same_bits(base, final_state(tmp_path, "kill"))
    return run_dir


DELTA = ("--memory-tiers", "delta", "--base-every", "100", "--delta-threshold", "1.0")
"""Tier 1 as one base and deltas: every replica after a rank's first (in a generation, to
a peer) is a delta, however large."""


@pytest.mark.parametrize("mode", ["ddp-finetune", "fsdp"])
def test_two_nodes_node_lost_restores_from_peer_deltas(tmp_path: Path, baseline, mode: str) -> None:
    """Base + delta, bit for bit: fine-tuning on DDP (only the last block trains) with the
    killed node revived; FSDP2 pretraining with a spare."""
    fsdp = mode == "fsdp"
    train = ("--train-last", "1") if not fsdp else ()
    base = baseline(nodes=2, mode="fsdp" if fsdp else "ddp", train_args=train)
    code, run_dir, out = run_job(
        tmp_path,
        "kill",
        steps=12,
        mode="fsdp" if fsdp else "ddp",
        train_args=(*SLOW, *train),
        extra=(
            "--inject",
            "kill:node=1:step=8",
            *DELTA,
            *(("--spares", "1") if fsdp else ()),
        ),
    )
    assert code == 0, out
    assert_same_bits(base, final_state(tmp_path, "kill"))
    assert _restored(run_dir) == {0: 0, 1: 1}, "node 1's rank from tier 1, the survivor's tier 0"
    (served,) = events(run_dir, "replica_served")
    assert (
        served["rank"] == 1 and served["kind"] == "delta" and served["base_step"] < served["step"]
    )
    (traffic,) = events(run_dir, "replica_traffic")
    assert traffic["deltas"] > traffic["bases"] and traffic["bytes_sent"] < traffic["bytes_full"]
    first, second = (e["pids"] for e in events(run_dir, "rebuilt"))
    assert first["0"] == second["0"], "the survivor kept its process"
    if fsdp:
        assert events(run_dir, "spare_assigned")[0]["node"] == 1
    restored_at = events(run_dir, "restored")[-1]["time"]
    later = [
        e
        for e in events(run_dir, "snapshot_committed")
        if e["tier"] == 1 and e["time"] > restored_at
    ]
    assert later, "the fresh node re-joined the replication ring"
    assert not (tmp_path / "ckpt").exists()


def test_two_nodes_fsdp2_node_lost_restores_from_full_replica(tmp_path: Path, baseline) -> None:
    """FSDP2 shards are unique to their rank: only node 0's replica of rank 1 can bring it
    back, with no tier 2 given and the killed node revived empty."""
    base = baseline(nodes=2, mode="fsdp")
    code, run_dir, out = run_job(
        tmp_path,
        "kill",
        steps=12,
        mode="fsdp",
        train_args=SLOW,
        extra=("--inject", "kill:node=1:step=8"),
    )
    assert code == 0, out
    assert_same_bits(base, final_state(tmp_path, "kill"))
    assert _restored(run_dir) == {0: 0, 1: 1}
    (served,) = events(run_dir, "replica_served")
    assert served["rank"] == 1 and served["kind"] == "full"
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("redo", [2, 3])
def test_the_advised_larger_max_redo_with_a_slot_more_redoes_its_bound_bit_for_bit(
    tmp_path: Path, baseline, redo: int
) -> None:
    """What ``tier1_behind`` advises when tier 1 keeps the trainers waiting: a larger
    ``--max-redo`` with a slot more in each ring. Node 1's replicas are held 1 s each, far
    longer than a step (and than the hops from tier 1's commit of a step to the kill after
    step 8, on a loaded machine), so training runs as far ahead of tier 1 as the bound allows;
    node 1 is then killed after step 8, and its rank comes back on a spare from node 0's
    memory exactly ``redo`` steps back (the bound used, not exceeded), with no snapshot
    skipped for want of a slot, and bit for bit."""
    base = baseline(nodes=2, mode="ddp")
    slots = str(redo + 1)
    code, run_dir, out = run_job(
        tmp_path, "kill", steps=12, mode="ddp",
        extra=("--max-redo", str(redo), "--slots", slots, "--peer-slots", slots,
               "--spares", "1", "--inject", "delay:node=1:seconds=1",
               "--inject", "kill:node=1:step=8"),
    )  # fmt: skip
    assert code == 0, out[-3000:]
    assert_same_bits(base, final_state(tmp_path, "kill"))
    assert _restored(run_dir) == {0: 0, 1: 1}, "node 1's rank from tier 1"
    assert events(run_dir, "spare_assigned")[0]["node"] == 1
    (resumed,) = events(run_dir, "resumed")
    assert resumed["redone"] == redo and resumed["step"] == 8 - redo, resumed
    assert not events(run_dir, "snapshot_skipped"), "a slot more holds what tier 1 trails by"


def test_three_nodes_exact_ddp_node_lost_restores_from_peer_memory(
    tmp_path: Path, baseline
) -> None:
    """Full copies (``--peer-parity 0``; on 3 nodes the default is parity)."""
    run_dir = _kill_exact(
        tmp_path, baseline, "--peer-parity", "0", "--inject", "kill:node=1:step=6"
    )
    assert _restored(run_dir) == {0: 0, 1: 1, 2: 0}


def test_three_nodes_with_the_defaults_hold_3x_memory_and_hot_swap_a_lost_node_bit_for_bit(
    tmp_path: Path, baseline
) -> None:
    """No tier option at all: on 3 nodes tier 1 is parity over the group of 3 and a node
    holds 3x its rank's state (two tier-0 slots and two parities of half a state each),
    and a killed node's rank is rebuilt on a spare from the two others' parities and their
    own tier 0, bit for bit."""
    run_dir = _kill_exact(tmp_path, baseline, "--spares", "1", "--inject", "kill:node=1:step=6")
    assert _restored(run_dir) == {0: 0, 1: 1, 2: 0}, "node 1's rank rebuilt from tier 1"
    assert events(run_dir, "spare_assigned")[0]["node"] == 1
    assert not events(run_dir, "replica_served"), "no node holds a whole replica"
    (placement,) = events(run_dir, "placement")
    assert placement["parity"] == 3, placement
    per_node = node_memory(events(run_dir))
    assert sorted(per_node) == ["0", "1", "2"]
    for n, mem in per_node.items():
        assert 2.9 < mem["total_x"] <= 3.01, f"node {n} holds {mem['total_x']:.2f}x its state"
    restored_at = events(run_dir, "restored")[-1]["time"]
    later = [e for e in events(run_dir, "snapshot_committed") if e["time"] > restored_at]
    assert any(e["tier"] == 1 for e in later), "the spare's node joined the parities"


def test_a_corrupt_parity_is_found_before_it_is_used_and_tier_2_serves_instead(
    tmp_path: Path, baseline
) -> None:
    """``--peer-parity 3`` with node 0's parity (of ranks 1 and 2) damaged in memory: at
    the failure the agent's re-read of what it holds finds it, the lost rank 1 (whose
    stripe 1 is in it) cannot be rebuilt, and it comes back from tier 2, bit for bit."""
    persist = tmp_path / "ckpt"
    run_dir = _kill_exact(
        tmp_path,
        baseline,
        *("--peer-parity", "3", "--spares", "1"),
        *("--persist", str(persist), "--persist-every", "2"),
        *("--inject", "corrupt:rank=0:step=0:where=parity"),
        *("--inject", "kill:node=1:step=6"),
    )
    rejected = [e for e in events(run_dir, "replica_rejected") if e["node"] == 0]
    assert any("corrupt in memory" in e["why"] for e in rejected), rejected
    restored = events(run_dir, "restored")[-1]
    assert _restored(run_dir)[1] == 2, "rank 1 from tier 2: its parity at node 0 is damaged"
    durable_steps = {e["step"] for e in events(run_dir, "snapshot_committed") if e["tier"] == 2}
    assert restored["step"] in durable_steps


def test_two_adjacent_nodes_lost_fall_back_to_durable(tmp_path: Path, baseline) -> None:
    persist = tmp_path / "ckpt"
    run_dir = _kill_exact(
        tmp_path,
        baseline,
        *("--peer-parity", "0"),  # full copies: with parity, any two of 3 lose both
        "--persist",
        str(persist),
        "--persist-every",
        "3",
        "--inject",
        "kill:node=1:step=7",
        "--inject",
        "kill:node=2:step=7",
    )
    restored = _restored(run_dir)
    # placement 0->1, 1->2, 2->0: rank 1 lost both its copies; the others take whatever
    # fastest tier still holds the step every rank can reach
    assert restored[1] == 2, restored
    (fallback,) = events(run_dir, "restore_fallback")
    assert fallback["ranks"] == [1] and "replicas lost" in fallback["reason"]


def test_two_adjacent_nodes_lost_without_durable_stop_naming_the_ranks(tmp_path: Path) -> None:
    code, run_dir, out = run_job(
        tmp_path,
        "kill",
        nodes=3,
        steps=40,
        mode="ddp-exact",
        extra=(
            *("--peer-parity", "0"),
            *("--inject", "kill:node=1:step=5", "--inject", "kill:node=2:step=5"),
        ),
    )
    assert code == 1
    assert "no step can be restored" in out and "no tier holds a good part of ranks 1" in out
    assert events(run_dir, "job_failed")


@pytest.mark.parametrize(("where", "tiers"), [("flight", "full"), ("base", "delta")])
def test_corrupt_replica_is_detected_and_not_used(
    tmp_path: Path, baseline, where: str, tiers: str
) -> None:
    """A corrupt replica is never a source: the lost rank comes from tier 2 instead (a
    corrupt delta likewise: tests/test_delta_tier.py). A corrupt base in a peer's memory is
    dropped there; its deltas are sound and the sender wrote the base to tier 2, so the peer
    rebuilds them on that copy."""
    persist = tmp_path / "ckpt"
    base = baseline(nodes=2, mode="ddp")
    code, run_dir, out = run_job(
        tmp_path,
        "kill",
        steps=12,
        train_args=SLOW,
        extra=(
            "--persist",
            str(persist),
            "--persist-every",
            "3",
            "--inject",
            f"corrupt:rank=1:step=0:where={where}",
            "--inject",
            "kill:node=1:step=8",
            *(DELTA if tiers == "delta" else ()),
        ),
    )
    assert code == 0, out
    assert_same_bits(base, final_state(tmp_path, "kill"))
    if where == "base":  # its deltas are sound, and the sender wrote the base to tier 2
        lost = events(run_dir, "replica_base_lost")
        assert lost and all(e["rank"] == 1 for e in lost)
        restored = events(run_dir, "restored")[-1]
        if _restored(run_dir)[1] == 1:
            (served,) = events(run_dir, "replica_served")
            assert served["kind"] == "delta+durable", "rebuilt on the base read back from disk"
        else:  # tier 2 holds the step itself: one read of its part is cheaper
            assert restored["step"] in catalog.restorable_steps(str(persist))
        assert (persist / "memory-bases").is_dir()
        return
    rejected = events(run_dir, "replica_rejected")
    assert rejected and all(e["rank"] == 1 for e in rejected)
    assert _restored(run_dir)[1] == 2, "a corrupt replica is never a source"


def test_placement_that_cannot_fit_peer_memory_is_refused(tmp_path: Path) -> None:
    code, run_dir, out = run_job(tmp_path, "small", steps=12, extra=("--max-peer-memory", "100000"))
    assert code == 1
    assert "--max-peer-memory 100,000" in out and "replicas for ranks" in out
    assert events(run_dir, "job_failed")


def test_two_workers_per_node_spread_over_peers_and_restore(tmp_path: Path, baseline) -> None:
    run_dir = _kill_exact(
        tmp_path, baseline, "--peer-parity", "0", "--inject", "kill:node=1:step=7", nproc=2
    )
    (placement,) = events(run_dir, "placement")
    assert placement["targets"]["2"] != placement["targets"]["3"], "node 1's ranks spread out"
    assert _restored(run_dir) == {0: 0, 1: 0, 2: 1, 3: 1, 4: 0, 5: 0}
