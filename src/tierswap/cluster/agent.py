"""The per-node agent: starts and watches workers, owns tier-0 memory, writes tier 2.

Its workers start parked (script imported, no rank) and are assigned ranks by the
coordinator's ``start``; a ``stop`` ends their generation without ending their processes.
A spare node is an agent with parked workers and no ranks yet.

One event loop reads a queue fed by the coordinator's connection, the workers'
connections, the worker-exit watchers and the background jobs (checksums, persistence),
so the agent's state is touched by one thread only.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import partial
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

from tierswap.checksum import checksum_chunks
from tierswap.cluster.address import leaving_address, worker_env
from tierswap.cluster.replication import PeerStore, Replicator
from tierswap.cluster.workers import Workers, send
from tierswap.cluster.writer import Bases, PartWriter, bases_of
from tierswap.config import Config, Injection
from tierswap.errors import UsageError
from tierswap.shm import SHM_DIR
from tierswap.state import Layout
from tierswap.tiers.deltas import MEMORY_BASES, BaseKeeper, Part
from tierswap.tiers.memory import NodeRings
from tierswap.tiers.peer import ReplicaServer
from tierswap.wire import Channel, Message, reader, serve

Item = tuple[str, Any, Message | None]


class Agent:
    def __init__(
        self,
        host: int,
        coord: Channel,
        secret: bytes,
        cfg: Config,
        run_dir: Path,
        job_id: str,
        script: list[str],
        address: str,
        coord_host: str,
    ) -> None:
        self.host = host
        self.coord_host = coord_host
        """Where this host reaches the coordinator (and its store)."""
        self.node: int | None = None
        """The job's node this agent serves; None while it is a spare."""
        self.coord = coord
        self.secret = secret
        self.cfg = cfg
        self.run_dir = run_dir
        self.job_id = job_id
        self.script = script
        self.events: queue.SimpleQueue[Item] = queue.SimpleQueue()
        self.deferred: list[Item] = []
        self.rings = NodeRings(job_id, cfg.slots)
        self.exiting = False
        self.stop_reported = False
        """This generation's ``stopped`` was sent (it is sent once per stop)."""
        self.plans: dict[int, dict[str, Any]] = {}
        self.generation = -1
        self.injections: list[Injection] = []
        self.checks: list[Future[None]] = []
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tierswap-check")
        # tier-2 writes get their own threads: a slow disk must not hold up checksums
        self.writer = PartWriter(cfg, self._post)
        self.last_skipped: dict[int, int] = {}
        self.sock = str(run_dir / f"agent-{host}-{os.getpid()}.sock")
        self.listener = Listener(self.sock, family="AF_UNIX", authkey=secret)
        env = worker_env(address, dict(os.environ, **cfg.to_env()))
        env.update(TIERSWAP_AGENT=self.sock, TIERSWAP_SECRET=secret.hex(), TIERSWAP_HOST=str(host))
        self.workers = Workers(script, env, self._post)
        self._stop_accepting = serve(self.listener, self._on_worker_channel, "tierswap-accept")
        report = self.coord.send
        self.peers = PeerStore(
            job_id, cfg.slots, cfg.max_peer_memory, report, cfg.memory_tiers, cfg.delta_threshold
        )
        keeper = None
        if cfg.memory_tiers == "delta":
            keeper = BaseKeeper(cfg.base_every, cfg.delta_threshold)
        base_root = None
        if keeper is not None and cfg.persist is not None:
            base_root = f"{cfg.persist.rstrip('/')}/{MEMORY_BASES}"
        self.replicator = Replicator(
            secret, host, self._post, cfg.nproc_per_node, keeper, base_root, cfg.world_size
        )
        self.server = ReplicaServer(address, secret, self._ask)
        reader(coord, lambda m: self.events.put(("coord", None, m)), "tierswap-coord")

    # ---------------------------------------------------------------- plumbing

    def _on_worker_channel(self, chan: Channel) -> None:
        def deliver(msg: Message | None) -> None:
            # heartbeats are timed here, on arrival: a busy event loop must not make a
            # healthy worker look silent
            self.workers.heard[chan] = time.monotonic()
            if msg is None or msg["op"] != "beat":
                self.events.put(("worker", chan, msg))

        reader(chan, deliver, "tierswap-worker")

    def run(self) -> None:
        threading.Thread(target=self._beat, name="tierswap-heartbeat", daemon=True).start()
        for local in range(self.cfg.nproc_per_node + self.cfg.spare_workers):
            self.workers.spawn(local)
        try:
            while True:
                if self.deferred:
                    source, chan, msg = self.deferred.pop(0)
                else:
                    try:
                        source, chan, msg = self.events.get(timeout=self.cfg.heartbeat)
                    except queue.Empty:
                        source, chan, msg = "tick", None, None
                self._watch()
                if source == "coord":
                    if msg is None or msg["op"] == "exit":
                        return
                    self._on_coord(msg)
                elif source == "worker" and msg is not None:
                    assert isinstance(chan, Channel)
                    self._on_worker(chan, msg)
                elif source == "local":
                    assert msg is not None
                    self._on_local(msg)
                elif source == "ask":
                    assert msg is not None
                    self._answer(chan, msg)
        finally:
            self.shutdown()

    def _beat(self) -> None:
        """The lease with the coordinator: a silent agent is fenced and replaced."""
        while True:
            time.sleep(self.cfg.heartbeat)
            try:
                self.coord.send("beat")
            except OSError:
                return

    def shutdown(self) -> None:
        self.exiting = True
        self.workers.kill_all()
        self._settle()
        self._stop_accepting()
        self.server.close()
        self.replicator.close()
        self.peers.close()
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.writer.close()
        self.rings.close()
        Path(self.sock).unlink(missing_ok=True)

    def _post(self, op: str, **fields: Any) -> None:
        self.events.put(("local", None, {"op": op, **fields}))

    def _ask(self, op: str, **fields: Any) -> Any:
        """Run a replica-store operation on the event loop (from a server thread)."""
        done: Future[Any] = Future()
        self.events.put(("ask", done, {"op": op, **fields}))
        return done.result(timeout=120)

    def _answer(self, done: Future[Any], msg: Message) -> None:
        op = msg.pop("op")
        handlers: dict[str, Any] = {
            "replica_slot": self.peers.slot,
            "replica_received": self.peers.received,
            "replica_written": self.peers.written,
            "replica_lease": self.peers.lease,
            "replica_unlease": self.peers.unlease,
            "replica_base": self.peers.base,
            "replica_delta_written": self.peers.delta_written,
            "replica_served": partial(self.coord.send, "replica_served"),
        }
        try:
            done.set_result(handlers[op](**msg))
        except Exception as e:  # handed to the asking thread, which fails its transfer
            done.set_exception(e)

    # ---------------------------------------------------------------- coordinator

    def _on_coord(self, msg: Message) -> None:
        op = msg["op"]
        if op == "start":
            self._start(msg)
        elif op == "stop":
            self._stop()
        elif op == "propose":
            step = int(msg["step"])
            if int(msg["tier"]) == 0:
                ok = self.rings.propose(step)
            else:
                ok = self.peers.propose(step, [int(r) for r in msg["ranks"]])
            self.coord.send("vote", node=self.node, tier=msg["tier"], step=step, ok=ok)
        elif op == "committed":
            if int(msg["tier"]) == 0:
                self.rings.commit(int(msg["step"]))
            else:
                self.peers.committed(int(msg["step"]))
                self.rings.peer_committed(int(msg["step"]))
        elif op == "abort":
            if int(msg["tier"]) == 0:
                self.rings.abort(int(msg["step"]))
            else:
                self.peers.abort(int(msg["step"]))
        elif op == "settled":
            if int(msg["generation"]) == self.generation:
                self.workers.settled(self.generation, int(msg["step"]))
        elif op == "persist":
            self._persist(
                int(msg["step"]),
                str(msg["root"]),
                int(msg["world_size"]),
                int(msg["token"]),
                bases_of(msg),
            )
        else:
            raise ValueError(f"agent {self.node}: unknown coordinator message {op!r}")

    def _peer_holdings(self) -> dict[str, dict[str, str]]:
        for rank, step in self.peers.verify():
            self.coord.send(
                "replica_rejected",
                rank=rank,
                step=step,
                why="corrupt in memory",
                generation=self.generation,
            )
        return self.peers.holdings()

    def _start(self, msg: Message) -> None:
        self.generation = int(msg["generation"])
        self.node = int(msg["node"])
        self.plans = {int(r): p for r, p in msg["plans"].items()}
        self.injections = [Injection.parse(s) for s in msg["inject"]]
        self.last_skipped.clear()  # a restore may replay a step skipped before: report it
        ranks = [int(r) for r in msg["ranks"]]
        restart = int(msg["restart_step"])
        self.rings.serve(ranks, restart, int(msg["committed"][0]), int(msg["committed"][1]))
        self.peers.generation = self.generation
        self.peers.discard_after(restart, int(msg["committed"][1]))
        self.peers.protects = [int(r) for r in msg["protects"]]
        self.peers.corrupt = [i for i in self.injections if i.action == "corrupt"]
        targets = {int(r): tuple(int(n) for n in t) for r, t in msg["placement"].items()}
        addresses = {int(n): (str(a[0]), int(a[1])) for n, a in msg["peers"].items()}
        self.replicator.configure(targets, addresses)
        self.replicator.reset(restart, self.generation)
        cut = any(i.during == "replication" for i in self.injections)
        self.replicator.announce = self._announce_transfer if cut else None
        self.replicator.delay = max(
            (i.seconds for i in self.injections if i.action == "delay" and i.index == self.node),
            default=0.0,
        )
        assignment = {
            "world_size": int(msg["world_size"]),
            "store": f"{self.coord_host}:{str(msg['store']).rsplit(':', 1)[1]}",
            "inject": list(msg["inject"]),
            "backend": str(msg.get("backend", "gloo")),
            "max_redo": int(msg.get("max_redo", 0)),
            "settled": int(msg["committed"][1]),
        }
        self.workers.start(self.generation, ranks, assignment)

    def _announce_transfer(self, rank: int, step: int, peer: int) -> None:
        """From a replication thread: a transfer starts (for ``during=replication``)."""
        try:
            self.coord.send("replicating", node=self.node, rank=rank, step=step, peer=peer)
        except OSError:
            pass

    def _stop(self) -> None:
        """End this generation: every assigned worker leaves ``train(job)`` and parks; the
        holdings are reported once all have parked (or died)."""
        self.stop_reported = False
        self.workers.abort(time.monotonic() + self.cfg.collective_timeout)
        self._maybe_stopped()

    def _maybe_stopped(self) -> None:
        # ``workers.stopping`` stays set until the next start: a worker that attaches late
        # must not be handed the generation that ended
        if not self.workers.stopping or self.stop_reported or self.workers.leaving():
            return
        self._settle()
        self.stop_reported = True
        self.coord.send(
            "stopped",
            node=self.node,
            holdings=self.rings.holdings(),
            peer=self._peer_holdings(),
            peer_deltas=self.peers.kinds(),
        )

    def _watch(self) -> None:
        """Kill a worker that is silent past its lease (a hang) or that does not leave its
        generation in time; its exit is then handled as a crash."""
        for w, why in self.workers.overdue(time.monotonic(), self.cfg.lease):
            self.coord.send("hung", node=self.node, rank=w.rank, why=why, pid=w.proc.pid)
            w.proc.send_signal(signal.SIGKILL)
            w.deadline = w.seen = float("inf")

    def _settle(self) -> None:
        """After the workers let go: checksums in flight finish, leases are returned and
        slots still being written are abandoned."""
        wait(self.checks)  # snapshots being checksummed become held before holdings are told
        self.checks.clear()
        while not self.events.empty():  # apply their results now, keep everything else
            item = self.events.get()
            if item[0] == "local" and item[2] is not None and item[2]["op"] == "checked":
                self._on_local(item[2])
            else:
                self.deferred.append(item)
        self.rings.let_go()

    # ---------------------------------------------------------------- workers

    CALLS = frozenset({"alloc", "slot", "plan", "finished", "fatal", "corrupt", "inject_fired"})
    """Worker messages that wait for a reply; the others are one-way."""

    def _on_control(self, chan: Channel, msg: Message) -> None:
        """A worker's control connection: attach, heartbeats, parked."""
        op = msg["op"]
        if op == "attach":
            if self.workers.attach(chan, int(msg["local"]), int(msg["pid"])):
                pids = sorted(x.proc.pid for x in self.workers.procs.values())
                self.coord.send("ready", replica=self.server.address, workers=pids)
            return
        w = self.workers.of(chan)
        if w is None:
            return
        w.seen = time.monotonic()
        if op == "parked":
            leaving = w.state == "leaving"
            w.state = "parked"
            if not leaving and int(msg["generation"]) == self.generation:
                # it left on its own: a collective failed under it, or its source is bad
                self.coord.send(
                    "left",
                    node=self.node,
                    rank=msg["rank"],
                    reason=msg.get("reason", "collective"),
                    why=msg["why"],
                )
            self._maybe_stopped()

    def _on_worker(self, chan: Channel, msg: Message) -> None:
        op = msg["op"]
        if op in ("attach", "parked"):
            self._on_control(chan, msg)
            return
        rank = int(msg.get("rank", -1))
        w = self.workers.by_rank.get(rank)
        if msg.get("gen") != self.generation or w is None or w.state not in ("assigned", "leaving"):
            if op in self.CALLS:
                send(chan, "error", message=f"generation {msg.get('gen')} has ended")
            return  # from a worker of a stopped generation: its slots were reclaimed
        handler = getattr(self, f"_w_{op}", None)
        try:
            if handler is None:
                raise ValueError(f"unknown request {op!r}")
            handler(chan, rank, msg)
        except (ValueError, KeyError, OSError) as e:  # UsageError is a ValueError
            if op in self.CALLS:
                send(chan, "error", message=f"{type(e).__name__}: {e}")
            else:
                self.coord.send("agent_error", rank=rank, request=op, error=str(e))

    def _w_lagging(self, chan: Channel, rank: int, msg: Message) -> None:
        self.coord.send("lagging", rank=rank, step=msg["step"], seconds=msg["seconds"])

    def _w_alloc(self, chan: Channel, rank: int, msg: Message) -> None:
        ring = self.rings[rank]
        before = set(ring.held())
        try:
            alloc = ring.allocate(Layout.from_json(msg["layout"]))
        except OSError as e:
            raise UsageError(
                f"node {self.node} cannot allocate {self.cfg.slots} tier-0 slots of "
                f"{Layout.from_json(msg['layout']).nbytes:,} bytes for rank {rank} in "
                f"{SHM_DIR}: {e}. Free or enlarge {SHM_DIR} (a container's --shm-size), or "
                "use fewer --slots."
            ) from e
        if lost := sorted(before - set(ring.held())):
            self.coord.send("dropped", rank=rank, steps=lost)  # the layout changed
        self.coord.send("memory", node=self.node, rank=rank, tier=0, nbytes=ring.nbytes())
        send(chan, "ok", alloc=alloc.id, segments=[str(s.segment.path.name) for s in alloc.slots])

    def _w_slot(self, chan: Channel, rank: int, msg: Message) -> None:
        if self.workers.stopping:
            raise ValueError(f"generation {self.generation} is ending: no new snapshots")
        slot, dropped = self.rings[rank].begin_write(int(msg["step"]), int(msg["alloc"]))
        send(chan, "ok", slot=slot)
        if dropped:
            self.coord.send("dropped", rank=rank, steps=dropped)
        if slot is None and self.last_skipped.get(rank) != msg["step"]:
            self.last_skipped[rank] = msg["step"]
            self.coord.send("skipped", rank=rank, step=msg["step"], generation=self.generation)

    def _w_held(self, chan: Channel, rank: int, msg: Message) -> None:
        ring = self.rings[rank]
        step = int(msg["step"])
        slot = ring.written(int(msg["slot"]), step, int(msg["alloc"]), msg["tree"])
        layout = ring.layout()

        def check() -> None:
            digest = checksum_chunks(layout.chunks(slot.segment.buf))
            self._post("checked", rank=rank, step=step, slot=slot, checksum=digest)

        self.checks = [f for f in self.checks if not f.done()]
        self.checks.append(self.pool.submit(check))
        self.coord.send("progress", rank=rank, step=step, stall=msg.get("stall", 0.0))

    def _w_plan(self, chan: Channel, rank: int, msg: Message) -> None:
        plan = dict(self.plans.get(rank, {"step": None}))
        if plan.get("step") is not None and plan["source"]["tier"] == 0:
            ring = self.rings[rank]
            slot = self.rings.lease_for_restore(rank, int(plan["step"]))
            if slot is None:
                raise ValueError(f"rank {rank}: tier 0 no longer holds step {plan['step']}")
            plan["source"] = dict(
                tier=0,
                step=plan["step"],
                segment=slot.segment.path.name,
                layout=ring.layout().to_json(),
                tree=slot.tree,
                checksum=slot.checksum,
            )
        send(chan, "ok", **plan)

    def _w_restored(self, chan: Channel, rank: int, msg: Message) -> None:
        self.rings.restored(rank)
        self.coord.send("restored", **{k: v for k, v in msg.items() if k != "op"})

    def _w_report(self, chan: Channel, rank: int, msg: Message) -> None:
        self.coord.send("report", **{k: v for k, v in msg.items() if k != "op"})

    def _w_finished(self, chan: Channel, rank: int, msg: Message) -> None:
        self.workers.by_rank[rank].state = "finished"
        self.coord.send("finished", rank=rank, step=msg.get("step", -1))
        send(chan, "ok")
        self._maybe_stopped()  # a stop that came first counted on it to leave

    def _w_joined(self, chan: Channel, rank: int, msg: Message) -> None:
        self.coord.send("joined", rank=rank, pid=msg["pid"], seconds=msg["seconds"])

    def _w_stepped(self, chan: Channel, rank: int, msg: Message) -> None:
        self.coord.send("stepped", rank=rank, step=msg["step"])

    def _w_fatal(self, chan: Channel, rank: int, msg: Message) -> None:
        self.coord.send("fatal", rank=rank, message=msg["message"])
        send(chan, "ok")

    def _w_corrupt(self, chan: Channel, rank: int, msg: Message) -> None:
        fields = {k: msg[k] for k in ("where", "why", "step", "tier")}
        self.coord.send("corrupt", rank=rank, **fields)
        send(chan, "ok")

    def _w_inject_fired(self, chan: Channel, rank: int, msg: Message) -> None:
        self.coord.send("inject_fired", spec=msg["spec"])
        send(chan, "ok")

    # ---------------------------------------------------------------- background results

    def _on_local(self, msg: Message) -> None:
        op = msg["op"]
        if op == "checked":
            ring = self.rings[msg["rank"]]
            ring.checked(msg["slot"], msg["checksum"])
            self.coord.send("held", rank=msg["rank"], step=msg["step"], checksum=msg["checksum"])
            self.replicator.offer(msg["rank"], ring)
        elif op == "replicated":
            self.rings.unlease(msg["slot"])
            if "nbytes" in msg:  # delta mode: what was sent, against what a full one costs
                stats = {k: msg[k] for k in ("rank", "step", "kind", "nbytes", "full")}
                self.coord.send("replica_sent", encode_s=msg.get("encode_s", 0.0), **stats)
            ring = self.rings[msg["rank"]]
            self.replicator.done(msg["rank"], msg["step"], ring, msg["generation"])
        elif op == "replicate_failed":
            self.coord.send("replicate_failed", **{k: v for k, v in msg.items() if k != "op"})
        elif op == "exited":
            self._exited(int(msg["local"]), int(msg["pid"]), int(msg["code"]))
        elif op == "persisted":
            self.rings.unlease(msg["slot"])
            self.coord.send("part", **{k: v for k, v in msg.items() if k not in ("op", "slot")})

    def _exited(self, local: int, pid: int, code: int) -> None:
        w = self.workers.procs.get(local)
        if w is None or w.proc.pid != pid or self.exiting:
            return
        if w.state == "finished":  # its state is saved; a crash at exit is only reported
            if code != 0:
                self.coord.send("exited_after_finish", rank=w.rank, code=code)
            return
        if w.state == "starting":  # it never attached: the script itself fails; no retry
            self.coord.send("start_failed", host=self.host, local=local, code=code)
            return
        if w.state in ("assigned", "leaving") and w.generation == self.generation:
            assert w.rank is not None
            self.workers.spent.add(w.rank)
            self.coord.send("exited", node=self.node, rank=w.rank, code=code)
        elif self.node is None or w.rank is None:
            self.coord.send("spare_worker_exited", local=local, code=code)
        self.workers.spawn(local)  # a fresh parked worker, for this rank or as the next spare
        self._maybe_stopped()

    def _persist(self, step: int, root: str, world_size: int, token: int, bases: Bases) -> None:
        for rank, ring in self.rings.items():
            slot = ring.lease(step)
            if slot is None:
                self.coord.send(
                    "part", rank=rank, step=step, token=token, error="tier 0 no longer holds it"
                )
                continue
            self.writer.submit(
                Part(root, step, rank, world_size, ring.layout(), slot, token), bases
            )


