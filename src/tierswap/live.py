"""A survivor's own state, kept from one generation to the next: the step it restores,
proven by one hash pass, or the memory that step is read into.

When a generation ends for a failure elsewhere, a surviving worker's training state is
still in its memory: the tensors its last snapshot was copied from. Unless the loop
changed them after that snapshot (an optimizer step, a buffer a forward pass updates),
they hold the very bytes of the tier-0 slot its restore reads; before, re-entering
``train(job)`` read 384 MiB a rank back from that slot (and checked them) into memory
made while the worker was parked, and threw the old tensors away. Now the snapshotter
keeps, beside each finished copy, aliases of the tensors it copied from and the checksum
it computed (:class:`Live`), and the worker carries them into its next generation. Once
``train(job)`` has built its new state and asked ``job.steps`` for it (on the training
thread: nothing of the user's runs meanwhile), the restore hashes them in the slot's
order and compares with the slot's checksum, the one every reader of the slot checks.
Equal, the new state takes them as its own (``load(adopt=True)``) and nothing is read;
different, the slot is read into their memory, hashed as it is read, and taken: the old
state is the memory the restore needed anyway, so such a worker makes none ahead.

Kept only where it is worth keeping (:func:`keepable`): plain CPU tensors (a GPU's state
is freed before the next model is built, as before), most of them the parameters' and
optimizer state's own memory; used only where the new state shares no memory with them
(an object that outlived ``train`` and is in both: the slot is read as before).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierswap.layout import Layout
from tierswap.memcopy import tensor_bytes
from tierswap.state import dtype_code

KEPT_SHARE = 16
"""A snapshot's tensors are kept as live state only where those that are not parameters or
optimizer state (buffers, RNG states, a data loader's position) are at most 1/16 of its
bytes: a ``state_dict()`` that returns copies (an EMA's, a GPU model's offloaded to the
CPU) would otherwise keep a second copy of the state alive between steps."""


def keepable(layout: Layout, tensors: list[torch.Tensor]) -> bool:
    """Whether a snapshot's ``tensors`` (in ``layout``'s order) are worth keeping as the
    live state: each a plain contiguous CPU tensor of its entry's dtype and shape, and
    most of their bytes the parameters' and optimizer state's own (:data:`KEPT_SHARE`)."""
    own = sum(e.nbytes for e in layout.entries if e.deferred)
    other = sum(e.nbytes for e in layout.entries if not e.deferred)
    return other * KEPT_SHARE <= own and _raws(layout, tensors) is not None


def _raws(layout: Layout, tensors: list[torch.Tensor]) -> list[memoryview] | None:
    """Each tensor's memory (writable, not keeping it alive: hold the tensors while these
    are used) where it is a plain contiguous CPU tensor of its entry's dtype and shape."""
    if len(tensors) != len(layout.entries):
        return None
    raws = []
    for t, e in zip(tensors, layout.entries, strict=True):
        raw = tensor_bytes(t)
        if raw is None or dtype_code(t.dtype) != e.dtype or tuple(t.shape) != e.shape:
            return None
        raws.append(raw)
    return raws


@dataclass(slots=True)
class Live:
    """The tensors one snapshot was copied from (aliases of the live state's own memory,
    not copies), in the order of its layout's entries, and the checksum of its bytes."""

    layout: Layout
    tensors: list[torch.Tensor]
    checksum: str

    def release(self) -> None:
        """Let go of the tensors (what :meth:`adoptable` returned stays with its holder)."""
        self.tensors = []

    def fits(self, layout: Layout) -> bool:
        """Whether a step of ``layout`` can be proven in, or read into, these tensors."""
        return self.raws(layout) is not None

    def raws(self, layout: Layout) -> list[memoryview] | None:
        """Each tensor's memory, writable, in the order of ``layout``'s entries, where its
        keys, dtypes and shapes are this snapshot's; else None. The views do not keep the
        tensors alive: use them while this holds them."""
        key = [(e.key, e.dtype, e.shape, e.nbytes) for e in layout.entries]
        if key != [(e.key, e.dtype, e.shape, e.nbytes) for e in self.layout.entries]:
            return None
        return _raws(self.layout, self.tensors)

    def shares_memory(self, tensors: list[torch.Tensor]) -> bool:
        """Whether any of ``tensors`` (a new state's) uses the memory of one of these."""
        mine = {t.untyped_storage().data_ptr() for t in self.tensors if t.numel()}
        return any(t.numel() and t.untyped_storage().data_ptr() in mine for t in tensors)

    def adoptable(self) -> list[torch.Tensor]:
        """The tensors, for a state to take as its own. A tensor whose bytes another entry
        also holds (a tied weight, under two keys) comes back as a copy: adopted twice, one
        memory would tie what the new state may keep apart (where the state ties them too,
        the load copies into it instead)."""
        out = [t.detach() for t in self.tensors]
        spans = sorted(
            (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i)
            for i, t in enumerate(self.tensors)
            if t.numel()
        )
        end = 0
        for start, stop, i in spans:
            if start < end:  # within bytes an entry before it holds
                out[i] = out[i].clone()
            end = max(end, stop)
        return out
