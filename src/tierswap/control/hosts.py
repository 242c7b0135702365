"""Who serves the job: hosts (agent processes), the node each serves, spares and leases.

A *node* is a place in the job (node i runs ranks iP..iP+P-1; placement is in nodes). A
*host* is an agent process with its workers; it serves one node or waits parked as a
spare. Host ids are never reused. Connections are the shell's tokens (ints): this is
bookkeeping only; it sends nothing and starts nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tierswap.control.protocol import Address, Hello


class Hosts:
    def __init__(self, nodes: int, spares: int) -> None:
        self.conns: dict[int, int] = {}
        """host -> its agent's connection, members and spares."""
        self.by_conn: dict[int, int] = {}
        """connection -> host."""
        self.members: dict[int, int] = {}
        """node -> the host serving it."""
        self.node_by_host: dict[int, int] = {}
        self.spares: list[int] = []
        """Parked hosts, in the order they became ready."""
        self.vacant: set[int] = set()
        """Nodes whose host failed and that no spare has taken yet."""
        self.pids: dict[int, int] = {}
        self.replica_address: dict[int, Address] = {}
        self.heard: dict[int, float] = {}
        """host -> when it was last heard from (the arrival time of its newest message)."""
        self.waiting: set[int] = set(range(nodes))
        """Hosts of the first generation that are not ready yet (host i serves node i)."""
        self.next_id = nodes + spares
        self.nodes = nodes
        self.tags: dict[int, str] = {}
        """host -> the name its launcher gave its agent (``Hello.tag``)."""
        self.fenced: set[int] = set()
        """Hosts declared lost: never taken back (a coordinator that takes over refuses
        them)."""

    def record(self) -> dict[str, Any]:
        """Who serves the job, as JSON for a coordinator that takes over (connections and
        when each host was last heard are not: its hosts reconnect to it)."""
        return {
            "members": {str(n): host for n, host in sorted(self.members.items())},
            "spares": list(self.spares),
            "vacant": sorted(self.vacant),
            "waiting": sorted(self.waiting),
            "pids": {str(k): v for k, v in sorted(self.pids.items())},
            "tags": {str(k): v for k, v in sorted(self.tags.items())},
            "replica": {str(k): list(v) for k, v in sorted(self.replica_address.items())},
            "fenced": sorted(self.fenced),
            "next_id": self.next_id,
        }

    def adopt(self, rec: Mapping[str, Any]) -> None:
        """Take who serves the job from another coordinator's :meth:`record`."""
        self.members = {int(n): host for n, host in rec["members"].items()}
        self.node_by_host = {host: n for n, host in self.members.items()}
        self.spares = list(rec["spares"])
        self.vacant = set(rec["vacant"])
        self.waiting = set(rec["waiting"])
        self.pids = {int(k): v for k, v in rec["pids"].items()}
        self.tags = {int(k): v for k, v in rec["tags"].items()}
        self.replica_address = {int(k): (v[0], int(v[1])) for k, v in rec["replica"].items()}
        self.fenced = set(rec["fenced"])
        self.next_id = int(rec["next_id"])

    def agents(self) -> dict[int, int]:
        """node -> the connection of the host serving it."""
        return {n: self.conns[h] for n, h in self.members.items() if h in self.conns}

    def member_conns(self) -> tuple[int, ...]:
        return tuple(self.conns[h] for h in self.members.values() if h in self.conns)

    def address_of(self, node: int) -> Address | None:
        host = self.members.get(node)
        return None if host is None else self.replica_address.get(host)

    def new_id(self) -> int:
        host = self.next_id
        self.next_id += 1
        return host

    def connected(
        self, requested: int, pid: int, conn: int, now: float, *, spare: bool = False
    ) -> int:
        """A host said hello: its id. A simulated host asks for the id it was started
        as; a host of a multi-host launch for its ``--node-rank``, or for -1 (any). One
        that asks for a node someone claimed already, or for any, gets the lowest node of
        the first generation nobody has claimed; a spare, and a host that finds every node
        claimed, get a fresh id (they park as spares)."""
        taken = requested < 0 or requested in self.conns or requested in self.pids
        unclaimed = sorted(h for h in self.waiting if h not in self.pids)
        if spare:
            host = self.new_id()
        elif not taken:
            host = requested
        elif unclaimed and requested < self.nodes:
            host = unclaimed[0]
        else:
            host = self.new_id()
        self.conns[host] = conn
        self.by_conn[conn] = host
        self.pids[host] = pid
        self.heard[host] = now
        return host

    def host_of(self, conn: int) -> int | None:
        return self.by_conn.get(conn)

    def node_of(self, host: int | None) -> int | None:
        return None if host is None else self.node_by_host.get(host)

    def ready(self, host: int, replica: Address) -> bool | None:
        """Its agent and workers are ready: True for a member of the first generation
        (it serves the node of its id), False for a spare, None for a host already
        counted as either (a second "ready" changes nothing)."""
        if host in self.spares or host in self.node_by_host:
            return None
        self.replica_address[host] = replica
        if host in self.waiting:
            self.waiting.discard(host)
            self._serve(host, host)
            return True
        self.spares.append(host)
        return False

    def _serve(self, node: int, host: int) -> None:
        self.members[node] = host
        self.node_by_host[host] = node

    def silent(self, now: float, lease: float) -> list[tuple[int, float]]:
        """Hosts not heard from for longer than ``lease``, with the seconds of silence."""
        late = []
        for host in self.conns:
            quiet = now - self.heard.get(host, now)
            if quiet > lease:
                late.append((host, quiet))
        return late

    def lost(self, host: int) -> tuple[int | None, int | None]:
        """Forget a host; its connection and the node it served (None for a spare)."""
        self.fenced.add(host)
        conn = self.conns.pop(host, None)
        if conn is not None:
            self.by_conn.pop(conn, None)
        self.heard.pop(host, None)
        if host in self.spares:
            self.spares.remove(host)
            return conn, None
        node = self.node_by_host.pop(host, None)
        if node is not None:
            del self.members[node]
        return conn, node

    def close_ranks(self) -> dict[int, int]:
        """Shrinking: drop the vacant nodes and number the members left 0, 1, ... in
        their order. Returns old node -> new node."""
        moved = {old: new for new, old in enumerate(sorted(self.members))}
        self.members = {moved[n]: h for n, h in self.members.items()}
        self.node_by_host = {h: n for n, h in self.members.items()}
        self.vacant.clear()
        return moved

    def fill_vacancies(self) -> list[tuple[int, int]]:
        """Give vacant nodes to parked spares, lowest node first: (node, host) pairs."""
        taken = []
        while self.vacant and self.spares:
            node, host = min(self.vacant), self.spares.pop(0)
            self.vacant.discard(node)
            self._serve(node, host)
            taken.append((node, host))
        return taken


def refusal(hello: Hello, nodes: int, nproc_per_node: int, job: str | None) -> str | None:
    """Why the coordinator of a job of ``nodes`` x ``nproc_per_node`` (``--rdzv-id job``)
    does not take a host of a multi-host launch that said ``hello``, or None. A host that
    joins with ``--join`` says no shape and is taken as a spare."""
    if not hello.nodes:
        return None
    if (hello.nodes, hello.nproc_per_node) != (nodes, nproc_per_node):
        return (
            f"this host was started with --nnodes {hello.nodes} --nproc-per-node "
            f"{hello.nproc_per_node}, the job runs --nnodes {nodes} --nproc-per-node "
            f"{nproc_per_node}: start every host with the same line"
        )
    if (hello.job or None) != (job or None):
        return (
            f"this host was started with --rdzv-id {hello.job}, the job at this endpoint runs "
            f"--rdzv-id {job}: it is another job's coordinator"
        )
    return None
