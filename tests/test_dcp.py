"""Tier 2 in and out of ``torch.distributed.checkpoint`` and Hugging Face safetensors.

The oracle is the job's own state: a step exported or read through DCP, loaded into fresh
objects with plain ``dcp.load`` (one process, 2 ranks, 4 ranks, DDP or FSDP2), holds the
same bits as the job's final state; a job started from a plain torchrun run's DCP
checkpoint ends with the same bits as that run carried on.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from e2e import events, final_state, run_job
from tierswap import names
from tierswap.cluster.launch import check_durable
from tierswap.config import Config
from tierswap.control.coordinator import CoordinatorCore
from tierswap.control.ports import DurableRoot
from tierswap.dcp import Piece, StorageReader, View, _pieces, export_dcp
from tierswap.dcp_init import init_from
from tierswap.errors import CorruptPartError, StateMismatchError, UsageError
from tierswap.examples import FOLDER, load_final
from tierswap.examples.gpt import GPTConfig, batch, build_model
from tierswap.examples.train_gpt import Counter
from tierswap.state import TensorEntry, flatten
from tierswap.tiers import catalog, durable
from tierswap.tiers.export import HF_INDEX, HF_WEIGHTS, export_hf, parse_size

CFG = GPTConfig(n_layer=2)
GATHER = Path(__file__).parent / "dcp_gather.py"


def _trained(steps: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_model(CFG, "single", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for s in range(steps):
        model(*batch(s, 0, 1, CFG)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def _write_step(root: str, step: int, state: dict[str, Any], world: int = 1) -> None:
    """``state`` as every rank's part of a committed step of ``world`` ranks."""
    flat = flatten(state)
    parts = {r: durable.write_flat(root, step, r, world, flat) for r in range(world)}
    durable.write_commit(root, step, world, parts)


