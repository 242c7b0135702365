"""``tierswap bench control-plane``: what the coordinator costs at 256 to 12,500 nodes.

The real coordinator core and codec, in one process, with N simulated agents of
``--ranks-per-node`` ranks each (no training): every message an agent would send is
encoded, decoded by the coordinator's codec and handled by its core; every message the
core sends is encoded, framed with its MAC and written to a socket (a pool of
socketpairs, drained by another thread), as the coordinator's shell does; each incoming
frame's MAC is checked, as a channel checks it. Measured on the coordinator's thread alone
(``time.thread_time``):

- **per step**: what one training step costs it, tiers 0 and 1 (each node's progress, its
  tier-0 and tier-1 holds, the two commits broadcast), median over ``--steps`` steps;
- **failure to start**: from a node's connection closing to the last ``Start`` of the
  next generation written: the failure, the stop broadcast, every node's ``Stopped``
  (what its rings hold), the spare taking the node, the restore plan, and one ``Start``
  per node; wall time, as the coordinator's loop would see it if every agent answered at
  once (the agents' own work runs in parallel on their hosts and is not counted);
- **peak memory**: the process's peak resident set, above what it held before.
"""

from __future__ import annotations

import argparse
import gc
import hmac
import json
import resource
import secrets
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from tierswap.config import Config
from tierswap.control import commands as cc
from tierswap.control import protocol as p
from tierswap.control.coordinator import CoordinatorCore
from tierswap.wire import HEADER, TAG, Direction

TARGETS = {
    2048: {"step_ms": 50.0, "failover_s": 0.5},
    12500: {"step_ms": 250.0, "failover_s": 2.0},
}
"""The issue's targets, by node count."""
SIZES = (256, 2048, 12500)


class Wires:
    """Where the coordinator's sends go: a few socketpairs, drained by a thread, so each
    send costs the system call it costs in the shell."""

    def __init__(self, pairs: int = 16) -> None:
        self.pairs = [socket.socketpair() for _ in range(pairs)]
        self.directions: dict[int, Direction] = {}
        """conn -> its key and sequence number."""
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def send(self, conn: int, data: bytes) -> None:
        """Frame, MAC and write ``data`` as a channel to ``conn`` does."""
        out = self.directions.get(conn)
        if out is None:
            out = self.directions[conn] = Direction(secrets.token_bytes(32))
        self.pairs[conn % len(self.pairs)][0].sendall(out.seal(data))

    def _drain(self) -> None:
        import selectors

        sel = selectors.DefaultSelector()
        for _, b in self.pairs:
            b.setblocking(False)
            sel.register(b, selectors.EVENT_READ)
        while not self.stopped.is_set():
            for key, _ in sel.select(timeout=0.1):
                try:
                    while key.fileobj.recv(1 << 20):  # type: ignore[union-attr]
                        pass
                except BlockingIOError:
                    pass

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=5)
        for a, b in self.pairs:
            a.close()
            b.close()


