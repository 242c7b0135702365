"""Run under torchrun: load a checkpoint into the example GPT with plain ``dcp.load`` at
this world size, then write the gathered full state (rank 0) as one safetensors file.

    torchrun --nproc-per-node N tests/dcp_gather.py --mode fsdp (--dcp DIR | --root URL) OUT
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load

import tierswap.dcp
from tierswap.examples.gpt import GPTConfig, build_model


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the model and optimizer, unsharded, under DCP's flat names."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, opt, options=options)
    flat, _ = flatten_state_dict({"model": msd, "optim": {"state": osd.get("state", {})}})
    return {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="ddp")
    p.add_argument("--dcp", default=None)
    p.add_argument("--root", default=None)
    p.add_argument("out")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = build_model(GPTConfig(n_layer=2), args.mode, seed=7)  # not the saved weights
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    if args.dcp:
        load(sd, checkpoint_id=args.dcp)
    else:
        load(sd, storage_reader=tierswap.dcp.StorageReader(args.root))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    full = full_state(model, opt)  # a collective; with cpu_offload only rank 0 holds it
    if dist.get_rank() == 0:
        save_file({k: v.contiguous().clone() for k, v in full.items()}, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # skip the interpreter's teardown: gloo's threads, destroyed there, once aborted a rank
    # after its work was done ("terminate called without an active exception", exit -6,
    # make test on 12-05; tests/test_ddp_exact.py does the same)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
