"""Where a host is reached: the address its agent listens on and advertises, and the
network interface that address belongs to (gloo's workers must use the same one).

On one machine every simulated node listens on ``--bind`` (loopback by default). A host
that joins from another machine (``tierswap run --join``) cannot listen on the
coordinator's address: it listens on the address its own connection to the coordinator
leaves from (the interface that routes to it), or on its own ``--bind``.
"""

from __future__ import annotations

import ipaddress
import socket

import psutil

from tierswap.errors import UsageError
from tierswap.wire import Channel


def leaving_address(chan: Channel) -> str:
    """The local address of ``chan``'s connection: one the other end can reach."""
    return str(chan.local_address()[0])


def interface_of(address: str) -> str | None:
    """The name of the interface that holds ``address`` on this host, or None."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    return None


def check_advertised(address: str, flag: str) -> str:
    """``address`` must be a concrete IPv4 address of this host: others connect to it."""
    try:
        ip = ipaddress.IPv4Address(address)
    except ValueError:
        raise UsageError(f"{flag} {address!r}: expected an IPv4 address of this host") from None
    if ip.is_unspecified:
        raise UsageError(
            f"{flag} {address}: other hosts cannot connect to a wildcard; give the address "
            "they reach this host at (for one machine, 127.0.0.1)"
        )
    if interface_of(address) is None:
        mine = sorted(
            a.address
            for addrs in psutil.net_if_addrs().values()
            for a in addrs
            if a.family == socket.AF_INET
        )
        raise UsageError(f"{flag} {address}: no interface of this host has it; it has {mine}")
    return address


def worker_env(address: str, env: dict[str, str]) -> dict[str, str]:
    """Workers' gloo connections leave from the interface of ``address`` (unless the user
    chose one with ``GLOO_SOCKET_IFNAME``): by default gloo takes the interface of the
    host name, which on a host with several networks need not reach the other hosts."""
    name = interface_of(address)
    if name is None or "GLOO_SOCKET_IFNAME" in env:
        return env
    return dict(env, GLOO_SOCKET_IFNAME=name)
