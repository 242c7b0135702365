"""``make gpu-check`` (``tierswap bench gpu-check``): the GPU paths, on one NVIDIA machine,
in one script that ends within 8 minutes and prints its table last.

1. ``env``: torch, CUDA, the device, host memory and ``/dev/shm`` (where tier 0 lives).
2. ``cuda_tests``: ``tests/test_cuda.py`` (side-stream copy into page-locked slots, the
   slot's bytes as checksummed, the fence before ``optimizer.step()``, NCCL abort and
   rebuild in one process).
3. ``snapshot``: a GPT of a few hundred million parameters (fp32 weights and AdamW state,
   bf16 autocast), a snapshot every step against none in interleaved A/B blocks: step
   time, the trainer's stall per step, and the device-to-host copy's throughput (from
   ``take`` until the state is free, the GPU otherwise idle) against a plain copy into
   pinned memory of the same bytes. Sized to what ``/dev/shm`` holds.
4. ``jobs``: real ``tierswap run`` jobs of the example GPT on CUDA tensors (deterministic
   kernels), two ranks sharing the GPU over gloo, through a worker kill and a node kill
   with a spare, and one NCCL rank through a worker kill (its replacement process builds
   a new communicator and restores from tier 0): each must end bit for bit equal to the
   same job run without failures. (The abort of a live communicator and its rebuild in
   the same process is ``tests/test_cuda.py``'s.)

The tests and the jobs run under deadlines (a job past its own is killed, every host it
started with it; the jobs get what is left of ``TOTAL_S``); the snapshot section is
bounded by its size and pairs, and a watchdog dumps every thread's stack and exits past
``WATCHDOG_S``. Each section records its error instead of stopping the rest, and any
error, skip, failed test, difference or skipped snapshot makes the exit code 1. The JSON
goes to ``--json`` (default ``gpu-check.json`` in the current folder), rewritten after
each section, so that a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierswap.bench.common import run_bounded
from tierswap.cluster.workers import STARTS_ALONE

TESTS = Path(__file__).resolve().parents[3] / "tests" / "test_cuda.py"
"""The CUDA tests, beside the package in a checkout (absent from an installed wheel)."""
SECTION_S = {"cuda_tests": 150.0, "snapshot": 150.0, "jobs": 150.0}
"""Each section's expected bound (the tests' is their deadline)."""
TOTAL_S = 420.0
"""The run's budget from its start: the jobs get what the sections before them left."""
WATCHDOG_S = 460.0
"""Past this (a hang outside the deadlines), every thread's stack is dumped and the
process exits: under the 8 minutes promised, with the JSON of the sections done."""
COPY_ROUNDS = 5
"""Timed snapshots of the copy alone (``take`` to the fence, the GPU otherwise idle)."""


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


# ---------------------------------------------------------------- 1. env


def environment() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
    }
    shm = shutil.disk_usage("/dev/shm")
    out["dev_shm"] = {"total": shm.total, "free": shm.free}
    with contextlib.suppress(OSError, ValueError):
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        out["host_memory"] = pages
    if torch.cuda.is_available():
        prop = torch.cuda.get_device_properties(0)
        out["device"] = {"name": prop.name, "memory": prop.total_memory,
                         "count": torch.cuda.device_count()}  # fmt: skip
    return out


# ---------------------------------------------------------------- 2. the CUDA tests


def summary_counts(text: str) -> dict[str, int]:
    """pytest's last line (``3 passed, 1 skipped in 2.1s``) as counts."""
    counts: dict[str, int] = {}
    for line in reversed(text.strip().splitlines()):
        words = line.strip("= ").replace(",", "").split()
        pairs = [(words[i - 1], w) for i, w in enumerate(words) if i and words[i - 1].isdigit()]
        found = {w: int(n) for n, w in pairs if w in ("passed", "failed", "skipped", "error",
                                                      "errors")}  # fmt: skip
        if found:
            counts = found
            break
    return counts


def cuda_tests(deadline_s: float) -> dict[str, Any]:
    if not TESTS.exists():
        return {"skipped": f"{TESTS} is not here (run from a checkout)"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TESTS)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=deadline_s)
    text = done.stdout + done.stderr
    return {"code": done.returncode, "counts": summary_counts(text), "tail": text[-3000:]}


# ---------------------------------------------------------------- 3. snapshot on a real step


BLOCK = 1024
"""Context length of the check's GPT."""


def gpt_params(layers: int, width: int) -> int:
    """Parameters of the example GPT: 12 w^2 a block, and the token and position tables."""
    return 12 * layers * width * width + (256 + BLOCK) * width


