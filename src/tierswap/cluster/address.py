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
import sys

import psutil

from tierswap.errors import UsageError
from tierswap.tunables import nt_tunables
from tierswap.wire import Channel


def leaving_address(chan: Channel) -> str:
    """The local address of ``chan``'s connection: one the other end can reach."""
    return str(chan.local_address()[0])


def _ipv4_addresses() -> list[tuple[str, str]]:
    """(interface, IPv4 address) for every address this host holds."""
    return [
        (name, a.address)
        for name, addrs in psutil.net_if_addrs().items()
        for a in addrs
        if a.family == socket.AF_INET
    ]


def interface_of(address: str) -> str | None:
    """The name of the interface that holds ``address`` on this host, or None. Every
    address of 127.0.0.0/8 is this host's, on the loopback interface."""
    held = _ipv4_addresses()
    for name, addr in held:
        if addr == address:
            return name
    if ipaddress.IPv4Address(address).is_loopback:
        for name, addr in held:
            if ipaddress.IPv4Address(addr).is_loopback:
                return name
    return None


def check_advertised(address: str, flag: str) -> str:
    """``address`` (an IPv4 address or a name that resolves to one) must be an address of
    this host that is not a wildcard: others connect to it. Returns it as an address."""
    try:
        ip = ipaddress.IPv4Address(socket.gethostbyname(address))
    except (OSError, UnicodeError, ValueError):
        raise UsageError(
            f"{flag} {address!r}: not an IPv4 address and no IPv4 address is known for that "
            "name; give an address of this host (for one machine, 127.0.0.1)"
        ) from None
    if ip.is_unspecified:
        raise UsageError(
            f"{flag} {address}: other hosts cannot connect to a wildcard; give the address "
            "they reach this host at (for one machine, 127.0.0.1)"
        )
    if interface_of(str(ip)) is None:
        mine = sorted(addr for _, addr in _ipv4_addresses())
        named = address if address == str(ip) else f"{address} ({ip})"
        raise UsageError(f"{flag} {named}: no interface of this host has it; it has {mine}")
    if ip.is_loopback and address not in (str(ip), "localhost"):
        print(
            f"tierswap: warning: {flag} {address} is {ip}, a loopback address: hosts on other "
            "machines cannot reach it (give the address they reach this host at)",
            file=sys.stderr,
        )
    return str(ip)


HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"
"""torch's switch for transparent huge pages under its CPU allocations of 2 MiB and more."""


def import_env(env: dict[str, str]) -> dict[str, str]:
    """The part of :func:`worker_env` that a process reads as it starts (glibc) or once
    (torch's allocator), so that the worker template starts with it too."""
    out = nt_tunables(env)
    out.setdefault(HUGE_PAGES_ENV, "1")
    return out


def worker_env(address: str, env: dict[str, str]) -> dict[str, str]:
    """The environment workers start with.

    - Their gloo connections leave from the interface of ``address`` (unless the user
      chose one with ``GLOO_SOCKET_IFNAME``): by default gloo takes the interface of the
      host name, which on a host with several networks need not reach the other hosts.
    - torch's CPU allocator asks for transparent huge pages (``THP_MEM_ALLOC_ENABLE=1``,
      unless the user set it): a restoring rank's fresh tensors then fault in 2 MiB at a
      time instead of 4 KiB, and loading 384 MiB into them takes 0.08 s instead of 0.21
      s here. Where the kernel gives no huge pages the setting changes nothing.
    - glibc copies 1 MiB and more around the cache (``GLIBC_TUNABLES``, unless the user
      set that tunable; :func:`tierswap.tunables.nt_tunables`): the snapshot copies in
      chunks of that size, and then does not read in the slot's lines it overwrites."""
    out = import_env(env)
    name = interface_of(address)
    if name is not None and "GLOO_SOCKET_IFNAME" not in env:
        out["GLOO_SOCKET_IFNAME"] = name
    return out
