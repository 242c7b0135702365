"""A small GPT and a deterministic data source, to train on CPU in tests and benchmarks.

The model follows nanoGPT: token and position embeddings, ``n_layer`` pre-norm
transformer blocks (causal self-attention, then a GELU MLP), a final LayerNorm
and an ``lm_head`` tied to the token embedding. ``forward(idx, targets)``
returns the mean cross-entropy loss.

The data is a function of ``(step, rank)`` only (see :func:`batch`), so a run
restored at step *s* sees the batches the original run saw from *s* on.

Run ``python examples/gpt.py`` to train a few steps on one process.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

MODES = ("single", "ddp", "ddp-exact", "fsdp")


@dataclass(kw_only=True, slots=True)
class GPTConfig:
    vocab_size: int = 256
    """Tokens are bytes."""
    block_size: int = 64
    """Context length: the longest sequence the position embedding covers."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 128
    """Width of the residual stream."""

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(
                f"n_embd={self.n_embd} is not a multiple of n_head={self.n_head}: "
                "pick a head count that divides the width"
            )


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return out


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(F.gelu(self.fc(x)))
        return out


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        out: torch.Tensor = x + self.mlp(self.ln_2(x))
        return out


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(
                f"sequence of {t} tokens is longer than block_size={self.cfg.block_size}"
            )
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


@functools.lru_cache(maxsize=4)
def corpus(vocab_size: int, length: int = 1 << 16, seed: int = 1234) -> torch.Tensor:
    """A fixed random "text": a walk of ``length`` tokens on a seeded Markov chain.

    Each token has four possible successors with probabilities 0.6/0.2/0.1/0.1,
    so a model can learn it (the entropy is ~1.6 nats against ln(256) ~5.5 for
    uniform bytes).
    """
    gen = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab_size, (vocab_size, 4), generator=gen).tolist()
    weights = torch.tensor([0.6, 0.2, 0.1, 0.1])
    choices = torch.multinomial(weights, length, replacement=True, generator=gen).tolist()
    token, text = 0, []
    for k in choices:
        token = successors[token][k]
        text.append(token)
    return torch.tensor(text, dtype=torch.long)


def batch(
    step: int, rank: int, world_size: int, cfg: GPTConfig, batch_size: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets of one rank at one step: a function of its arguments."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    text = corpus(cfg.vocab_size)
    gen = torch.Generator().manual_seed((step << 16) + rank)
    starts = torch.randint(0, len(text) - cfg.block_size, (batch_size, 1), generator=gen)
    chunk = text[starts + torch.arange(cfg.block_size + 1)]
    return chunk[:, :-1], chunk[:, 1:]


def build_model(
    cfg: GPTConfig,
    mode: str = "single",
    *,
    seed: int = 0,
    train_last: int = 0,
    device: torch.device | None = None,
) -> nn.Module:
    """A GPT with the same initial weights on every rank, wrapped for ``mode``.

    ``train_last`` > 0 fine-tunes: only the last ``train_last`` blocks and the final norm
    keep ``requires_grad`` (the embeddings and the tied head are frozen).

    ``"ddp"`` and ``"ddp-exact"`` (DDP with :func:`tierswap.ddp.make_exact`) and
    ``"fsdp"`` (FSDP2: each block sharded, then the root) need the default
    process group to be initialised.
    """
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    torch.manual_seed(seed)
    model = GPT(cfg)  # made on the CPU: the same weights whatever the device
    if device is not None:
        model.to(device)
    if train_last:
        keep = {f"blocks.{cfg.n_layer - 1 - i}." for i in range(train_last)} | {"ln_f."}
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith(tuple(keep)))
    if mode == "single":
        return model
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)  # the same module, its parameters now DTensor shards
        return model

    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model)
    if mode == "ddp-exact":
        from tierswap.ddp import make_exact

        make_exact(ddp)
    return ddp


def main(steps: int = 50) -> None:
    torch.set_num_threads(1)
    cfg = GPTConfig()
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = time.monotonic()
    for step in range(steps):
        loss = model(*batch(step, 0, 1, cfg))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}")
    print(f"{(time.monotonic() - start) / steps * 1e3:.1f} ms/step")


if __name__ == "__main__":
    main()
