"""The base of every control-plane message and the envelope it travels in
(:mod:`tierswap.control.protocol` has the messages, grouped by channel)."""

from __future__ import annotations

from typing import Any, ClassVar, Generic, TypeVar

import msgspec

Address = tuple[str, int]
Tree = dict[str, Any]
"""The non-tensor part of a rank's state (JSON-like values, never code)."""


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="op"):
    """Base of every message."""

    scoped: ClassVar[bool] = True
    """A message about one generation: dropped at the receiver's door once that generation
    has ended. Host-level messages (hello, ready, beat, ...) set it False."""
    call: ClassVar[bool] = False
    """A request whose sender waits for a reply (a dropped one is answered with Error)."""


M = TypeVar("M", bound=Message)


class Envelope(msgspec.Struct, Generic[M], frozen=True, array_like=True):
    """What goes on the wire: the sender's generation and one message."""

    gen: int
    msg: M
