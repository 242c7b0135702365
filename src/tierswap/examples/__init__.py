"""Example training scripts, shipped with the package so that ``tierswap demo``, the
benchmarks and the tests run them from an installed wheel as from a checkout:
``train_gpt.py`` (a small GPT, DDP / FSDP2), ``train_embedding.py`` (a sparse embedding),
``torchrun_gpt.py`` (the same GPT under torchrun with DCP, the baseline users have) and
``gpt.py`` (the model they share). Run one with ``tierswap run`` and its path,
``python -c "import tierswap.examples as e; print(e.FOLDER)"``.

Also what their runs are judged by: the final states a run wrote with ``--out``, compared
bit for bit.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file

FOLDER = Path(__file__).resolve().parent
EXAMPLE = FOLDER / "train_gpt.py"


def load_final(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The final states a run of ``train_gpt.py`` wrote with --out, by rank file."""
    return {p.name: load_file(p) for p in sorted(folder.glob("rank-*.safetensors"))}


def differing(
    a: dict[str, dict[str, torch.Tensor]], b: dict[str, dict[str, torch.Tensor]]
) -> list[str]:
    """Names (rank/key) of tensors whose bytes differ, or that one side lacks."""
    out = [f"{r}: missing" for r in a.keys() ^ b.keys()]
    for rank in sorted(a.keys() & b.keys()):
        out += [f"{rank}/{k}: missing" for k in a[rank].keys() ^ b[rank].keys()]
        out += [
            f"{rank}/{k}"
            for k in sorted(a[rank].keys() & b[rank].keys())
            if not _bits(a[rank][k]).equal(_bits(b[rank][k]))
        ]
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def job_command(
    run_dir: Path, run_args: Sequence[str], script_args: Sequence[str], script: Path = EXAMPLE
) -> list[str]:
    """``tierswap run`` of the example (or ``script``) with 1 torch thread per worker."""
    return [
        sys.executable,
        "-m",
        "tierswap.cli",
        "run",
        "--threads",
        "1",
        "--run-dir",
        str(run_dir),
        *run_args,
        str(script),
        *script_args,
    ]
