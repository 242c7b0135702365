"""Hosts with network stacks of their own, for multi-host tests and ``tierswap bench
hosts``: network namespaces on one machine, each with a veth link to a bridge that joins
them (and nothing else: the bridge has no address, so they reach each other only). Made
and removed by their user; every process left in a namespace is killed by its pid."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass


class Unavailable(RuntimeError):
    """No network namespaces here (no root, no iproute2, or the kernel refused)."""


@dataclass(frozen=True)
class Host:
    ns: str
    address: str
    link: str
    """The veth end on the bridge: ``ip link set LINK down`` cuts this host off."""

    @property
    def prefix(self) -> list[str]:
        """Run a command on this host."""
        return ["ip", "netns", "exec", self.ns]

    def pids(self) -> list[int]:
        done = subprocess.run(["ip", "netns", "pids", self.ns], capture_output=True, text=True)
        return [int(p) for p in done.stdout.split()]

    def kill_all(self) -> list[int]:
        """SIGKILL every process on this host, as the host's loss would end them."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def cut(self) -> None:
        _ip("link", "set", self.link, "down")


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


class Network:
    """``count`` hosts on one bridge, 10.215.X.1..count/24; ``Unavailable`` where they
    cannot be made (nothing is left behind then)."""

    def __init__(self, count: int) -> None:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise Unavailable("network namespaces need root and iproute2")
        tag = f"{os.getpid() % 10000}{random.randrange(100)}"
        self.bridge = f"tsbr{tag}"
        net = f"10.215.{random.randrange(1, 250)}"
        self.hosts = [
            Host(f"tsh{tag}n{i}", f"{net}.{i + 1}", f"tsh{tag}v{i}") for i in range(count)
        ]
        self._made: list[Host] = []
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self) -> None:
        steps: list[tuple[str, ...]] = [
            ("link", "add", self.bridge, "type", "bridge"),
            ("link", "set", self.bridge, "up"),
        ]
        for h in self.hosts:
            steps += [
                ("netns", "add", h.ns),
                ("link", "add", h.link, "type", "veth", "peer", "name", "eth0", "netns", h.ns),
                ("link", "set", h.link, "master", self.bridge),
                ("link", "set", h.link, "up"),
                ("-n", h.ns, "addr", "add", f"{h.address}/24", "dev", "eth0"),
                ("-n", h.ns, "link", "set", "eth0", "up"),
                ("-n", h.ns, "link", "set", "lo", "up"),
            ]
        for step in steps:
            if step[:2] == ("netns", "add"):
                self._made.append(next(h for h in self.hosts if h.ns == step[2]))
            done = _ip(*step)
            if done.returncode != 0:
                raise Unavailable(
                    f"cannot make a network namespace (ip {' '.join(step)}): {done.stderr.strip()}"
                )

    def close(self) -> None:
        for h in self._made:
            for _ in range(50):  # a killed process leaves the namespace once it is reaped
                if not h.kill_all():
                    break
                time.sleep(0.1)
            _ip("netns", "del", h.ns)
            _ip("link", "del", h.link)  # gone with the namespace, unless the kernel lags
        _ip("link", "del", self.bridge)

    def __enter__(self) -> list[Host]:
        return self.hosts

    def __exit__(self, *exc: object) -> None:
        self.close()