class Cluster:
    """N simulated agents around one real coordinator core."""

    def __init__(self, nodes: int, ranks_per_node: int) -> None:
        self.cfg = Config(
            nodes=nodes,
            nproc_per_node=ranks_per_node,
            spares=1,
            console=False,
            revive=False,
            max_restarts=100,
            peer_parity=0,  # its agents report whole replicas by rank
        )
        self.codec = p.Codec(p.AgentToCoordinator)
        self.wires = Wires()
        self.now = 0.0
        self.core = CoordinatorCore(
            self.cfg,
            job_id="bench",
            script=["train.py"],
            address=("127.0.0.1", 1),
            store="127.0.0.1:2",
            tier2=None,
            now=0.0,
        )
        self.starts = 0
        self.generation = -1
        self.commits: list[tuple[int, int]] = []
        self.agent_out: dict[int, Direction] = {}
        self.coordinator_in: dict[int, Direction] = {}
        """conn -> each end's key and sequence number for the agent's frames."""
        self.conn_of: dict[int, int] = {}
        """host -> its connection."""
        self._handle(cc.Begin())
        for host in range(nodes + 1):  # the members and one spare
            conn = host + 1
            self.conn_of[host] = conn
            self.send(conn, p.Hello(host=host, pid=10_000 + host), -1)
            self.send(conn, p.Ready(replica=("127.0.0.1", 20_000 + host), workers=[]), -1)

    def _handle(self, event: Any) -> None:
        for cmd in self.core.handle(event, self.now):
            match cmd:
                case cc.Send(conn=conn, msg=msg, gen=gen):
                    self.wires.send(conn, p.Codec.encode(msg, gen))
                    if isinstance(msg, p.Start):
                        self.starts += 1
                        self.generation = gen
                case cc.Broadcast(conns=conns, msg=msg, gen=gen):
                    data = p.Codec.encode(msg, gen)
                    for conn in conns:
                        self.wires.send(conn, data)
                    if isinstance(msg, p.Committed):
                        self.commits.append((msg.tier, msg.step))
                case cc.End(reason=reason):
                    raise RuntimeError(f"the simulated job ended: {reason}")

    def send(self, conn: int, msg: p.Message, gen: int) -> None:
        """An agent's message: encoded and framed as it would be, read by the coordinator."""
        self.deliver(conn, self.frame(conn, p.Codec.encode(msg, gen)))

    def frame(self, conn: int, data: bytes) -> bytes:
        """``data`` as the agent on ``conn`` puts it on the wire (its work, not timed)."""
        if conn not in self.agent_out:
            key = secrets.token_bytes(32)
            self.agent_out[conn], self.coordinator_in[conn] = Direction(key), Direction(key)
        return self.agent_out[conn].seal(data)

    def deliver(self, conn: int, frame: bytes) -> None:
        """The coordinator reads one frame: its MAC checked, its message decoded, handled."""
        self.now += 1e-6
        payload = memoryview(frame)[HEADER:-TAG]
        if not hmac.compare_digest(self.coordinator_in[conn].tag(payload), frame[-TAG:]):
            raise RuntimeError(f"a frame on connection {conn} failed its MAC")
        self._handle(cc.AgentMessage(conn, self.codec.decode(payload), self.now))

    def members(self) -> dict[int, int]:
        """node -> its connection."""
        return {n: self.conn_of[h] for n, h in self.core.hosts.members.items()}

    def step_messages(self, step: int) -> list[tuple[int, bytes]]:
        """What every node sends in one step, framed (the agents' work, not timed)."""
        g, out = self.generation, []
        for node, conn in sorted(self.members().items()):
            stall = 0.001 if node == 0 else None
            out.append(
                (conn, self.frame(conn, p.Codec.encode(p.Progress(step=step, stall=stall), g)))
            )
        for tier in (0, 1):
            for _, conn in sorted(self.members().items()):
                out.append(
                    (conn, self.frame(conn, p.Codec.encode(p.Held(tier=tier, step=step), g)))
                )
        return out

    def stopped_messages(self, steps: list[int]) -> list[tuple[int, bytes]]:
        """Every surviving node's report after a stop: its ranks' tier-0 slots and the
        replicas it holds, with checksums, each replica read again (made before the stop,
        so that only the coordinator's work is timed)."""
        per, g, out = self.cfg.nproc_per_node, self.generation, []
        targets = self.core.targets
        for node, conn in sorted(self.members().items()):
            own = {
                r: {s: f"{r:08x}{s:08x}" for s in steps}
                for r in range(node * per, (node + 1) * per)
            }
            held = {
                r: {s: f"{r:08x}{s:08x}" for s in steps} for r, t in targets.items() if node in t
            }
            msg = p.Stopped(holdings=own, peer=held, peer_deltas={}, verified=None)
            out.append((conn, self.frame(conn, p.Codec.encode(msg, g))))
        return out

    def close(self) -> None:
        self.wires.close()


