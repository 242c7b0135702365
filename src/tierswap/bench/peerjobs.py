"""``tierswap bench peers``' systems and how their jobs start: which systems there are
(tierswap's and the peers'), each one's command line, the environment every job runs with,
and what a job leaves behind in shared places that is cleaned up after it.

Kept apart from the rounds (:mod:`tierswap.bench.peers`) so that what a system *is* (its
options, its launcher, the settings the report gives for it) reads in one place, and the
tests can build a job's command without running one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tierswap
from tierswap.bench import overhead
from tierswap.bench.common import run_bounded
from tierswap.cluster.address import HUGE_PAGES_ENV
from tierswap.config import Config as TierswapConfig
from tierswap.examples import FOLDER, job_command
from tierswap.shm import remove_job_segments
from tierswap.tunables import TUNABLES_ENV, nt_tunables

MLP = FOLDER / "train_mlp.py"
STEPS, KILL, VICTIM = 14, 8, 1
FIRST = 4
"""Steps before this one are left out of step times and stalls: first saves allocate."""
PEER_LIBS = {"dlrover": "dlrover.trainer.torch.flash_checkpoint.ddp", "torchft": "torchft"}
"""What a system needs in the peers' Python, by the name ``not_run`` gives."""

CHECKPOINT = ("plain", "memcpy", "stream", "tier0", "tier01", "tier012", "dlrover-memory",
              "dcp-async", "torch-save")  # fmt: skip
CONTROLS = ("plain", "memcpy", "stream")
"""The checkpoint systems that are the others' yardsticks, not tools a user would pick."""
RECOVERY = ("tierswap-worker-spare", "tierswap-node-spare", "tierswap-restart",
            "dlrover-restart", "torchft-heal", "torchrun-dcp")  # fmt: skip
TIERSWAP_RUN = {
    "plain": ("--replicas", "0"),
    "memcpy": ("--replicas", "0"),
    "stream": ("--replicas", "0"),  # the script sends its bare copies itself
    "tier0": ("--replicas", "0"),
    "tier01": (),
    "tier012": ("--persist-every", "1"),  # and --persist <folder>
    "tierswap-worker-spare":
        ("--spare-workers", "1", "--inject", f"kill:rank={VICTIM}:step={KILL}"),
    "tierswap-node-spare": ("--spares", "1", "--inject", f"kill:node={VICTIM}:step={KILL}"),
    "tierswap-restart": ("--inject", f"kill:rank={VICTIM}:step={KILL}"),
}  # fmt: skip
"""``tierswap run`` options of each tierswap system (2 nodes of 1 rank each)."""
PEER_SYSTEM = {
    "dlrover-memory": "dlrover",
    "dlrover-restart": "dlrover",
    "torchft-heal": "torchft",
    "torchrun-dcp": "torchrun-dcp",
    "dcp-async": "dcp-async",
    "torch-save": "torch-save",
}
"""``train_peer.py --system`` of each peer system."""
REFERENCE = {s: "tierswap" for s in RECOVERY if s.startswith("tierswap")} | {
    "dlrover-restart": "dlrover",
    "torchft-heal": "torchft",
    "torchrun-dcp": "torchrun-dcp",
}
"""The uninterrupted run each recovery is compared with, bit for bit."""
OWN_REFERENCE = {"tierswap": "tier01", "dlrover": "dlrover-memory"}
"""The checkpoint system whose first-round job is also that system's uninterrupted run
for the recoveries (the same command with no kill; its final state written too), so the
reference costs no job of its own where it runs."""
ACCOUNTED = {"tierswap-worker-spare": "worker", "tierswap-node-spare": "node"}
"""The recoveries whose events also give ``bench recovery``'s account of the way back
(:func:`tierswap.bench.recovery.account`) at this size, by its kill's name there."""
PINNED = "-pinned"
"""The suffix of a tierswap system's pinned twin (``tier0-pinned``: ``overhead.pin_args``)."""
OVERHEAD = {s + pin: s + pin.replace("-", "_") for s in overhead.MODES
            for pin in ("", PINNED)}  # fmt: skip
"""The systems whose jobs also give ``bench overhead``'s figures, by their keys there."""


def tierswap_side(system: str) -> bool:
    """Whether ``system`` is trained by ``tierswap run`` (not a peer's launcher)."""
    base = system.removesuffix(PINNED)
    return base.startswith("tier") or base in (*CONTROLS, "tierswap")