def main() -> None:
    env = os.environ
    secret = bytes.fromhex(env["TIERSWAP_SECRET"])
    coord_host, port = env["TIERSWAP_COORD"].rsplit(":", 1)
    coord = Channel.connect((coord_host, int(port)), secret)
    # this host listens where others reach it: its own --bind (a host that joins), else
    # the address its connection to the coordinator leaves from
    address = env.get("TIERSWAP_HOST_ADDRESS") or leaving_address(coord)
    # the coordinator names this host and hands out the job's config and script, so a node
    # that joins later (tierswap run --join) runs exactly what the others run
    coord.send("hello", host=int(env.get("TIERSWAP_HOST", "-1")), pid=os.getpid())
    welcome = coord.recv(timeout=60)
    if welcome is None or welcome["op"] != "welcome":
        raise SystemExit(f"tierswap agent: the coordinator refused this node: {welcome}")
    temp = None if env.get("TIERSWAP_RUN_DIR") else tempfile.mkdtemp(prefix="tierswap-agent-")
    run_dir = Path(temp or env["TIERSWAP_RUN_DIR"])
    agent = Agent(
        host=int(welcome["host"]),
        coord=coord,
        secret=secret,
        cfg=Config.from_env(welcome["config"]),
        run_dir=run_dir,
        job_id=str(welcome["job_id"]),
        script=sys.argv[1:] or list(welcome["script"]),
        address=address,
        coord_host=coord_host,
    )
    agent.run()
    if temp is not None:
        shutil.rmtree(temp, ignore_errors=True)
    # Everything is released by now (workers killed, segments unlinked); do not wait at exit
    # for a replication thread whose peer is gone.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