def measure(nodes: int, ranks_per_node: int, steps: int) -> dict[str, Any]:
    gc.collect()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    cluster = Cluster(nodes, ranks_per_node)
    try:
        setup_s = time.perf_counter() - t0
        if cluster.starts != nodes:
            raise RuntimeError(f"{cluster.starts} of {nodes} nodes were started")
        per_step = []
        for step in range(steps):
            msgs = cluster.step_messages(step)
            before = len(cluster.commits)
            c0 = time.thread_time()
            for conn, data in msgs:
                cluster.deliver(conn, data)
            per_step.append(time.thread_time() - c0)
            if cluster.commits[before:] != [(0, step), (1, step)]:
                raise RuntimeError(f"step {step} committed {cluster.commits[before:]}")
        # a node fails: its connection closes
        stopped = cluster.stopped_messages([steps - 3, steps - 2, steps - 1])
        victim = max(cluster.members())
        starts = cluster.starts
        w0, c0 = time.perf_counter(), time.thread_time()
        cluster._handle(cc.AgentClosed(cluster.members()[victim]))
        stop_s = time.perf_counter() - w0
        w1 = time.perf_counter()
        for conn, data in stopped:
            if conn != cluster.conn_of[victim]:
                cluster.deliver(conn, data)
        failover_wall = time.perf_counter() - w0
        failover_cpu = time.thread_time() - c0
        if cluster.starts - starts != nodes:
            raise RuntimeError(f"the next generation started {cluster.starts - starts} nodes")
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {
            "nodes": nodes,
            "ranks": nodes * ranks_per_node,
            "setup_s": setup_s,
            "step_cpu_s": {
                "median": statistics.median(per_step),
                "min": min(per_step),
                "max": max(per_step),
                "samples": per_step,
            },
            "messages_per_step": len(msgs),
            "failover_s": failover_wall,
            "failover_cpu_s": failover_cpu,
            "failover_split_s": {
                "failure_and_stop": stop_s,
                "reports_plan_start": time.perf_counter() - w1,
            },
            "peak_rss_mib": max(0, rss - rss0) / 1024,
        }
    finally:
        cluster.close()


def run(sizes: list[int], ranks_per_node: int, steps: int) -> dict[str, Any]:
    return {
        "ranks_per_node": ranks_per_node,
        "steps": steps,
        "codec": codec_speed(),
        "runs": [measure(n, ranks_per_node, steps) for n in sizes],
    }


def codec_speed(n: int = 20_000) -> dict[str, float]:
    """Encode + decode of one ``Held``: msgpack (the wire) against JSON with the
    same fields, microseconds each."""
    msg, codec = p.Held(tier=0, step=123_456), p.Codec(p.AgentToCoordinator)
    t0 = time.perf_counter()
    for _ in range(n):
        codec.decode(p.Codec.encode(msg, 3))
    ours = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    for _ in range(n):
        d = json.loads(json.dumps({"op": "held", "gen": 3, "tier": 0, "step": 123_456}))
        p.Held(tier=int(d["tier"]), step=int(d["step"]))
    return {"msgpack_us": ours, "json_us": (time.perf_counter() - t0) / n * 1e6}


def report(res: dict[str, Any]) -> None:
    print(f"coordinator core + codec, {res['ranks_per_node']} ranks per node, "
          f"{res['steps']} steps (CPU of the coordinator's thread)")  # fmt: skip
    c = res["codec"]
    print(
        f"one Held, encode + decode: msgpack {c['msgpack_us']:.2f} us, JSON {c['json_us']:.2f} us"
    )
    head = f"{'nodes':>7} {'ranks':>8} {'msgs/step':>10} {'CPU/step ms':>24}"
    print(f"{head} {'failure->start s':>17} {'peak RSS MiB':>13}  target")
    for r in res["runs"]:
        s = r["step_cpu_s"]
        spread = f"{s['median'] * 1e3:.1f} ({s['min'] * 1e3:.1f}-{s['max'] * 1e3:.1f})"
        t = TARGETS.get(r["nodes"])
        goal = "" if t is None else (
            f"<= {t['step_ms']:g} ms, {t['failover_s']:g} s: "
            + ("met" if s["median"] * 1e3 <= t["step_ms"] and r["failover_s"] <= t["failover_s"]
               else "NOT met")
        )  # fmt: skip
        print(f"{r['nodes']:>7} {r['ranks']:>8} {r['messages_per_step']:>10} {spread:>24} "
              f"{r['failover_s']:>17.3f} {r['peak_rss_mib']:>13.1f}  {goal}")  # fmt: skip
    runs = res["runs"]
    if len(runs) > 1:
        a, b = runs[0], runs[-1]
        grow = (b["step_cpu_s"]["median"] / a["step_cpu_s"]["median"]) / (b["nodes"] / a["nodes"])
        print(
            f"per-step cost per node, {b['nodes']} vs {a['nodes']} nodes: {grow:.2f}x (1 = linear)"
        )


def main(args: argparse.Namespace) -> int:
    sizes = list(args.nodes or SIZES)
    if any(n < 2 for n in sizes) or args.ranks_per_node < 1 or args.repeats < 1:
        raise ValueError("--nodes >= 2 each, --ranks-per-node >= 1, --repeats >= 1")
    res = run(sizes, args.ranks_per_node, max(args.repeats, 3) + 2)
    report(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0
