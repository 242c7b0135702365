"""How an agent reaches its coordinator: the channel (waiting for a coordinator still
starting, on a multi-host launch), the greeting it is taken or refused by, the leader
etcd names (``--rdzv-backend etcd``), and the TCP timeout that stops a host cut off
from it within a lease."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tierswap.cluster.election import wait_for_leader
from tierswap.cluster.multihost import ETCD_ENV, HostLaunch, connect_timeout
from tierswap.control import protocol as p
from tierswap.handshake import AuthenticationError, HandshakeCut
from tierswap.wire import Channel

if TYPE_CHECKING:
    from tierswap.cluster.election import Rendezvous


def connect(coord_host: str, port: int, secret: bytes, launch: HostLaunch | None) -> Channel:
    """The coordinator's channel. A host of a multi-host launch may start before the
    coordinator's host: it waits for it (``--startup-timeout``), saying so once; a wrong
    secret is never retried."""
    if launch is None:
        return Channel.connect((coord_host, port), secret, p.CoordinatorToAgent)
    deadline = time.monotonic() + connect_timeout(os.environ)
    said = False
    while True:
        try:
            return Channel.connect((coord_host, port), secret, p.CoordinatorToAgent)
        except HandshakeCut as e:  # the coordinator's listener is not up (yet)
            error: Exception = e
        except AuthenticationError as e:  # another secret: waiting changes nothing
            raise SystemExit(f"tierswap run: {e}") from None
        except OSError as e:  # refused, unreachable, no route yet: the host may be booting
            error = e
        if time.monotonic() > deadline:
            raise SystemExit(
                f"tierswap run: no coordinator answered at {coord_host}:{port} within "
                f"--startup-timeout ({error}); is the endpoint's host up, and its port open?"
            ) from None
        if not said:
            print(f"tierswap run: waiting for the coordinator at {coord_host}:{port}")
            said = True
        time.sleep(0.5)


def fence_on_silence(coord: Channel, lease: float) -> None:
    """A host cut off from the coordinator (its link down, the coordinator's host gone
    without a word) stops by itself within a lease: its heartbeats go unacknowledged, and
    TCP gives the connection up after ``lease`` seconds (``TCP_USER_TIMEOUT``), which ends
    this agent and its workers, as the coordinator, fencing it, expects."""
    if isinstance(coord.sock.getsockname(), tuple) and hasattr(socket, "TCP_USER_TIMEOUT"):
        coord.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(lease * 1000))


class Refused(Exception):
    """The coordinator does not take this host; the message says why."""


def greet(chan: Channel, hello: p.Hello) -> p.Welcome:
    """Say ``hello`` on a coordinator's channel and read its welcome (``Refused``; the
    channel is closed then)."""
    try:
        chan.send(hello)
        welcome = chan.recv(timeout=60)
    except BaseException:
        chan.close()
        raise
    if welcome is not None and isinstance(welcome.msg, p.Welcome):
        return welcome.msg
    chan.close()
    if welcome is not None and isinstance(welcome.msg, p.Refused):
        raise Refused(f"the coordinator refused this host: {welcome.msg.why}")
    raise Refused(f"the coordinator answered {welcome}")


def quietly(read: Any) -> Any:
    """An etcd read, or None while etcd cannot be reached."""
    try:
        return read()
    except Exception:
        return None


def find_leader(env: Mapping[str, str]) -> tuple[Rendezvous, dict[str, Any]]:
    """``--rdzv-backend etcd``: the coordinator that leads the job, from etcd."""
    from tierswap.cluster.election import Rendezvous  # etcd3gw only where it is used

    where, _, job = env[ETCD_ENV].partition(" ")
    host, port = where.rsplit(":", 1)
    rdzv = Rendezvous((host, int(port)), job or None)
    leader = wait_for_leader(rdzv, time.monotonic() + connect_timeout(env))
    if leader is None:
        done = quietly(rdzv.done)
        if done is not None:
            raise SystemExit(int(done["code"]))
        raise SystemExit(
            f"tierswap run: no coordinator led the job in etcd at {where} within --startup-timeout"
        )
    return rdzv, leader
