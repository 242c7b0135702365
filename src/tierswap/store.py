"""The rendezvous store workers build their process groups on, behind the job's secret.

torch's ``TCPStore`` listens on every interface and serves anyone who connects (reads,
writes, a list of its keys). This store keeps torch's semantics and none of that: the
launcher runs a :class:`~tierswap.keystore.StoreServer` on ``--bind`` only, over the
job's authenticated channels (the secret's handshake, a MAC on every frame), holding the
keys as torch's in-memory ``HashStore`` would, without torch; each worker hands
``init_process_group`` a :class:`StoreClient`, a ``torch.distributed.Store`` whose
operations are calls to it. A process without the
secret is refused at the handshake and never reaches a key.

One connection per worker process, one thread per connection on the server.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import Store

from tierswap.control import protocol as p
from tierswap.handshake import AuthenticationError, HandshakeCut
from tierswap.keystore import StoreServer
from tierswap.wire import Address, Channel

__all__ = ["StoreClient", "StoreServer"]

SLACK_S = 30.0
"""Seconds a call waits for its reply beyond the wait it asks the server for."""


def _bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class StoreClient(Store):
    """A worker's end of the job's store: a ``torch.distributed.Store`` for
    ``init_process_group``; every operation is one call to the :class:`StoreServer`.

    Failures are torch's: ``DistStoreError`` for a wait that timed out,
    ``DistNetworkError`` for a store that cannot be reached (the connection is then made
    again at the next call, so that a late reply is never read as another call's).

    Keep it referenced for as long as a process group uses it: torch holds the C++ side
    only, and once the Python object is collected its methods are gone ("Not
    implemented" from inside ``init_process_group``)."""

    def __init__(self, address: Address, secret: bytes, timeout: timedelta) -> None:
        super().__init__()
        self.set_timeout(timeout)
        self.address = address
        self._secret = secret
        self._chan: Channel | None = None
        self._lock = threading.Lock()
        self._channel(deadline=time.monotonic() + timeout.total_seconds())

    def _channel(self, deadline: float) -> Channel:
        """The connection, made (again) if need be; retried until ``deadline``, as torch's
        client retries (the launcher may still be starting)."""
        if self._chan is not None:
            return self._chan
        wait = 0.05
        while True:
            try:
                self._chan = Channel.connect(self.address, self._secret, p.StoreToWorker)
                return self._chan
            except (OSError, EOFError) as e:
                if isinstance(e, AuthenticationError) and not isinstance(e, HandshakeCut):
                    raise  # another secret: retrying cannot help
                left = deadline - time.monotonic()
                if left <= 0:
                    raise dist.DistNetworkError(
                        f"the job's store at {self.address} cannot be reached: {e}"
                    ) from None
                time.sleep(min(wait, left))
                wait = min(1.0, wait * 2)

    def _call(self, msg: p.Message, reply: Any, wait: float | None = 0.0) -> Any:
        """One request and its reply; ``wait``: the server may take that long (None: for
        ever)."""
        with self._lock:
            chan = self._channel(deadline=time.monotonic() + self._timeout_s())
            try:
                return chan.call(msg, reply, timeout=None if wait is None else wait + SLACK_S)
            except RuntimeError as e:  # the server's Error: a wait that timed out, say
                raise dist.DistStoreError(f"store at {self.address}: {e}") from None
            except (OSError, EOFError, ValueError) as e:  # a late reply would be misread
                chan.close()
                self._chan = None
                kind = dist.DistStoreError if isinstance(e, TimeoutError) else dist.DistNetworkError
                raise kind(f"store at {self.address}: {type(e).__name__}: {e}") from None

    def _timeout_s(self) -> float:
        seconds: float = self.timeout.total_seconds()  # type: ignore[attr-defined]
        return seconds

    def _wait_s(self, timeout: timedelta | None) -> float | None:
        """Seconds the server may wait; None (0 in torch's terms) is for ever."""
        seconds = self._timeout_s() if timeout is None else timeout.total_seconds()
        return None if seconds == 0 else seconds

    def set(self, key: str, value: Any) -> None:
        self._call(p.StoreSet(key=key, value=_bytes(value)), p.Ack)

    def get(self, key: str) -> bytes:
        wait = self._wait_s(None)
        msg = p.StoreGet(key=key, timeout=wait or 0.0)
        value: bytes = self._call(msg, p.StoreValue, wait).value
        return value

    def add(self, key: str, amount: int) -> int:
        value: int = self._call(p.StoreAdd(key=key, amount=int(amount)), p.StoreNumber).value
        return value

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        msg = p.StoreCompareSet(key=key, expected=_bytes(expected), desired=_bytes(desired))
        value: bytes = self._call(msg, p.StoreValue).value
        return value

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        wait = self._wait_s(timeout)
        self._call(p.StoreWait(keys=list(keys), timeout=wait or 0.0), p.Ack, wait)

    def check(self, keys: list[str]) -> bool:
        ok: bool = self._call(p.StoreCheck(keys=list(keys)), p.StoreFlag).ok
        return ok

    def delete_key(self, key: str) -> bool:
        ok: bool = self._call(p.StoreDelete(key=key), p.StoreFlag).ok
        return ok

    def num_keys(self) -> int:
        value: int = self._call(p.StoreCount(), p.StoreNumber).value
        return value

    def close(self) -> None:
        with self._lock:
            if self._chan is not None:
                self._chan.close()
                self._chan = None
