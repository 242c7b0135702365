"""``--on-no-spare shrink``: a job that loses a node with no spare goes on with the nodes
it has, resharded from tier 2, and grows back once a host joins: a real job whose killed
host reboots (``--revive``, the default on one machine) and parks as a spare."""

from __future__ import annotations

from pathlib import Path

import torch

from e2e import events, final_state, leaked_segments, run_job
from tierswap.dcp import load_full
from tierswap.examples import load_final
from tierswap.examples.gpt import GPTConfig, build_model
from tierswap.tiers import catalog, durable


def _named(rank_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A DDP rank's saved state under DCP's names (``model.w``, ``optim.state.w.exp_avg``)."""
    params = [
        n for n, _ in build_model(GPTConfig(n_layer=2, n_embd=128), "single").named_parameters()
    ]
    out = {}
    for key, t in rank_state.items():
        parts = key.split("/")
        if parts[0] == "model":
            out["model." + parts[1].removeprefix("module.")] = t
        elif parts[:2] == ["optim", "state"]:
            out[f"optim.state.{params[int(parts[2])]}.{parts[3]}"] = t
    return out


def _trained_bytes(root: Path, step: int, rank: int) -> dict[str, bytes]:
    """A rank's parameters and optimizer state in tier 2, as bytes (checksums checked)."""
    layout, _, buf = durable.read_part(str(root), step, rank)
    keys = [e for e in layout.entries if e.key.startswith(("model/", "optim/state/"))]
    return {e.key: bytes(buf[e.offset : e.offset + e.nbytes]) for e in keys}


def _flat(nested: dict[str, object], prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in nested.items():
        name = f"{prefix}{k}"
        out.update(_flat(v, name + ".") if isinstance(v, dict) else {name: v})
    return out


def test_a_job_shrinks_when_no_spare_is_left_and_grows_back(tmp_path: Path) -> None:
    root = tmp_path / "root"
    code, run_dir, out = run_job(
        tmp_path,
        "shrink",
        nodes=3,
        steps=60,
        extra=(
            "--on-no-spare", "shrink", "--persist", str(root), "--persist-every", "4",
            "--keep", "100", "--inject", "kill:node=1:step=6",
        ),
        train_args=("--sleep", "0.2", "--out-start", str(tmp_path / "start")),
    )  # fmt: skip
    assert code == 0, out
    (shrank,) = events(run_dir, "shrank")
    assert (shrank["nodes"], shrank["world_size"], shrank["from_world_size"]) == (2, 2, 3)
    assert shrank["lost"] == [1] and shrank["renumbered"] == {"2": 1}
    # it went on from the newest step the memory tiers held, not tier 2's step 4: the
    # lost rank 1's part written from its replica on node 2, equal to what rank 0 (its
    # own tier 0) wrote, as DDP keeps every rank's parameters and optimizer state equal
    (salvage,) = events(run_dir, "salvaging")
    assert salvage["replicas"] == {"1": 2} and salvage["step"] == shrank["step"] >= 5
    assert shrank["redone"] <= 1
    step = shrank["step"]
    lost, kept = _trained_bytes(root, step, 1), _trained_bytes(root, step, 0)
    assert lost and lost == kept
    assert "leaves the bit-exact path" in out
    (growing,) = events(run_dir, "growing")
    assert (growing["nodes"], growing["from_world_size"]) == (3, 2)
    moves = [(e["from_world_size"], e["world_size"]) for e in events(run_dir, "resharded")]
    assert moves == [(3, 2), (2, 3)], moves
    sizes = [g["world_size"] for g in events(run_dir, "generation_started")]
    assert sizes == [3, 2, 3], sizes
    (done,) = events(run_dir, "job_finished")
    assert done["step"] == 59 and done["restarts"] == 1, "growing back is no failure"
    assert len(final_state(tmp_path, "shrink")) == 3
    # the grown job started from exactly the 2-rank step it grew from: every rank
    _, want = load_full(str(root), growing["step"])
    want_t = {k: v for k, v in _flat(want).items() if isinstance(v, torch.Tensor)}
    started = load_final(tmp_path / "start")
    assert sorted(started) == [f"rank-{r:05d}.safetensors" for r in range(3)]
    for rank, state in sorted(started.items()):
        got = _named(state)
        assert got and set(got) <= set(want_t), set(got) - set(want_t)
        bad = [k for k, v in got.items() if not torch.equal(v, want_t[k])]
        assert not bad, f"rank {rank}: {bad[:3]}"
    assert catalog.verify(str(root)) == []
    assert not leaked_segments(tmp_path)
