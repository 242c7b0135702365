"""Exception types a user of tierswap may need to catch or read."""

from __future__ import annotations


class TierswapError(Exception):
    """Base class of every error tierswap raises on purpose."""


class UsageError(TierswapError, ValueError):
    """The job cannot go on because of its input; restarting it would fail the same way.

    A worker that raises one stops the whole job (no restart loop), and every tier keeps
    what it holds.
    """


class NotSerializableError(UsageError, TypeError):
    """A value in the training state cannot be stored without pickle."""


class StateMismatchError(UsageError):
    """A saved snapshot does not fit the state it is restored into (shape, dtype, keys)."""


class CorruptPartError(TierswapError):
    """A stored part is truncated, corrupt or missing; restores skip it for an older step."""

    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"{where}: {why}")
        self.where = where
        self.why = why


class JobFailedError(TierswapError):
    """The job stopped for good (no restore source left, too many failures, a usage error)."""


class GenerationEnded(BaseException):
    """Raised inside ``train(job)`` when the job's membership changes (a node failed
    elsewhere): it unwinds the training loop so that this worker, in the same process,
    joins the next generation and enters ``train(job)`` again.

    It derives from BaseException, as KeyboardInterrupt does, so that a loop's
    ``except Exception`` lets it through; do not catch it.
    """


class Deposed(BaseException):
    """This coordinator leads the job no more (``--rdzv-backend etcd``: another one took
    it over): it must act no further. A BaseException, so that no ``except Exception``
    on the way lets it act on."""


def listed(items: list[str], most: int = 8) -> str:
    """``items`` for a message: the first ``most`` of them and how many more."""
    more = f" and {len(items) - most} more" if len(items) > most else ""
    return ", ".join(items[:most]) + more
