"""Where a survivor's step may be cut short once its generation has ended.

A worker whose generation ends (a failure elsewhere) leaves it at once: the agent's
``Abort`` makes the control thread signal the training loop's thread
(:data:`SIGNAL`), whose handler raises ``GenerationEnded`` there, unless that thread is
inside one of tierswap's own calls (:func:`own_call`): a message half sent or a reply left
unread would corrupt the channel it uses. Those calls run to their end and the next step
boundary raises instead. Off with ``--no-interrupt-steps``.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

SIGNAL = signal.SIGRTMIN + 2
"""A real-time signal: the usual ones (SIGUSR1 and 2, SIGTERM) belong to schedulers and
training frameworks."""

_local = threading.local()


@contextmanager
def own_call() -> Iterator[None]:
    """Mark the calling thread as inside tierswap's code: not to be cut short."""
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    try:
        yield
    finally:
        _local.depth = depth


def in_own_call() -> bool:
    """Whether the calling thread is inside tierswap's code (:func:`own_call`)."""
    return getattr(_local, "depth", 0) > 0
