"""The server side of the job's rendezvous store, without torch: the launcher runs it and
never imports torch (which costs it 1.5 s of CPU at every start, before any agent runs).

:class:`Keys` holds the keys with the semantics of torch's in-memory ``HashStore``
(``set``, ``get`` after a wait, ``add`` on decimal counters, ``compare_set``, ``wait``
with 0 as for ever, ``check``, ``delete_key``, ``num_keys``); :class:`StoreServer`
answers :mod:`tierswap.store`'s clients from it over the job's authenticated channels.
"""

from __future__ import annotations

import threading
import time

from tierswap.control import protocol as p
from tierswap.serving import Server
from tierswap.wire import Channel

INT64 = (-(2**63), 2**63 - 1)
LONGEST_WAIT_S = 3600.0
"""The longest one wait on the condition (a longer timeout waits again)."""


class KeyTimeout(TimeoutError):
    """A wait for keys that did not all come within its timeout."""


class Keys:
    """Bytes by key, thread-safe; a wait is woken by every write."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self._closed = False

    def close(self) -> None:
        """Wake every wait, which then fails: the store is going away."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def set(self, key: str, value: bytes) -> None:
        with self._changed:
            self._data[key] = value
            self._changed.notify_all()

    def get(self, key: str, timeout: float) -> bytes:
        with self._changed:
            self._wait([key], timeout)
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        """The counter at ``key`` (unset or empty: 0) plus ``amount``, kept as a decimal
        string; an int64, as in torch."""
        with self._changed:
            old = self._data.get(key, b"")
            try:
                value = (int(old) if old else 0) + amount
            except ValueError:
                raise ValueError(f"key {key!r} holds {old[:32]!r}, not a counter") from None
            if not INT64[0] <= value <= INT64[1]:
                raise OverflowError(f"key {key!r}: {value} is past an int64 counter")
            self._data[key] = str(value).encode()
            self._changed.notify_all()
            return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """``desired`` where the key holds ``expected`` (or is unset and ``expected`` is
        empty); else what it holds, or ``expected`` where it is unset (torch's rule)."""
        with self._changed:
            current = self._data.get(key)
            if (current is None and not expected) or current == expected:
                self._data[key] = desired
                self._changed.notify_all()
                return desired
            return expected if current is None else current

    def wait(self, keys: list[str], timeout: float) -> None:
        with self._changed:
            self._wait(keys, timeout)

    def _wait(self, keys: list[str], timeout: float) -> None:
        deadline = None if timeout == 0 else time.monotonic() + timeout
        while missing := [k for k in keys if k not in self._data]:
            if self._closed:
                raise KeyTimeout(f"the store closed while waiting for keys {missing[:4]}")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise KeyTimeout(f"waited {timeout:g} s for keys {missing[:4]}")
            self._changed.wait(LONGEST_WAIT_S if left is None else min(left, LONGEST_WAIT_S))

    def check(self, keys: list[str]) -> bool:
        with self._changed:
            return all(k in self._data for k in keys)

    def delete_key(self, key: str) -> bool:
        with self._changed:
            return self._data.pop(key, None) is not None

    def num_keys(self) -> int:
        with self._changed:
            return len(self._data)


class StoreServer(Server):
    """The job's store, served on ``(bind, port 0)``; ``close`` stops it. One thread per
    connection: a blocking ``get`` or ``wait`` holds only its own worker."""

    incoming = p.WorkerToStore
    name = "tierswap-store"

    def __init__(self, bind: str, secret: bytes) -> None:
        self.data = Keys()
        super().__init__(bind, secret)

    def close(self) -> None:
        self.data.close()  # first: a handler blocked in a wait ends at once
        super().close()

    def handle(self, chan: Channel) -> None:
        while (env := chan.recv()) is not None:
            try:
                reply = self.answer(env.msg)
            except Exception as e:  # a timeout, a bad counter: the caller is told
                reply = p.Error(message=f"{type(e).__name__}: {e}")
            chan.send(reply)

    def answer(self, msg: p.Message) -> p.Message:
        """The reply to one request, from this store's keys. A timeout of 0 waits for
        ever, as in torch."""
        d = self.data
        match msg:
            case p.StoreSet(key=key, value=value):
                d.set(key, value)
                return p.Ack()
            case p.StoreGet(key=key, timeout=timeout):
                return p.StoreValue(value=d.get(key, timeout))
            case p.StoreAdd(key=key, amount=amount):
                return p.StoreNumber(value=d.add(key, amount))
            case p.StoreCompareSet(key=key, expected=expected, desired=desired):
                return p.StoreValue(value=d.compare_set(key, expected, desired))
            case p.StoreWait(keys=keys, timeout=timeout):
                d.wait(keys, timeout)
                return p.Ack()
            case p.StoreCheck(keys=keys):
                return p.StoreFlag(ok=d.check(keys))
            case p.StoreDelete(key=key):
                return p.StoreFlag(ok=d.delete_key(key))
            case p.StoreCount():
                return p.StoreNumber(value=d.num_keys())
        raise p.ProtocolError(f"the store does not answer {p.tag_of(msg)!r}")