def model_size(shm_free: int, slots: int, want_params: int = 300_000_000) -> tuple[int, int]:
    """(layers, width) of the GPT whose state (weights and two AdamW moments, fp32: 12
    bytes a parameter) fits ``slots`` tier-0 slots in ``shm_free`` bytes with a quarter
    to spare, at most about ``want_params`` parameters."""
    budget = min(want_params, int(shm_free * 0.75 / max(slots, 1) / 12))
    width = 1024 if budget >= gpt_params(4, 1024) else 256
    layers = max(1, (budget - (256 + BLOCK) * width) // (12 * width * width))
    return int(layers), width


class _GPTLoop:
    """A training step of the example GPT, timed on the GPU's compute stream only: the
    snapshot's copy runs on its own stream, overlapped, as in a job. (On the CPU, for the
    test suite's tiny run.)"""

    def __init__(self, layers: int, width: int, batch: int, device: str = "cuda") -> None:
        import torch

        from tierswap.examples.gpt import GPTConfig, build_model

        self.torch, self.device = torch, torch.device(device)
        self.cfg = GPTConfig(n_layer=layers, n_embd=width, n_head=width // 64, block_size=BLOCK)
        self.model = build_model(self.cfg, "single", seed=0, device=self.device)
        cuda = self.device.type == "cuda"
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=cuda)
        gen = torch.Generator().manual_seed(0)
        shape = (batch, self.cfg.block_size)
        self.x = torch.randint(0, self.cfg.vocab_size, shape, generator=gen).to(self.device)
        self.y = torch.randint(0, self.cfg.vocab_size, shape, generator=gen).to(self.device)
        self.params = sum(p.numel() for p in self.model.parameters())

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.current_stream().synchronize()

    def step(self, rig: Any) -> float:
        torch = self.torch
        self._sync()
        t0 = time.monotonic()
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = self.model(self.x, self.y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if rig is not None:
            rig.take({"model": self.model, "optim": self.opt}, required=False)
        self._sync()
        return time.monotonic() - t0


def _pinned_copy(loop: _GPTLoop) -> dict[str, Any]:
    """A plain device-to-host copy of the same tensors into page-locked memory."""
    import torch

    from tierswap.bench.common import stats

    tensors = [p.detach() for p in loop.model.parameters()]
    tensors += [t for s in loop.opt.state.values() for t in s.values() if t.is_cuda]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        t0 = time.monotonic()
        for d, t in zip(dst, tensors, strict=True):
            d.copy_(t, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.monotonic() - t0)
    return {"bytes": nbytes, "seconds": stats(times[1:]),
            "gbps": nbytes / sorted(times[1:])[len(times[1:]) // 2] / 1e9}  # fmt: skip


def _copy_alone(loop: _GPTLoop, rig: Any, rounds: int) -> list[float]:
    """Seconds from ``take`` until the state is free again (the fence: the device-to-host
    copy done), each round with nothing else in flight: the compute stream idle, the
    previous snapshot checksummed and reported. (The copy thread's own times also hold
    the wait for the step's last kernels and the checksum of every byte.)"""
    state = {"model": loop.model, "optim": loop.opt}
    times = []
    for _ in range(rounds):
        rig.sync()
        loop._sync()
        t0 = time.monotonic()
        rig.take(state, required=False)
        rig.snapshotter.fence()
        times.append(time.monotonic() - t0)
    rig.sync()
    return times


def snapshot(
    shm_free: int,
    pairs: int,
    *,
    device: str = "cuda",
    want_params: int = 300_000_000,
    batch: int = 8,
) -> dict[str, Any]:
    from tierswap.bench.common import stats
    from tierswap.bench.rig import NSLOTS, Rig
    from tierswap.bench.steps import step_overhead

    layers, width = model_size(shm_free, NSLOTS + 1, want_params)
    loop = _GPTLoop(layers, width, batch, device)
    out: dict[str, Any] = {"layers": layers, "width": width, "params": loop.params,
                           "state_bytes": 12 * loop.params, "pairs": pairs}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="tierswap-gpu-") as tmp:
        rig = Rig(f"gpu-{os.getpid()}")
        try:
            rig.start(Path(tmp))
            out["ab"] = step_overhead(loop, rig, pairs)
            st = rig.snapshotter.stats
            copies = st.copy_times[1:] or st.copy_times
            if copies:  # the copy thread's: the step's tail, the copy and the checksum
                median = sorted(copies)[len(copies) // 2]
                out["copy_and_checksum_gbps"] = out["state_bytes"] / median / 1e9
            out["skipped"] = st.skipped  # in the A/B blocks
            alone = _copy_alone(loop, rig, COPY_ROUNDS)
            if st.skipped > out["skipped"]:  # a timed take had no slot: no figure
                out["copy_skipped"] = st.skipped - out["skipped"]
            else:
                out["copy_s"] = stats(alone)
                out["copy_gbps"] = out["state_bytes"] / out["copy_s"]["median"] / 1e9
        finally:
            rig.close()
    if device == "cuda":
        out["pinned_copy"] = _pinned_copy(loop)
    return out


# ---------------------------------------------------------------- 4. jobs on CUDA tensors


JOBS: dict[str, tuple[list[str], list[str]]] = {
    "gloo_worker_kill": (["--nodes", "2"], ["--inject", "kill:rank=1:step=6"]),
    "gloo_node_kill_spare": (["--nodes", "2", "--spares", "1"], ["--inject", "kill:node=1:step=6"]),
    "nccl_worker_kill": (["--nodes", "1", "--backend", "nccl"], ["--inject", "kill:rank=0:step=6"]),
}
"""name -> (the job's shape, the failure): each against the same shape without it."""


def _job(tmp: Path, name: str, shape: list[str], extra: list[str], timeout: float) -> Path:
    from tierswap.examples import job_command

    out = tmp / f"{name}-final"
    cmd = job_command(tmp / name, [*shape, *extra],
                      ["--steps", "12", "--device", "cuda", "--out", str(out)])  # fmt: skip
    code = run_bounded(cmd, tmp / f"{name}.log", tmp, timeout, tmp / name)
    if code != 0:
        tail = (tmp / f"{name}.log").read_text()[-1500:]
        raise RuntimeError(f"{name} exited with code {code}:\n{tail}")
    return out


def jobs(deadline_s: float) -> dict[str, Any]:
    from tierswap.examples import differing, load_final

    end = time.monotonic() + deadline_s
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tierswap-gpu-") as tmp_s:
        tmp = Path(tmp_s)
        baselines: dict[str, Path] = {}
        for name, (shape, fault) in JOBS.items():
            left = end - time.monotonic()
            if left < 20:
                out[name] = {"error": "no time left"}
                continue
            t0 = time.monotonic()
            try:
                key = " ".join(shape)
                if key not in baselines:
                    baselines[key] = _job(tmp, f"base-{len(baselines)}", shape, [], left)
                got = _job(tmp, name, shape, fault, end - time.monotonic())
                diff = differing(load_final(baselines[key]), load_final(got))
                forked = STARTS_ALONE not in (tmp / f"{name}.log").read_text()
                out[name] = {"bit_exact": not diff, "differing": diff[:5],
                             "seconds": time.monotonic() - t0, "forked": forked}  # fmt: skip
            except Exception as e:  # recorded; the other jobs still run
                out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


# ---------------------------------------------------------------- the run and its table


def _guarded(
    results: dict[str, Any],
    name: str,
    fn: Callable[[], dict[str, Any]],
    save: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    t0 = time.monotonic()
    try:
        results[name] = fn()
    except Exception as e:  # one section failing must not hide the others
        results[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    results[name]["section_s"] = time.monotonic() - t0
    print(f"[gpu-check] {name}: {time.monotonic() - t0:.1f} s", flush=True)
    if save is not None:
        save(results)


def run(pairs: int = 6, save: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every section in turn; ``save`` is given the results after each one."""
    import torch

    start = time.monotonic()
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S")}
    _guarded(results, "env", environment, save)
    if not torch.cuda.is_available():
        return results
    _guarded(results, "cuda_tests", lambda: cuda_tests(SECTION_S["cuda_tests"]), save)
    shm_free = int(results["env"].get("dev_shm", {}).get("free", 0))
    _guarded(results, "snapshot", lambda: snapshot(shm_free, pairs), save)
    with contextlib.suppress(RuntimeError):  # (a CUDA error here is the section's, above)
        torch.cuda.empty_cache()  # the GPT's memory, before the jobs' processes start
    left = TOTAL_S - (time.monotonic() - start)
    _guarded(results, "jobs", lambda: jobs(left), save)
    return results


def _med(d: Any, *path: str) -> float | None:
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return float(d) if isinstance(d, int | float) else None


def table(res: dict[str, Any]) -> str:
    """The figures a reader checks first, one per line."""
    env = res.get("env", {})
    dev = env.get("device", {})
    shm = _gib(env.get("dev_shm", {}).get("free", 0))
    machine = f"{dev.get('name', 'no CUDA device')}, torch {env.get('torch')}"
    rows = [("machine", f"{machine}, CUDA {env.get('cuda')}, /dev/shm {shm} free")]
    t = res.get("cuda_tests", {})
    if t:
        counts = ", ".join(f"{n} {k}" for k, n in t.get("counts", {}).items())
        rows.append(("tests/test_cuda.py", t.get("error") or t.get("skipped") or counts))
    rows += _snapshot_rows(res.get("snapshot", {}))
    for name, j in res.get("jobs", {}).items():
        if isinstance(j, dict) and name != "error":
            exact = "bit for bit" if j.get("bit_exact") else f"DIFFERS: {j.get('differing')}"
            if "forked" in j:  # the worker template refuses to fork with CUDA initialised
                exact += ", workers forked" if j["forked"] else ", workers started alone"
            rows.append((name, j.get("error") or exact))
    if "error" in res.get("jobs", {}):
        rows.append(("jobs", res["jobs"]["error"]))
    wide = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{wide}}  {v}" for k, v in rows)


def _snapshot_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    if "error" in s:
        return [("snapshot every step", s["error"])]
    rows = []
    w = _med(s, "ab", "with_snapshot", "step_s", "median")
    wo = _med(s, "ab", "without", "step_s", "median")
    over = _med(s, "ab", "overhead", "median")
    stall = _med(s, "ab", "with_snapshot", "stall_s", "median")
    if w is not None and wo is not None and over is not None and stall is not None:
        size = f"{s['params'] / 1e6:.0f} M parameters, {_gib(s['state_bytes'])} of state"
        pairs = f"median of {s['pairs']} A/B pairs"
        times = f"{wo * 1e3:.1f} ms without, {w * 1e3:.1f} ms with ({over:+.1%}, {pairs})"
        rows += [("GPT", size), ("step, snapshot every step", times)]
        rows.append(("trainer stall", f"{stall * 1e3:.2f} ms a step ({stall / wo:.2%} of it)"))
    if s.get("skipped"):
        rows.append(("snapshots skipped", f"{s['skipped']}: the A/B figures understate the cost"))
    copy, plain = s.get("copy_gbps"), s.get("pinned_copy", {}).get("gbps")
    if copy is not None and plain:
        ratio = f"{copy:.1f} GB/s take to fence, a plain pinned copy {plain:.1f} GB/s"
        ratio += f" ({copy / plain:.2f}x)"
        rows.append(("device-to-host copy", ratio))
    return rows


def failures(res: dict[str, Any]) -> list[str]:
    """What did not pass: a section's error or skip, tests that did not all pass, a job's
    error or difference, snapshots skipped during the A/B blocks."""
    out = [f"{name}: {sec['error']}" for name, sec in res.items()
           if isinstance(sec, dict) and "error" in sec]  # fmt: skip
    tests = res.get("cuda_tests", {})
    if "skipped" in tests:
        out.append(f"cuda_tests: {tests['skipped']}")
    elif "error" not in tests and (tests.get("code") != 0 or not tests.get("counts")):
        out.append(f"cuda_tests: exit code {tests.get('code')}, {tests.get('counts')}")
    for name, j in res.get("jobs", {}).items():
        if isinstance(j, dict) and ("error" in j or j.get("bit_exact") is not True):
            out.append(f"{name}: {j.get('error') or j.get('differing')}")
    if res.get("snapshot", {}).get("skipped"):
        out.append(f"snapshot: {res['snapshot']['skipped']} snapshots skipped (no free slot)")
    if res.get("snapshot", {}).get("copy_skipped"):
        out.append(f"snapshot: {res['snapshot']['copy_skipped']} timed copies had no free slot")
    return out


def main(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu-check needs a CUDA device: torch sees none here", file=sys.stderr)
        return 2
    path = Path(args.json or "gpu-check.json")

    def save(res: dict[str, Any]) -> None:
        path.write_text(json.dumps(res, indent=1, default=str))

    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)  # a hang: its stacks, then out
    try:
        res = run(pairs=max(2, args.repeats), save=save)
    finally:
        faulthandler.cancel_dump_traceback_later()
    save(res)
    print(f"[gpu-check] figures in {path}")
    print(table(res))
    bad = failures(res)
    for line in bad:
        print(f"[gpu-check] FAILED {line}")
    return 1 if bad else 0