def peers_folder() -> Path:
    """``bench/peers`` of the checkout tierswap runs from."""
    folder = Path(tierswap.__file__).resolve().parents[2] / "bench" / "peers"
    if not (folder / "train_peer.py").is_file():
        raise FileNotFoundError(
            f"{folder / 'train_peer.py'}: the peer scripts are missing. `tierswap bench peers` "
            "runs from a checkout of the repository (an installed wheel has no bench/)"
        )
    return folder


def default_peers_python() -> Path | None:
    """``.venv-peers``' Python beside ``bench/``, where ``make bench-peers`` makes it; None
    where it was not made (then only the torch-only peers run, in this Python)."""
    path = Path(tierswap.__file__).resolve().parents[2] / ".venv-peers" / "bin" / "python"
    return path if path.exists() else None


def probe(python: Path | None) -> dict[str, Any]:
    """Versions of torch and the peers in ``python`` (None where a peer is missing)."""
    code = (
        "import importlib, importlib.metadata as m, json\n"
        "out = {}\n"
        f"for name, mod in {dict(PEER_LIBS, torch='torch')!r}.items():\n"
        "    try:\n"
        "        importlib.import_module(mod)\n"
        "        out[name] = m.version(name)\n"
        "    except Exception as e:\n"
        "        out[name] = None\n"
        "        out[name + '_error'] = repr(e)[:300]\n"
        "print(json.dumps(out))\n"
    )
    exe = str(python) if python is not None else sys.executable
    res = subprocess.run([exe, "-c", code], capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise RuntimeError(f"{exe} could not report its packages:\n{res.stderr[-2000:]}")
    found: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    found["python"] = exe
    return found


_D = TierswapConfig(nodes=2)  # (the jobs' defaults: 2 nodes)
_P = TierswapConfig(nodes=2, persist="x")
SETTINGS = {
    "tierswap": f"tierswap run --nodes 2 --threads 1 (defaults: {_D.tier0_slots} slots, "
    f"{_P.tier0_slots} with --persist, {_D.peer_slots} peer slots, 1 full "
    "replica: parity needs 3 nodes); tier0: --replicas 0; tier012: --persist <local dir> "
    "--persist-every 1",
    "dlrover": "dlrover-run --standalone --nproc_per_node 2 --max_restarts 1 (its local master "
    "started by bench/peers/dlrover_standalone.py); DdpCheckpointer.save_checkpoint(step, "
    "{model, optim, step}, storage_type=MEMORY) every step; the loaded state cloned",
    "torchft": "torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms "
    "10000 (README); 2 replica groups of 1 rank, each under torchrun --max-restarts 1; "
    "Manager(min_replica_size=1, ProcessGroupGloo(timeout=5 s), timeout=30 s, default "
    "HTTP checkpoint transport); trains until 14 steps are committed and the last had both "
    "groups",
    "torchrun-dcp": "torchrun --max-restarts 1 --monitor-interval 0.1; dcp.save every step "
    "and a latest marker, the restarted attempt loads the newest",
    "dcp-async": "dcp.async_save every step on a gloo group of its own, the previous save "
    "waited for first (stall includes that wait)",
    "torch-save": "rank 0 torch.save to a temporary file, flush + os.fsync, os.replace",
}
"""How each system's jobs run, as the report's configuration gives it (the same for every
size and round)."""


@dataclass(frozen=True, slots=True)
class Commands:
    """The command lines of one run's jobs: every system trains the same ``steps`` of the
    same ``size_mib``, so that their times compare."""

    steps: int
    """Steps of every job."""
    size_mib: int
    """MiB of state per rank."""
    python: str
    """The Python the peer scripts run with."""
    scripts: Path
    """The peer scripts' folder (:func:`peers_folder`)."""

    def script_args(self, folder: Path, out: bool) -> list[str]:
        """The training script's own options, the same for every system: its steps, its
        size, its times file in ``folder`` and (``out``) its final state there too."""
        args = [
            "--steps",
            str(self.steps),
            "--size-mib",
            str(self.size_mib),
            "--times",
            str(folder / "times.jsonl"),
        ]
        return [*args, "--out", str(folder / "out")] if out else args

    def tierswap_cmd(self, system: str, folder: Path, out: bool = False) -> list[str]:
        """``tierswap run`` of a tierswap system (its pinned twin too), writing its final
        state where it is a recovery or a reference, or ``out`` asks."""
        base = system.removesuffix(PINNED)
        run_args = ["--nodes", "2", *TIERSWAP_RUN.get(base, ())]
        if base == "tier012":
            run_args += ["--persist", str(folder / "persist")]
        if system.endswith(PINNED):
            run_args += overhead.pin_args()
        out = out or system in RECOVERY or system == "tierswap"
        script = self.script_args(folder, out=out)
        control = {"plain": ["--plain"], "memcpy": ["--plain", "--memcpy"],
                   "stream": ["--plain", "--memcpy", "--stream"]}.get(base, [])  # fmt: skip
        return job_command(folder / "run", run_args, [*script, *control], script=MLP)

    def peer_cmd(self, system: str, folder: Path, kind: str, out: bool = False) -> list[str]:
        """A peer system's job under its own launcher (``kind``: checkpoint, recovery, whose
        rank 1 kills itself after step ``KILL``, or reference); all but checkpoint jobs
        write their final state, as ``out`` asks of a checkpoint job too."""
        peer = PEER_SYSTEM.get(system, system)
        script = str(self.scripts / "train_peer.py")
        kill = kind == "recovery"
        args = [*self.script_args(folder, out=out or kind != "checkpoint"), "--ckpt",
                str(folder / "ckpt"), *(["--kill-step", str(KILL)] if kill else [])]  # fmt: skip
        if peer == "torchft":
            pair = str(self.scripts / "torchft_pair.py")
            return [self.python, pair, "--groups", "2", "--", *args]
        if peer == "dlrover":
            launch = [self.python, str(self.scripts / "dlrover_standalone.py"), "--standalone",
                      "--nproc_per_node", "2", "--max_restarts", "1"]  # fmt: skip
        else:
            launch = [self.python, "-m", "torch.distributed.run", "--standalone",
                      "--nproc-per-node", "2", "--max-restarts", "1",
                      "--monitor-interval", "0.1"]  # fmt: skip
        return [*launch, script, "--system", peer, *args]


def same_env() -> dict[str, str]:
    """Given to every system's jobs: what tierswap's agent gives its workers by default
    (``worker_env``), so that no system's step or restore runs under other settings than
    another's: torch's CPU allocator on transparent huge pages (no 4 KiB page faults) and
    glibc's non-temporal threshold at 1 MiB (large copies around the cache). A value
    already set (``THP_MEM_ALLOC_ENABLE=0``, to compare without) is kept, for every system
    alike."""
    out = {HUGE_PAGES_ENV: os.environ.get(HUGE_PAGES_ENV, "1")}
    tunables = nt_tunables(dict(os.environ)).get(TUNABLES_ENV)
    return out if tunables is None else {**out, TUNABLES_ENV: tunables}


def bounded(cmd: list[str], folder: Path, timeout: float, tmp: Path, run_dir: Path | None) -> int:
    """``run_bounded`` with the peers' temporary files (torchrun's logs) in ``tmp`` and
    :func:`same_env` set."""
    changed = {"TMPDIR": str(tmp), **same_env()}
    old = {k: os.environ.get(k) for k in changed}
    os.environ.update(changed)
    try:
        return run_bounded(cmd, folder / "output.log", folder, timeout, run_dir)
    finally:
        for k, v in old.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


LEFTOVER_DIRS = (Path("/dev/shm"), Path("/tmp/ckpt_sock"), Path("/tmp/dlrover"))
"""Where DLRover leaves its shared memory, sockets and event logs, whatever TMPDIR says."""


def leftovers(dirs: tuple[Path, ...] = LEFTOVER_DIRS) -> set[Path]:
    """What is in those folders now, and the folders themselves."""
    return {x for d in dirs if d.is_dir() for x in (d, *d.iterdir())}


def clean(before: set[Path], run_dir: Path | None, dirs: tuple[Path, ...] = LEFTOVER_DIRS) -> None:
    """Remove what the job left in the shared places: DLRover's files that were not there
    before it (and its folders, when it made them), and a tierswap job's shared memory
    (its ids from its event log). Of /dev/shm, only DLRover's own segments."""
    for x in leftovers(dirs) - before:
        if x.parent == dirs[0] and "_ckpt_shm_" not in x.name:
            continue  # another program's shared memory
        if x.is_dir():
            shutil.rmtree(x, ignore_errors=True)
        else:
            x.unlink(missing_ok=True)
    events = None if run_dir is None else run_dir / "events.jsonl"
    if events is not None and events.exists():
        for line in events.read_text().splitlines():
            if '"job_started"' in line:
                remove_job_segments(str(json.loads(line)["job_id"]))
