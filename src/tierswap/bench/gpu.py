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

Every section but ``env`` runs under a deadline (a job past its own is killed, every host
it started with it; the jobs get what is left of ``TOTAL_S``; the snapshot section, on a
thread of its own, is left behind, its stack recorded), and a watchdog dumps every
thread's stack and exits past ``WATCHDOG_S``. Each section records its error, beside what
it measured before it, instead of stopping the rest, and any error, skip, test that did
not pass, difference or skipped snapshot makes the exit code 1. The JSON goes to
``--json`` (default ``gpu-check.json`` in the current folder), rewritten after each
section, so that a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierswap.bench.common import run_bounded
from tierswap.cluster.workers import STARTS_ALONE

TESTS = Path(__file__).resolve().parents[3] / "tests" / "test_cuda.py"
"""The CUDA tests, beside the package in a checkout (absent from an installed wheel)."""
SECTION_S = {"cuda_tests": 150.0, "snapshot": 120.0, "jobs": 150.0}
"""Each section's expected bound (the tests' and the snapshot's are their deadlines)."""
BEFORE_MAIN_S = 40.0
"""What ``make gpu-check`` may spend before :func:`main` starts the clock: the wheels'
install, its import check and this process's imports, each with an ``import torch`` (the
first on a fresh machine reads torch from a cold disk)."""
WATCHDOG_S = 8 * 60 - BEFORE_MAIN_S - 15.0
"""Past this from :func:`main`'s start (a hang outside the deadlines), every thread's
stack is dumped and the process exits: with what came before main and 15 s to spare,
under the 8 minutes the target promises, with the JSON of the sections done."""
TOTAL_S = WATCHDOG_S - 30.0
"""The run's budget from its start: the jobs get what the sections before them left,
and a job killed at its deadline has 30 s to be cleaned up before the watchdog."""
TAIL = 6000
"""Characters of pytest's output kept: enough for a hung test's stacks."""
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


def collected(text: str) -> int | None:
    """The number of tests pytest found (its ``collected 7 items`` line, not in ``-q``)."""
    found = re.search(r"^collected (\d+) items?", text, re.MULTILINE)
    return int(found.group(1)) if found else None


def _outcome(out: bytes | str | None, err: bytes | str | None) -> dict[str, Any]:
    """pytest's output, as counts and a tail (bytes where it timed out: text or not,
    ``TimeoutExpired`` holds what was read as bytes)."""
    text = "".join(o.decode(errors="replace") if isinstance(o, bytes) else o or ""
                   for o in (out, err))  # fmt: skip
    return {"collected": collected(text), "counts": summary_counts(text), "tail": text[-TAIL:]}


def cuda_tests(deadline_s: float) -> dict[str, Any]:
    """The CUDA tests in a pytest of their own, stopped at ``deadline_s`` with what they
    printed kept. pytest-timeout's thread method ends a test stuck in C code (a CUDA or
    NCCL call, which its signal method cannot interrupt) and prints every thread's stack."""
    if not TESTS.exists():
        return {"skipped": f"{TESTS} is not here (run from a checkout)"}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
           "-o", "timeout_method=thread", str(TESTS)]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # a hang's output is not left in a buffer
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=deadline_s, env=env)
    except subprocess.TimeoutExpired as e:
        return {"error": f"pytest ran past its {deadline_s:g} s deadline",
                **_outcome(e.stdout, e.stderr)}  # fmt: skip
    return {"code": done.returncode, **_outcome(done.stdout, done.stderr)}


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