def _fresh(seed: int = 5) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    model = build_model(CFG, "single", seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    msd, osd = get_state_dict(model, opt)
    return model, opt, {"model": msd, "optim": osd}


def _flat_full(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    msd, osd = get_state_dict(model, opt)
    flat, _ = flatten_state_dict({"model": msd, "optim": {"state": osd["state"]}})
    return {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want), set(got) ^ set(want)
    bad = [k for k in want if not torch.equal(got[k].view(-1).view(torch.uint8),
                                              want[k].reshape(-1).view(torch.uint8))]  # fmt: skip
    assert not bad, bad


# ---------------------------------------------------------------- in one process


def test_names_leave_wrappers_out() -> None:
    model, opt = _trained(0)
    compiled = torch.compile(model)  # never run: only its wrapper's names matter
    keys = list(compiled.state_dict())
    assert keys[0].startswith("_orig_mod.")
    mapped = names.module_names(compiled, keys)
    assert mapped[keys[0]] == keys[0].removeprefix("_orig_mod.")
    assert names.fqn(model, "blocks._checkpoint_wrapped_module.0.ln_1.weight") == (
        "blocks.0.ln_1.weight"
    )
    key, params = names.optimizer_names(opt, {"net": compiled}) or ("", [])
    assert key == "net" and params[0] == "wte.weight" and "lm_head.weight" not in params
    assert names.optimizer_names(opt, {}) is None


def test_reader_loads_a_tier2_step_into_fresh_objects(tmp_path: Path) -> None:
    model, opt = _trained()
    counter = Counter()
    counter.tokens_seen = 41
    root = str(tmp_path / "root")
    _write_step(root, 7, {"model": torch.compile(model), "optim": opt, "count": counter,
                          "epoch": 3})  # fmt: skip
    m2, o2, sd = _fresh()
    sd.update(count={"tokens_seen": 0}, epoch=0)
    dcp_load(sd, storage_reader=StorageReader(root), no_dist=True)
    set_state_dict(m2, o2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    _same(_flat_full(m2, o2), _flat_full(model, opt))
    assert o2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    assert sd["count"] == {"tokens_seen": 41} and sd["epoch"] == 3
    view = View(root)
    assert view.step == 7 and view.modules == ["model"]
    assert not any(k.startswith("__rng__") for k in view.tensors), "RNG streams stay out"


def test_reader_checks_every_part_it_reads(tmp_path: Path) -> None:
    model, opt = _trained(1)
    root = str(tmp_path / "root")
    _write_step(root, 3, {"model": model, "optim": opt})
    part = next((tmp_path / "root").glob("step-*/rank-00000.safetensors"))
    raw = bytearray(part.read_bytes())
    raw[-5] ^= 0xFF
    part.write_bytes(raw)
    _, _, sd = _fresh()
    with pytest.raises(CheckpointException) as err:
        dcp_load(sd, storage_reader=StorageReader(root), no_dist=True)
    ((why, _),) = err.value.failures.values()
    assert isinstance(why, CorruptPartError) and "checksum mismatch" in str(why)


def _entry(shape: tuple[int, ...], gs: tuple[int, ...], pl: tuple[str, ...],
           mc: tuple[int, ...]) -> TensorEntry:  # fmt: skip
    n = 1
    for d in shape:
        n *= d
    return TensorEntry("w", "F32", shape, 0, 4 * n, False, gs, pl, mc)


def test_shards_become_chunks_at_their_offsets() -> None:
    # 10 rows over 4 ranks as torch.chunk cuts them (3, 3, 3, 1), columns over a 2-D mesh
    rows = {r: (r, _entry((3 if r < 3 else 1, 4), (10, 4), ("Shard(dim=0)",), (r,)))
            for r in range(4)}  # fmt: skip
    t = _pieces("w", rows)
    assert [p.offsets for p in t.pieces] == [(0, 0), (3, 0), (6, 0), (9, 0)]
    # HSDP-like: mesh (2, 2), replicated over dim 0 of the mesh, columns sharded over dim 1
    hsdp = {
        r: (r, _entry((6, 2), (6, 4), ("Replicate()", "Shard(dim=1)"), (r // 2, r % 2)))
        for r in range(4)
    }
    t = _pieces("w", hsdp)
    assert t.pieces == (Piece(0, 0, (0, 0), (6, 2)), Piece(1, 1, (0, 2), (6, 2)))
    with pytest.raises(StateMismatchError, match="do not make a tensor"):
        _pieces("w", {0: rows[0], 1: rows[1]})
    with pytest.raises(StateMismatchError, match="merged"):
        _pieces("w", {0: (0, _entry((5, 4), (10, 4), ("Partial(sum)",), (0,)))})


def test_hf_export_shards_and_loads_strictly(tmp_path: Path) -> None:
    model, opt = _trained(1)
    root = str(tmp_path / "root")
    _write_step(root, 1, {"net": model, "optim": opt})
    one = export_hf(root, 1, str(tmp_path / "one"))
    assert one["files"] == 1 and os.listdir(tmp_path / "one") == [HF_WEIGHTS]
    many = export_hf(root, 1, str(tmp_path / "many"), max_shard_size=parse_size("300kB"))
    index = json.loads((tmp_path / "many" / HF_INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == many["files"] > 2
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    for out, listed in ((tmp_path / "one", [HF_WEIGHTS]), (tmp_path / "many", files)):
        weights: dict[str, torch.Tensor] = {}
        for f in listed:
            weights.update(load_file(out / f))
        fresh = build_model(CFG, "single", seed=9)
        fresh.load_state_dict(weights, strict=True)
        _same(dict(fresh.state_dict()), dict(model.state_dict()))
        modes = {(out / f).stat().st_mode for f in os.listdir(out)}
        assert len(modes) == 1, "every file with the same permissions"
    assert index["metadata"]["total_size"] == one["bytes"]
    with pytest.raises(UsageError, match="exists"):
        export_hf(root, 1, str(tmp_path / "one"))
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 << 30
    for bad in ("lots", "5iB", "0"):
        with pytest.raises(UsageError, match="max-shard-size"):
            parse_size(bad)


def test_init_from_loads_names_what_it_lacks_and_needs_a_step(tmp_path: Path) -> None:
    model, opt = _trained(2)
    msd, osd = get_state_dict(model, opt)
    dcp_save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    m2, o2, _ = _fresh()
    state = {"model": m2, "optim": o2, "counter": Counter()}
    with pytest.raises(StateMismatchError, match="--init-step"):
        init_from(state, str(tmp_path / "ck"))
    got = init_from(state, str(tmp_path / "ck"), step=4)
    assert got.step == 4 and got.missing == ["counter.tokens_seen"]
    _same(_flat_full(m2, o2), _flat_full(model, opt))
    with pytest.raises(UsageError, match="no DCP checkpoint"):
        init_from(state, str(tmp_path / "nothing"), step=1)


def test_a_dcp_export_carries_its_step_to_init_from(tmp_path: Path, capsys: Any) -> None:
    """``export --format dcp`` then ``run --init-from`` of it: the job goes on after the
    exported step with no --init-step; a state's own ``step`` value is kept as it was."""
    model, opt = _trained(2)
    root = str(tmp_path / "root")
    _write_step(root, 7, {"model": model, "optim": opt})
    summary = export_dcp(root, 7, str(tmp_path / "dcp"))
    assert summary["step"] == 7
    m2, o2, _ = _fresh()
    got = init_from({"model": m2, "optim": o2}, str(tmp_path / "dcp"))
    assert got.step == 7 and got.missing == []
    _same(_flat_full(m2, o2), _flat_full(model, opt))
    _write_step(root, 8, {"model": model, "step": 8})  # the state's own, the same step
    export_dcp(root, 8, str(tmp_path / "own"))
    assert init_from({"model": m2}, str(tmp_path / "own")).step == 8
    # through the command line, without torch's warning that it runs in one process
    from tierswap import cli

    with warnings.catch_warnings(record=True) as caught, pytest.raises(SystemExit) as done:
        warnings.simplefilter("always")
        cli.main(["export", root, "--step", "7", "--format", "dcp", str(tmp_path / "cli")])
    out, err = capsys.readouterr()
    assert done.value.code == 0 and json.loads(out)["step"] == 7 and err == "", err
    assert not [w for w in caught if "torch.distributed is disabled" in str(w.message)]
    assert init_from({"model": m2, "optim": o2}, str(tmp_path / "cli")).step == 7


def test_init_from_weights_only_leaves_the_optimizer_as_built(tmp_path: Path) -> None:
    model, _ = _trained(2)
    dcp_save({"model": get_state_dict(model, [])[0], "step": 9},
             checkpoint_id=str(tmp_path / "ck"), no_dist=True)  # fmt: skip
    m2 = build_model(CFG, "single", seed=5)
    o2 = torch.optim.AdamW(m2.parameters(), lr=3e-3)
    got = init_from({"model": m2, "optim": o2}, str(tmp_path / "ck"))
    assert got.step == 9 and got.missing == ["optim"]
    assert not o2.state, "no moments made for a checkpoint that has none"
    _same(dict(m2.state_dict()), dict(model.state_dict()))


def test_a_resume_from_tier_2_needs_every_key_and_checks_every_part(tmp_path: Path) -> None:
    model, opt = _trained(1)
    root = str(tmp_path / "root")
    _write_step(root, 3, {"model": model, "optim": opt})
    m2, o2, _ = _fresh()
    with pytest.raises(StateMismatchError, match=r"lacks counter\.tokens_seen"):
        init_from({"model": m2, "optim": o2, "counter": Counter()}, root, 3, tier2=True)
    part = next((tmp_path / "root").glob("step-*/rank-00000.safetensors"))
    raw = bytearray(part.read_bytes())
    raw[-5] ^= 0xFF
    part.write_bytes(raw)
    with pytest.raises(CorruptPartError, match="checksum mismatch"):
        init_from({"model": m2, "optim": o2}, root, 3, tier2=True)


def test_a_tensor_inside_a_tuple_is_refused_not_pickled(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    _write_step(root, 1, {"pair": (torch.ones(2), 3)})
    with pytest.raises(StateMismatchError, match="inside a tuple"):
        View(root)


# ---------------------------------------------------------------- real jobs


TORCHRUN_TIMEOUT_S = 90.0
"""A torchrun of these tests takes 5 to 10 s; one hung for good once in four suites (12-06),
a rank stuck as ``main()``'s locals were freed. ``examples/torchrun_gpt.py`` now leaves by
``os._exit`` before that; the dump and the rerun stay, for whatever else may hang."""


def _torchrun(
    nproc: int, script: Path, args: list[str], cwd: Path, fresh: Path | None = None
) -> None:
    """Run ``script`` under plain torchrun; a run that hangs is run once more, ``fresh``
    removed first (what it had written). The hung run is one of torch's, no tierswap code
    in it (a rank waiting on a futex, the cause not found): its ranks' Python stacks are
    kept in ``cwd/torchrun-hang-N.log``, which a warning names, so that a recurrence says
    where; a second hang fails the test."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(script), *args]  # fmt: skip
    tmp = cwd / "torchrun-tmp"  # its launcher's log folder (torchelastic_*) goes here, not /tmp
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONFAULTHANDLER": "1"}
    for attempt in (1, 2):
        code, out = _torchrun_once(cmd, cwd, env)
        if code is not None:
            assert code == 0, out
            return
        dump = cwd / f"torchrun-hang-{attempt}.log"
        dump.write_text(out)
        if attempt == 2:
            pytest.fail(f"torchrun hung twice for {TORCHRUN_TIMEOUT_S:.0f} s: {out[-3000:]}")
        warnings.warn(f"torchrun hung for {TORCHRUN_TIMEOUT_S:.0f} s and ran again; its "
                      f"ranks' stacks: {dump}\n{out[-3000:]}", stacklevel=2)  # fmt: skip
        if fresh is not None:
            shutil.rmtree(fresh, ignore_errors=True)


def _torchrun_once(cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[int | None, str]:
    """Its exit code and its output's tail; None for a run past the timeout, with its whole
    output, which ends with its ranks' threads' stacks: the launcher is stopped (SIGSTOP,
    so that it neither restarts nor stops them), the ranks get SIGABRT, which faulthandler
    catches (no core files: ``ulimit -c 0``), then all are killed by pid (torchrun starts
    each rank in a session of its own, which a kill of the launcher's group misses)."""
    no_core = ["sh", "-c", 'ulimit -c 0; exec "$@"', "sh"]
    proc = subprocess.Popen([*no_core, *cmd], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, errors="replace",
                            env=env)  # fmt: skip
    ranks: list[psutil.Process] = []
    try:
        try:
            out, err = proc.communicate(timeout=TORCHRUN_TIMEOUT_S)
            return proc.returncode, out[-3000:] + err[-3000:]
        except subprocess.TimeoutExpired:
            pass
        ranks = _stop_and_list(proc)
        for rank in ranks:
            with contextlib.suppress(psutil.Error):
                rank.send_signal(signal.SIGABRT)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(map(_running, ranks)):
            time.sleep(0.1)
        return None, _end(proc, ranks)
    except BaseException:  # pytest-timeout, say: nothing is left behind either
        _end(proc, ranks or _stop_and_list(proc))
        raise


def _stop_and_list(proc: subprocess.Popen[str]) -> list[psutil.Process]:
    """Stop the launcher (it then restarts no rank); every process under it."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGSTOP)
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        return []


def _running(p: psutil.Process) -> bool:
    """Alive and not a zombie (its parent, stopped, does not reap it)."""
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _end(proc: subprocess.Popen[str], ranks: list[psutil.Process]) -> str:
    """Kill the launcher and ``ranks`` by pid; what they wrote."""
    for each in ranks:
        with contextlib.suppress(psutil.Error):
            each.kill()
    proc.kill()
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired as e:  # a process it did not list holds the pipes
        out, err = _text(e.stdout), _text(e.stderr) + "\n(its pipes held by a process unlisted)"
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        proc.wait()
    return out + err


def _text(data: str | bytes | None) -> str:
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data or ""


def test_a_hung_torchrun_is_dumped_killed_whole_and_run_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The helper above: the first run's rank writes its output and its pid, then hangs;
    the second, finding that output removed, ends. The warning has the rank's stack."""
    script = tmp_path / "hang.py"
    script.write_text(
        "import os, sys, time\n"
        "from pathlib import Path\n"
        "out, mark = Path(sys.argv[1]), Path(sys.argv[2])\n"
        "if mark.exists():\n"
        "    sys.exit(1 if out.exists() else 0)\n"
        "mark.write_text(str(os.getpid()))\n"
        "out.mkdir()\n"
        "def waiting_for_good(): time.sleep(600)\n"
        "waiting_for_good()\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "TORCHRUN_TIMEOUT_S", 20.0)
    out, mark = tmp_path / "out", tmp_path / "mark"
    with pytest.warns(UserWarning, match="hung for 20 s and ran again") as caught:
        _torchrun(1, script, [str(out), str(mark)], tmp_path, fresh=out)
    pid = int(mark.read_text())
    rank = psutil.Process(pid) if psutil.pid_exists(pid) else None
    try:
        assert rank is None or not _running(rank), "the hung rank is gone"
        dump = tmp_path / "torchrun-hang-1.log"
        assert "waiting_for_good" in dump.read_text(), "its stack, from faulthandler"
        assert any(str(dump) in str(w.message) for w in caught)
    finally:  # that pid, if it is still the rank
        with contextlib.suppress(psutil.Error):
            if rank is not None and _running(rank) and "hang.py" in " ".join(rank.cmdline()):
                rank.kill()


def _expected(final: dict[str, dict[str, torch.Tensor]], mode: str) -> dict[str, torch.Tensor]:
    """The job's final state under DCP's names, FSDP2 shards put together (dim 0)."""
    params = [n for n, _ in build_model(CFG, "single").named_parameters()]
    ranks = [final[k] for k in sorted(final)]
    out = {}
    for key in ranks[0]:
        parts = key.split("/")
        if parts[0] == "model":
            name = "model." + parts[1].removeprefix("module.")
        elif parts[:2] == ["optim", "state"]:
            name = f"optim.state.{params[int(parts[2])]}.{parts[3]}"
        else:
            continue
        pieces = [r[key] for r in ranks]
        out[name] = torch.cat(pieces) if mode == "fsdp" and pieces[0].dim() else pieces[0]
    return out


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A plain torchrun run with DCP every step; a tierswap DDP job started from its
    step 12; a tierswap FSDP2 job. Both tierswap jobs persist to tier 2."""
    tmp = tmp_path_factory.mktemp("dcp")
    plain = ["--steps", "16", "--kill-step", "-1", "--ckpt", str(tmp / "plain")]
    _torchrun(2, FOLDER / "torchrun_gpt.py", plain, tmp, fresh=tmp / "plain")
    out = {"tmp": tmp}
    for name, mode, extra in (
        ("ddp", "ddp", ("--init-from", str(tmp / "plain" / "step-12"))),
        ("fsdp", "fsdp", ()),
    ):
        code, run_dir, log = run_job(
            tmp, name, steps=16 if mode == "ddp" else 6, mode=mode,
            extra=("--persist", str(tmp / f"{name}-root"), "--persist-every", "5", *extra),
        )  # fmt: skip
        assert code == 0, log
        out[name] = (run_dir, log, final_state(tmp, name))
    return out


def test_init_from_a_plain_dcp_run_carries_it_on_bit_for_bit(jobs: dict[str, Any]) -> None:
    tmp = jobs["tmp"]
    run_dir, log, final = jobs["ddp"]
    (init,) = events(run_dir, "initialized")
    assert init["step"] == 12 and init["missing"] == ["counter.tokens_seen"]
    assert "goes on at step 13" in log and "counter.tokens_seen" in log
    assert catalog.committed_steps(str(tmp / "ddp-root")) == [13, 15], "its first step is 13"
    # the plain run's own step 15: what tierswap's steps 13..15 must have made
    model, opt, sd = _fresh()
    dcp_load(sd, checkpoint_id=str(tmp / "plain" / "step-15"), no_dist=True)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    _same(_expected(final, "ddp"), _flat_full(model, opt))


def test_ddp_step_out_to_dcp_and_hf_loads_the_same_bits(jobs: dict[str, Any]) -> None:
    tmp = jobs["tmp"]
    _, _, final = jobs["ddp"]
    want = _expected(final, "ddp")
    root = str(tmp / "ddp-root")
    summary = export_dcp(root, 15, str(tmp / "ddp-dcp"))
    assert summary["step"] == 15 and summary["world_size"] == 2
    model, opt, sd = _fresh()
    dcp_load(sd, checkpoint_id=str(tmp / "ddp-dcp"), no_dist=True)  # DCP's default reader
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    _same(_flat_full(model, opt), want)
    got = init_from({"model": model, "optim": opt}, str(tmp / "ddp-dcp"))
    assert got.step == 15, "--init-from of it goes on at step 16, no --init-step"
    _torchrun(2, GATHER, ["--dcp", str(tmp / "ddp-dcp"), str(tmp / "ddp-2.safetensors")], tmp)
    _same(load_file(tmp / "ddp-2.safetensors"), want)
    cli = [sys.executable, "-m", "tierswap.cli", "export", root, "--format", "hf",
           str(tmp / "ddp-hf")]  # fmt: skip
    subprocess.run(cli, check=True, capture_output=True, timeout=120)
    fresh = build_model(CFG, "single", seed=3)
    fresh.load_state_dict(load_file(tmp / "ddp-hf" / HF_WEIGHTS), strict=True)
    _same({f"model.{k}": v for k, v in fresh.state_dict().items()},
          {k: v for k, v in want.items() if k.startswith("model.")})  # fmt: skip


def test_fsdp2_step_out_to_dcp_and_hf_loads_the_same_bits(jobs: dict[str, Any]) -> None:
    """Read at 4 ranks through the StorageReader: the resume test below."""
    tmp = jobs["tmp"]
    _, _, final = jobs["fsdp"]
    want = _expected(final, "fsdp")
    root = str(tmp / "fsdp-root")
    assert catalog.committed_steps(root)[-1] == 5
    export_dcp(root, 5, str(tmp / "fsdp-dcp"))
    model, opt, sd = _fresh()
    dcp_load(sd, checkpoint_id=str(tmp / "fsdp-dcp"), no_dist=True)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    _same(_flat_full(model, opt), want)
    out = tmp / "fsdp-2.safetensors"
    _torchrun(2, GATHER, ["--mode", "fsdp", "--dcp", str(tmp / "fsdp-dcp"), str(out)], tmp)
    _same(load_file(out), want)
    export_hf(root, 5, str(tmp / "fsdp-hf"))  # the shards put together, plain names
    fresh = build_model(CFG, "single", seed=3)
    fresh.load_state_dict(load_file(tmp / "fsdp-hf" / HF_WEIGHTS), strict=True)
    _same({f"model.{k}": v for k, v in fresh.state_dict().items()},
          {k: v for k, v in want.items() if k.startswith("model.")})  # fmt: skip


def test_fsdp2_job_resumed_at_4_ranks_then_at_2_from_tier_2(jobs: dict[str, Any]) -> None:
    """A job started again on its root with another world size: every parameter and
    optimizer value after the restore equals the one before, gathered, bit for bit."""
    tmp = jobs["tmp"]
    root = str(tmp / "fsdp-root")
    before = _expected(jobs["fsdp"][2], "fsdp")  # its step 5, at 2 ranks
    code, run_dir, log = run_job(
        tmp, "fsdp4", nodes=4, steps=8, mode="fsdp",
        extra=("--persist", root, "--persist-every", "5", "--keep", "4"),
        train_args=("--out-start", str(tmp / "fsdp4-start")),
    )  # fmt: skip
    assert code == 0, log
    (moved,) = events(run_dir, "resharded")
    assert (moved["step"], moved["from_world_size"], moved["world_size"]) == (5, 2, 4)
    assert "resumed step 5 of world size 2 at world size 4" in log
    started = load_final(tmp / "fsdp4-start")
    assert len(started) == 4
    _same(_expected(started, "fsdp"), before)
    # the 2-rank steps stay: a resume at 2 ranks must still take the newer 4-rank step 7
    assert catalog.committed_steps(root) == [0, 5, 6, 7]
    code, run_dir, log = run_job(
        tmp, "fsdp2", nodes=2, steps=9, mode="fsdp", extra=("--persist", root, "--keep", "4"),
        train_args=("--out-start", str(tmp / "fsdp2-start")),
    )  # fmt: skip
    assert code == 0, log
    (moved,) = events(run_dir, "resharded")
    assert (moved["step"], moved["from_world_size"], moved["world_size"]) == (7, 4, 2)
    _same(
        _expected(load_final(tmp / "fsdp2-start"), "fsdp"),
        _expected(final_state(tmp, "fsdp4"), "fsdp"),
    )


def test_a_step_of_another_size_supersedes_older_ones_of_this_size(tmp_path: Path) -> None:
    """Run at 1 rank, then 2, then 1 again (step 3): on every later launch at 1 rank the
    2-rank step 2 is the floor, and the 1-rank step 1 below it is never planned."""
    root = str(tmp_path / "root")
    state = {"model": _trained(0)[0]}
    for step, world in ((1, 1), (2, 2), (3, 1)):
        _write_step(root, step, state, world)
    cfg = Config(persist=root, init_from=str(tmp_path / "gone"))  # never read: steps exist
    assert check_durable(cfg) == (None, (2, 2))
    assert check_durable(Config(persist=root, nodes=2)) == (None, (3, 1))
    core = CoordinatorCore(cfg, job_id="t", script=["x.py"], address=("h", 1), store="h:2",
                           tier2=DurableRoot(root), now=0.0)  # fmt: skip
    core.reshard = (2, 2)
    assert core.durable_steps() == {3}
    with pytest.raises(UsageError, match="no DCP checkpoint"):
        check_durable(Config(persist=str(tmp_path / "empty"), init_from=str(tmp_path / "gone")))
