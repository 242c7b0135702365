"""Who serves the job: hosts (agent processes), the node each serves, spares and leases.

A *node* is a place in the job (node i runs ranks iP..iP+P-1; placement is in nodes). A
*host* is an agent process with its workers; it serves one node or waits parked as a
spare. Host ids are never reused. This is the coordinator's bookkeeping only: it sends
nothing and starts nothing.
"""

from __future__ import annotations

import time
from typing import Any

from tierswap.wire import Channel


class Hosts:
    def __init__(self, nodes: int, spares: int) -> None:
        self.conns: dict[int, Channel] = {}
        """host -> its agent's connection, members and spares."""
        self.members: dict[int, int] = {}
        """node -> the host serving it."""
        self.spares: list[int] = []
        """Parked hosts, in the order they became ready."""
        self.vacant: set[int] = set()
        """Nodes whose host failed and that no spare has taken yet."""
        self.pids: dict[int, int] = {}
        self.replica_address: dict[int, list[Any]] = {}
        self.heard: dict[Channel, float] = {}
        """When each connection was last heard from (set by its reader thread on arrival)."""
        self.waiting: set[int] = set(range(nodes))
        """Hosts of the first generation that are not ready yet (host i serves node i)."""
        self.next_id = nodes + spares

    @property
    def agents(self) -> dict[int, Channel]:
        """node -> the connection of the host serving it."""
        return {n: self.conns[h] for n, h in self.members.items() if h in self.conns}

    @property
    def peer_addresses(self) -> dict[int, list[Any]]:
        """node -> the replica server of the host serving it."""
        return {
            n: self.replica_address[h] for n, h in self.members.items() if h in self.replica_address
        }

    def new_id(self) -> int:
        host = self.next_id
        self.next_id += 1
        return host

    def connected(self, requested: int, pid: int, chan: Channel) -> int:
        """A host said hello: its id (a fresh one for a host that joins from outside)."""
        host = requested
        if host < 0 or host in self.conns or host in self.pids:
            host = self.new_id()
        self.conns[host] = chan
        self.pids[host] = pid
        return host

    def host_of(self, chan: Channel) -> int | None:
        return next((h for h, c in self.conns.items() if c is chan), None)

    def node_of(self, host: int | None) -> int | None:
        return next((n for n, h in self.members.items() if h == host), None)

    def ready(self, host: int, replica: list[Any]) -> bool | None:
        """Its agent and workers are ready: True for a member of the first generation
        (it serves the node of its id), False for a spare, None for a host already
        counted as either (a second "ready" changes nothing)."""
        if host in self.spares or host in self.members.values():
            return None
        self.replica_address[host] = replica
        if host in self.waiting:
            self.waiting.discard(host)
            self.members[host] = host
            return True
        self.spares.append(host)
        return False

    def silent(self, now: float, lease: float) -> list[tuple[int, float]]:
        """Hosts not heard from for longer than ``lease``, with the seconds of silence."""
        late = []
        for host, chan in self.conns.items():
            quiet = now - self.heard.get(chan, now)
            if quiet > lease:
                late.append((host, quiet))
        return late

    def lost(self, host: int) -> tuple[Channel | None, int | None]:
        """Forget a host; its connection and the node it served (None for a spare)."""
        chan = self.conns.pop(host, None)
        if host in self.spares:
            self.spares.remove(host)
            return chan, None
        node = self.node_of(host)
        if node is not None:
            del self.members[node]
        return chan, node

    def fill_vacancies(self) -> list[tuple[int, int]]:
        """Give vacant nodes to parked spares, lowest node first: (node, host) pairs."""
        taken = []
        while self.vacant and self.spares:
            node, host = min(self.vacant), self.spares.pop(0)
            self.vacant.discard(node)
            self.members[node] = host
            taken.append((node, host))
        return taken

    def mark_heard(self, chan: Channel) -> None:
        self.heard[chan] = time.monotonic()
