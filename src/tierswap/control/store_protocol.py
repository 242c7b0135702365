"""Messages between workers and the rendezvous store they build their process groups on
(``store.py``): torch's c10d store operations, each a call answered by one reply (or
Error). Part of :mod:`tierswap.control.protocol`, which carries them as ``WorkerToStore``
and ``StoreToWorker``."""

from __future__ import annotations

from tierswap.control.message import Message

# The rendezvous store workers build their process groups on (``store.py``): torch's
# c10d store operations, each a call answered by one reply (or Error).


class StoreSet(Message, frozen=True, kw_only=True, tag="store_set"):
    scoped = False
    call = True
    key: str
    value: bytes


class StoreGet(Message, frozen=True, kw_only=True, tag="store_get"):
    """``key``'s value once it is set, waiting up to ``timeout`` seconds."""

    scoped = False
    call = True
    key: str
    timeout: float


class StoreAdd(Message, frozen=True, kw_only=True, tag="store_add"):
    scoped = False
    call = True
    key: str
    amount: int


class StoreCompareSet(Message, frozen=True, kw_only=True, tag="store_compare_set"):
    """Set ``desired`` if the value is ``expected`` (or the key is unset and ``expected``
    empty); the reply is the value after."""

    scoped = False
    call = True
    key: str
    expected: bytes
    desired: bytes


class StoreWait(Message, frozen=True, kw_only=True, tag="store_wait"):
    scoped = False
    call = True
    keys: list[str]
    timeout: float


class StoreCheck(Message, frozen=True, kw_only=True, tag="store_check"):
    scoped = False
    call = True
    keys: list[str]


class StoreDelete(Message, frozen=True, kw_only=True, tag="store_delete"):
    scoped = False
    call = True
    key: str


class StoreCount(Message, frozen=True, kw_only=True, tag="store_count"):
    """How many keys the store holds."""

    scoped = False
    call = True


class StoreValue(Message, frozen=True, kw_only=True, tag="store_value"):
    scoped = False
    value: bytes


class StoreNumber(Message, frozen=True, kw_only=True, tag="store_number"):
    scoped = False
    value: int


class StoreFlag(Message, frozen=True, kw_only=True, tag="store_flag"):
    scoped = False
    ok: bool
