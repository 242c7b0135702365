"""The rendezvous store workers build their process groups on, behind the job's secret.

torch's ``TCPStore`` listens on every interface and serves anyone who connects (reads,
writes, a list of its keys). This store keeps torch's semantics and none of that: the
launcher runs a :class:`StoreServer` on ``--bind`` only, over the job's authenticated
channels (the secret's handshake, a MAC on every frame), holding the keys in torch's own
in-memory ``HashStore``; each worker hands ``init_process_group`` a :class:`StoreClient`,
a ``torch.distributed.Store`` whose operations are calls to it. A process without the
secret is refused at the handshake and never reaches a key.

One connection per worker process, one thread per connection on the server: a blocking
``get`` or ``wait`` holds only its own worker.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import HashStore, Store

from tierswap.control import protocol as p
from tierswap.wire import Address, Channel, Server

SLACK_S = 30.0
"""Seconds a call waits for its reply beyond the wait it asks the server for."""


def _bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class StoreServer(Server):
    """The job's store, served on ``(bind, port 0)``; ``close`` stops it."""

    incoming = p.WorkerToStore
    name = "tierswap-store"

    def __init__(self, bind: str, secret: bytes) -> None:
        self.data = HashStore()
        super().__init__(bind, secret)

    def handle(self, chan: Channel) -> None:
        while (env := chan.recv()) is not None:
            try:
                reply = self.answer(env.msg)
            except Exception as e:  # a timeout, a bad counter: the caller is told
                reply = p.Error(message=f"{type(e).__name__}: {e}")
            chan.send(reply)

    def answer(self, msg: p.Message) -> p.Message:
        """The reply to one request, from this store's keys."""
        d = self.data
        match msg:
            case p.StoreSet(key=key, value=value):
                d.set(key, value)  # type: ignore[arg-type]  # bytes work
                return p.Ack()
            case p.StoreGet(key=key, timeout=timeout):
                d.wait([key], timedelta(seconds=timeout))
                return p.StoreValue(value=_bytes(d.get(key)))
            case p.StoreAdd(key=key, amount=amount):
                return p.StoreNumber(value=int(d.add(key, amount)))
            case p.StoreCompareSet(key=key, expected=expected, desired=desired):
                value = d.compare_set(key, expected, desired)  # type: ignore[arg-type]  # bytes work
                return p.StoreValue(value=_bytes(value))
            case p.StoreWait(keys=keys, timeout=timeout):
                d.wait(keys, timedelta(seconds=timeout))
                return p.Ack()
            case p.StoreCheck(keys=keys):
                return p.StoreFlag(ok=bool(d.check(keys)))
            case p.StoreDelete(key=key):
                return p.StoreFlag(ok=bool(d.delete_key(key)))
            case p.StoreCount():
                return p.StoreNumber(value=int(d.num_keys()))
        raise p.ProtocolError(f"the store does not answer {p.tag_of(msg)!r}")


class StoreClient(Store):
    """A worker's end of the job's store: a ``torch.distributed.Store`` for
    ``init_process_group``; every operation is one call to the :class:`StoreServer`.

    Keep it referenced for as long as a process group uses it: torch holds the C++ side
    only, and once the Python object is collected its methods are gone ("Not
    implemented" from inside ``init_process_group``)."""

    def __init__(self, address: Address, secret: bytes, timeout: timedelta) -> None:
        super().__init__()
        self.set_timeout(timeout)
        self.default_timeout = timeout
        """How long a get or a wait without its own timeout waits."""
        self.address = address
        self.chan = Channel.connect(address, secret, p.StoreToWorker)

    def _call(self, msg: p.Message, reply: Any, wait: float = 0.0) -> Any:
        try:
            return self.chan.call(msg, reply, timeout=wait + SLACK_S)
        except RuntimeError as e:  # the server's Error: a wait that timed out, say
            raise dist.DistStoreError(f"store at {self.address}: {e}") from None

    def _wait_s(self, timeout: timedelta | None) -> float:
        return (self.default_timeout if timeout is None else timeout).total_seconds()

    def set(self, key: str, value: Any) -> None:
        self._call(p.StoreSet(key=key, value=_bytes(value)), p.Ack)

    def get(self, key: str) -> bytes:
        wait = self._wait_s(None)
        value: bytes = self._call(p.StoreGet(key=key, timeout=wait), p.StoreValue, wait).value
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
        self._call(p.StoreWait(keys=list(keys), timeout=wait), p.Ack, wait)

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
        self.chan.close()