def _within(deadline_s: float, fill: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """The figures ``fill`` stores into its dict as it measures them, run on a thread of
    its own for at most ``deadline_s``: an error or a hang is stored beside the figures
    before it instead of discarding them, and a hang (its stack stored; the thread, a
    daemon, left behind) cannot eat the time of the sections after it."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            fill(out)
        except Exception as e:  # stored in the section's result, the figures kept
            out.update(error=f"{type(e).__name__}: {e}", trace=traceback.format_exc())

    thread = threading.Thread(target=target, name="tierswap-gpu-section", daemon=True)
    thread.start()
    thread.join(deadline_s)
    if thread.is_alive():
        frame = sys._current_frames().get(thread.ident or 0)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
        out.update(error=f"still running at its {deadline_s:g} s deadline", trace=stack, hung=True)
    return dict(out)  # (a copy: a thread left behind may still write into its own)


def snapshot(
    shm_free: int,
    pairs: int,
    *,
    device: str = "cuda",
    want_params: int = 300_000_000,
    batch: int = 8,
    deadline_s: float = SECTION_S["snapshot"],
) -> dict[str, Any]:
    """Section 3: what it measured by its end, its error, or ``deadline_s``. Past that, its
    bench agent is killed and its slots unlinked here: the jobs after it need /dev/shm
    (the GPU memory the hung thread holds stays taken)."""
    rigs: list[Any] = []

    def fill(out: dict[str, Any]) -> None:
        _snapshot(out, shm_free, pairs, device, want_params, batch, rigs)

    res = _within(deadline_s, fill)
    if res.get("hung"):
        for rig in rigs:
            _abandon(rig)
    return res


def _abandon(rig: Any) -> None:
    """A rig whose thread hangs: its agent killed by its pid, its segments unlinked."""
    from tierswap.shm import remove_job_segments

    if rig.proc is not None and rig.proc.poll() is None:
        rig.proc.kill()
        rig.proc.wait(timeout=10)
    remove_job_segments(rig.job_id)


def _snapshot(
    out: dict[str, Any],
    shm_free: int,
    pairs: int,
    device: str,
    want_params: int,
    batch: int,
    rigs: list[Any],
) -> None:
    from tierswap.bench.rig import NSLOTS, Rig

    layers, width = model_size(shm_free, NSLOTS + 1, want_params)
    loop = _GPTLoop(layers, width, batch, device)
    out.update(layers=layers, width=width, params=loop.params, state_bytes=12 * loop.params,
               pairs=pairs)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="tierswap-gpu-") as tmp:
        rig = Rig(f"gpu-{os.getpid()}")
        rigs.append(rig)  # (for snapshot() to clean up after, should this thread hang)
        try:
            rig.start(Path(tmp))
            _snapshot_figures(out, loop, rig)
        finally:
            rig.close()
    if device == "cuda":
        out["pinned_copy"] = _pinned_copy(loop)


def _snapshot_figures(out: dict[str, Any], loop: _GPTLoop, rig: Any) -> None:
    """The A/B blocks, then the copy alone, each stored as soon as it is measured."""
    from tierswap.bench.common import stats
    from tierswap.bench.steps import step_overhead

    out["ab"] = step_overhead(loop, rig, out["pairs"])
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
    """The figures measured, and the error that stopped the section, if one did."""
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
    if "error" in s:
        rows.append(("snapshot every step", s["error"]))
    return rows


def _tests_passed(tests: dict[str, Any]) -> bool:
    """Every test collected ran and passed: a skip (CUDA unseen by the tests) fails too."""
    n = tests.get("collected")
    return tests.get("code") == 0 and bool(n) and tests.get("counts") == {"passed": n}


def failures(res: dict[str, Any]) -> list[str]:
    """What did not pass: a section's error or skip, tests that did not all pass (every
    test collected must: one skipped, say for want of CUDA, fails the check), a job's
    error or difference, snapshots skipped during the A/B blocks."""
    out = [f"{name}: {sec['error']}" for name, sec in res.items()
           if isinstance(sec, dict) and "error" in sec]  # fmt: skip
    tests = res.get("cuda_tests", {})
    if "skipped" in tests:
        out.append(f"cuda_tests: {tests['skipped']}")
    elif "error" not in tests and not _tests_passed(tests):
        found = f"{tests.get('counts')} of {tests.get('collected')} collected"
        out.append(f"cuda_tests: exit code {tests.get('code')}, {found}")
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

    # a hang: its stacks, then out. Left armed to the end: a section's thread left behind
    # may also hang the interpreter's exit
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    res = run(pairs=max(2, args.repeats), save=save)
    save(res)
    print(f"[gpu-check] figures in {path}")
    print(table(res))
    bad = failures(res)
    for line in bad:
        print(f"[gpu-check] FAILED {line}")
    return 1 if bad else 0
