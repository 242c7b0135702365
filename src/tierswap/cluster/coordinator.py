"""The coordinator: membership, generations, commit records and recovery decisions.

It runs in the launcher. One event loop handles what agents send, in order; the state it
keeps is what tiers hold, which step is committed where, and which generation is running.
"""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

from torch._C._distributed_c10d import TCPStore

from tierswap.cluster.commits import Commits
from tierswap.cluster.launch import LocalNodes, check_durable, new_job_id
from tierswap.cluster.persistence import Persistence
from tierswap.cluster.restore import lost_message, memory_lost, rank_plans
from tierswap.config import Config, Injection
from tierswap.errors import CorruptPartError
from tierswap.events import EventLog, Progress
from tierswap.plan import Holdings, Plan, Tier, plan_restore
from tierswap.shm import remove_job_segments
from tierswap.tiers import durable, peer
from tierswap.wire import Channel, Message, reader, serve


class JobStopped(Exception):
    """The job cannot go on; the message says why and what is kept."""


class Coordinator:
    def __init__(self, cfg: Config, script: list[str], run_dir: Path) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.job_id = new_job_id()
        self.secret = os.urandom(32)
        self.log = EventLog(run_dir / "events.jsonl")
        self.progress = Progress(cfg.console)
        self.listener = Listener(("127.0.0.1", 0), authkey=self.secret)
        self._stop_accepting: Callable[[], None] = self.listener.close
        self.store = TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=cfg.startup_timeout),
        )
        self.nodes = LocalNodes(cfg, script, run_dir, self.job_id, self.secret)
        self.events: queue.SimpleQueue[tuple[Channel, Message | None]] = queue.SimpleQueue()
        self.agents: dict[int, Channel] = {}
        self.agent_pids: dict[int, int] = {}
        self.injections = [str(i) for i in cfg.inject]
        self.generation = -1
        self.phase = "starting"
        self.restarts = 0
        self.replicas = min(cfg.replicas, cfg.nodes - 1)
        self.targets = peer.placement(cfg.nodes, cfg.nproc_per_node, self.replicas)
        self.commits = Commits(cfg.world_size, self.targets, self._send_to)
        self.peer_addresses: dict[int, list[Any]] = {}
        self.bad: set[tuple[Tier, int, int]] = set()
        self.plan: Plan | None = None
        self.restored: dict[int, Message] = {}
        self.finished: set[int] = set()
        self.stopping: set[int] = set()
        self.holdings: dict[int, dict[str, dict[str, str]]] = {}
        self.peer_holdings: dict[int, dict[str, dict[str, str]]] = {}
        self.waiting_hello: set[int] = set(range(cfg.nodes))
        self.persister = Persistence(cfg, self.log, self.progress, self._broadcast)
        self.ever_committed = False
        self.last_step = -1
        self.last_loss: float | None = None
        self.deadline = time.monotonic() + cfg.startup_timeout

    # ---------------------------------------------------------------- main loop

    def run(self) -> int:
        """Run the job to its end; 0 when it finished, 1 when it stopped for good."""
        warning = check_durable(self.cfg)
        self._stop_accepting = serve(self.listener, self._on_channel, "tierswap-coord-accept")
        self.log.emit(
            "job_started",
            world_size=self.cfg.world_size,
            nodes=self.cfg.nodes,
            persist=self.cfg.persist,
            job_id=self.job_id,
        )
        if warning:
            self.persister.failing(f"cannot write {self.cfg.persist}: {warning}")
        self._announce_placement()
        for node in range(self.cfg.nodes):
            self.nodes.start(node, self.address)
        try:
            while self.phase != "done":
                self._tick()
            return 0
        except JobStopped as e:
            self.log.emit("job_failed", reason=str(e))
            self.progress.message(f"job stopped: {e}")
            return 1
        finally:
            self.shutdown()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.listener.address
        return str(host), int(port)

    def _on_channel(self, chan: Channel) -> None:
        reader(chan, lambda m: self.events.put((chan, m)), "tierswap-coord-agent")

    def _tick(self) -> None:
        try:
            chan, msg = self.events.get(timeout=0.5)
        except queue.Empty:
            if self.waiting_hello:
                gone = self.nodes.exited_before_joining(set(self.agents))
                if gone:
                    raise JobStopped(f"{gone}; its output above says why") from None
            if time.monotonic() > self.deadline:
                raise JobStopped(f"timed out {self._waiting_for()}") from None
            return
        node = next((n for n, c in self.agents.items() if c is chan), None)
        if msg is None:
            if node is not None:
                self._node_lost(node)
            return
        handler = getattr(self, f"_on_{msg['op']}", None)
        if handler is None:
            raise JobStopped(f"unknown message {msg['op']!r} from node {node}")
        handler(chan, node, msg)

    def _announce_placement(self) -> None:
        if not self.replicas:
            self.progress.message("tier 1 off: replicas need at least 2 nodes")
            return
        text = peer.describe(self.targets, self.cfg.nproc_per_node)
        self.log.emit(
            "placement",
            replicas=self.replicas,
            targets={str(r): list(t) for r, t in self.targets.items()},
        )
        self.progress.message(f"tier-1 placement, {self.replicas} replica(s):\n{text}")

    def _send_to(self, node: int, op: str, **fields: Any) -> None:
        chan = self.agents.get(node)
        if chan is not None:
            try:
                chan.send(op, **fields)
            except OSError:
                pass  # its reader reports the loss

    def _broadcast(self, op: str, **fields: Any) -> None:
        """Send to every live agent; a dead one is noticed by its reader, not here."""
        for chan in list(self.agents.values()):
            try:
                chan.send(op, **fields)
            except OSError:
                pass

    def _waiting_for(self) -> str:
        if self.waiting_hello:
            return f"waiting for nodes {sorted(self.waiting_hello)} to join"
        if self.stopping:
            return f"waiting for nodes {sorted(self.stopping)} to stop their workers"
        if self.persister.inflight is not None:
            step = self.persister.inflight.step
            return f"waiting for step {step} to be written to {self.cfg.persist}"
        return (
            f"in phase {self.phase!r} waiting for step {self.last_step} to be committed "
            f"in memory (committed: {self._tiers()})"
        )

    def shutdown(self) -> None:
        self._broadcast("exit")
        self.nodes.stop_all()
        self._stop_accepting()
        n = remove_job_segments(self.job_id)
        if n:
            self.log.emit("memory_released", segments=n)
        self.log.close()

    # ---------------------------------------------------------------- membership

    def _on_hello(self, chan: Channel, node: int | None, msg: Message) -> None:
        node = int(msg["node"])
        self.agents[node] = chan
        self.agent_pids[node] = int(msg["pid"])
        self.peer_addresses[node] = list(msg["replica"])
        self.commits.live.add(node)
        self.waiting_hello.discard(node)
        self.log.emit("node_joined", node=node, pid=msg["pid"])
        self._maybe_start()

    def _ranks_of(self, node: int) -> list[int]:
        p = self.cfg.nproc_per_node
        return list(range(node * p, (node + 1) * p))

    def _node_lost(self, node: int) -> None:
        self.agents.pop(node, None)
        self.commits.node_lost(node)
        if self.phase == "finishing":
            self.log.emit(
                "failure_detected",
                what="node",
                node=node,
                ranks=self._ranks_of(node),
                detail="lost after every rank finished",
                generation=self.generation,
            )
            self.persister.cancel()
            self.persister.ok = False  # finish with what is committed; say what is not
            self.progress.message(
                f"node {node} lost after the last step; finishing with the "
                f"steps already committed: {self._tiers()}"
            )
            self.last_step = min(self.last_step, self.commits.committed[0])
            self._maybe_done()
            return
        if self.phase == "done":
            return
        self.stopping.discard(node)
        self.holdings.pop(node, None)
        self.peer_holdings.pop(node, None)
        if self.phase == "running":
            self._failure("node", node, self._ranks_of(node), "agent connection lost")
        self.nodes.kill(node)
        remove_job_segments(self.job_id, self.agent_pids.pop(node, None) or -1)
        self.waiting_hello.add(node)
        self.nodes.start(node, self.address)
        self.progress.message(f"node {node} lost; started a fresh node in its place")

    def _on_exited(self, chan: Channel, node: int | None, msg: Message) -> None:
        rank, code = int(msg["rank"]), int(msg["code"])
        if code == 0 and rank in self.finished:
            return
        if self.phase == "running":
            self._failure("worker", node, [rank], f"exit code {code}")

    # ---------------------------------------------------------------- failure and restore

    def _failure(self, what: str, node: int | None, ranks: list[int], detail: str) -> None:
        self.log.emit(
            "failure_detected",
            what=what,
            node=node,
            ranks=ranks,
            detail=detail,
            generation=self.generation,
        )
        self.progress.message(f"failure: {what} (node {node}, ranks {ranks}): {detail}")
        self.restarts += 1
        if self.restarts > self.cfg.max_restarts:
            raise JobStopped(
                f"{self.restarts} failures, more than --max-restarts {self.cfg.max_restarts}"
            )
        self.phase = "recovering"
        self.persister.cancel()
        self.deadline = time.monotonic() + self.cfg.startup_timeout
        self.holdings.clear()
        self.peer_holdings.clear()
        self.stopping = set(self.agents)
        self._broadcast("stop")

    def _on_stopped(self, chan: Channel, node: int | None, msg: Message) -> None:
        assert node is not None
        self.stopping.discard(node)
        self.holdings[node] = msg["holdings"]
        self.peer_holdings[node] = msg.get("peer", {})
        self._maybe_start()

    def _maybe_start(self) -> None:
        if self.phase not in ("starting", "recovering"):
            return
        if self.waiting_hello or self.stopping:
            return
        self._start_generation()

    def _collect(self) -> Holdings:
        memory: dict[int, frozenset[int]] = {}
        memory_node: dict[int, int] = {}
        for node, per_rank in self.holdings.items():
            for rank, steps in per_rank.items():
                memory[int(rank)] = frozenset(int(s) for s in steps)
                memory_node[int(rank)] = node
        peers: dict[int, dict[int, frozenset[int]]] = {}
        for node, per_rank in self.peer_holdings.items():
            for rank, steps in per_rank.items():
                peers.setdefault(int(rank), {})[node] = frozenset(int(s) for s in steps)
        durable_steps: frozenset[int] = frozenset()
        if self.cfg.persist is not None:
            try:
                listing = durable.list_steps(self.cfg.persist)
            except OSError as e:
                listing = []
                self.persister.failing(f"cannot list {self.cfg.persist}: {e}")
            durable_steps = frozenset(
                s.step for s in listing if s.committed and s.world_size == self.cfg.world_size
            )
        return Holdings(
            self.cfg.world_size, memory, memory_node, peers, durable_steps, frozenset(self.bad)
        )

    def _plan(self) -> tuple[Holdings, Plan, dict[int, dict[str, Any]]]:
        """Plan the restore; a durable step whose COMMIT is unreadable is skipped."""
        while True:
            holdings = self._collect()
            plan = plan_restore(holdings)
            try:
                return (
                    holdings,
                    plan,
                    rank_plans(plan, self.cfg.world_size, self.cfg.persist, self.peer_addresses),
                )
            except (CorruptPartError, OSError) as e:
                assert plan.step is not None
                self.log.emit("corrupt_part", step=plan.step, tier=2, where="COMMIT", why=str(e))
                self.bad |= {(Tier.DURABLE, plan.step, r) for r in range(self.cfg.world_size)}

    def _start_generation(self) -> None:
        holdings, plan, plans = self._plan()
        for step, why in plan.skipped:
            self.log.emit("restore_skipped", step=step, reason=why)
        if plan.step is None and (self.ever_committed or holdings.durable):
            raise JobStopped(lost_message(plan, self.cfg.persist))
        self._say_fallback(holdings, plan)
        self.plan = plan
        self.generation += 1
        self.phase = "running"
        self.restored.clear()
        self.finished.clear()
        restart = -1 if plan.step is None else plan.step
        memory = {r: set(s) for r, s in holdings.memory.items()}
        peers = {r: {n: set(s) for n, s in by.items()} for r, by in holdings.peer.items()}
        self.commits.reset(restart, memory, peers)
        self.persister.cancel(restart)
        # parts of later steps will be written anew by this timeline
        self.bad = {b for b in self.bad if b[0] == Tier.DURABLE or b[1] <= restart}
        self.deadline = float("inf")
        for node, chan in sorted(self.agents.items()):
            ranks = self._ranks_of(node)
            try:
                chan.send(
                    "start",
                    generation=self.generation,
                    world_size=self.cfg.world_size,
                    ranks=ranks,
                    store=f"127.0.0.1:{self.store.port}",
                    plans={str(r): plans[r] for r in ranks},
                    inject=self.injections,
                    restart_step=restart,
                    committed=[self.commits.committed[0], self.commits.committed[1]],
                    placement={str(r): list(self.targets[r]) for r in ranks},
                    protects=[r for r, t in self.targets.items() if node in t],
                    peers={str(n): a for n, a in self.peer_addresses.items() if n in self.agents},
                )
            except OSError:
                pass  # its reader reports the loss, and the node is replaced
        self.log.emit(
            "generation_started",
            generation=self.generation,
            step=plan.step,
            members=sorted(self.agents),
        )

    def _say_fallback(self, holdings: Holdings, plan: Plan) -> None:
        gone = memory_lost(holdings, plan) if plan.step is not None and self.ever_committed else []
        if gone:
            why = "no live node holds their snapshots in memory (own node and replicas lost)"
            self.log.emit("restore_fallback", step=plan.step, ranks=gone, tier=2, reason=why)
            self.progress.message(f"ranks {gone} restored from tier 2 at step {plan.step}: {why}")

    def _on_restored(self, chan: Channel, node: int | None, msg: Message) -> None:
        self.restored[int(msg["rank"])] = msg
        if len(self.restored) < self.cfg.world_size:
            return
        tiers = {str(r): int(m["tier"]) for r, m in sorted(self.restored.items())}
        seconds = max(float(m["seconds"]) for m in self.restored.values())
        step = int(next(iter(self.restored.values()))["step"])
        self.log.emit(
            "restored", step=step, tiers=tiers, seconds=seconds, generation=self.generation
        )
        by_tier = sorted(set(tiers.values()))
        self.progress.message(f"restored step {step} (tiers {by_tier}) in {seconds:.2f} s")

    def _on_corrupt(self, chan: Channel, node: int | None, msg: Message) -> None:
        rank, step, tier = int(msg["rank"]), msg.get("step"), msg.get("tier")
        if step is not None and tier is not None:
            self.bad.add((Tier(int(tier)), int(step), rank))
        self.log.emit(
            "corrupt_part", rank=rank, where=msg["where"], why=msg["why"], step=step, tier=tier
        )
        self.progress.message(f"rank {rank}: {msg['where']}: {msg['why']}; trying an older step")

    def _on_agent_error(self, chan: Channel, node: int | None, msg: Message) -> None:
        self.log.emit(
            "agent_error", node=node, rank=msg["rank"], request=msg["request"], error=msg["error"]
        )

    def _on_fatal(self, chan: Channel, node: int | None, msg: Message) -> None:
        raise JobStopped(f"rank {msg['rank']}: {msg['message']}")

    def _on_inject_fired(self, chan: Channel, node: int | None, msg: Message) -> None:
        if msg["spec"] in self.injections:
            self.injections.remove(msg["spec"])
        self.log.emit("fault_injected", spec=msg["spec"])

    # ---------------------------------------------------------------- commits

    def _on_held(self, chan: Channel, node: int | None, msg: Message) -> None:
        self.commits.held_add(int(msg["rank"]), int(msg["step"]))
        self._propose(0)

    def _on_dropped(self, chan: Channel, node: int | None, msg: Message) -> None:
        self.commits.dropped(int(msg["rank"]), [int(s) for s in msg["steps"]])

    def _on_replica_held(self, chan: Channel, node: int | None, msg: Message) -> None:
        assert node is not None
        self.commits.replica_add(int(msg["rank"]), node, int(msg["step"]))
        self._propose(1)

    def _on_replica_dropped(self, chan: Channel, node: int | None, msg: Message) -> None:
        assert node is not None
        self.commits.replica_dropped(int(msg["rank"]), node, [int(s) for s in msg["steps"]])

    def _on_replica_rejected(self, chan: Channel, node: int | None, msg: Message) -> None:
        self.log.emit(
            "replica_rejected", node=node, rank=msg["rank"], step=msg["step"], why=msg["why"]
        )

    def _on_replicate_failed(self, chan: Channel, node: int | None, msg: Message) -> None:
        self.log.emit(
            "replicate_failed", node=node, rank=msg["rank"], peer=msg["node"], error=msg["error"]
        )

    def _on_peer_memory_exceeded(self, chan: Channel, node: int | None, msg: Message) -> None:
        raise JobStopped(
            f"node {node} must hold {self.cfg.slots} slots x {msg['need'] // self.cfg.slots:,} "
            f"bytes of replicas for ranks {msg['ranks']} ({msg['need']:,} bytes), more than "
            f"--max-peer-memory {msg['limit']:,}. Raise --max-peer-memory, add nodes, or "
            "lower --replicas."
        )

    def _propose(self, tier: int) -> None:
        if self.phase in ("running", "finishing"):
            self.commits.maybe_propose(tier)

    def _on_vote(self, chan: Channel, node: int | None, msg: Message) -> None:
        assert node is not None
        tier, step = int(msg["tier"]), int(msg["step"])
        done = self.commits.vote(tier, node, step, bool(msg["ok"]))
        if done is not None:
            self.ever_committed = True
            self.log.emit("snapshot_committed", tier=tier, step=done)
            if tier == 0:
                self.persister.maybe_persist(done)
        self._propose(tier)
        self._maybe_done()

    def _on_part(self, chan: Channel, node: int | None, msg: Message) -> None:
        step = self.persister.on_part(msg)
        if step is not None:
            self.ever_committed = True
            self.bad = {b for b in self.bad if not (b[0] == Tier.DURABLE and b[1] == step)}
        self._maybe_done()

    # ---------------------------------------------------------------- progress and the end

    def _on_progress(self, chan: Channel, node: int | None, msg: Message) -> None:
        step = int(msg["step"])
        self._kill_nodes_due(step)
        self.last_step = max(self.last_step, step)
        if int(msg["rank"]) == 0:
            self.progress.update(step, self.last_loss, float(msg["stall"]), self._tiers())

    def _kill_nodes_due(self, step: int) -> None:
        """Fault injection: kill every node whose ``kill:node`` step is reached, at once."""
        for spec in list(self.injections):
            inj = Injection.parse(spec)
            if inj.action == "kill" and inj.target == "node" and step >= inj.step:
                self.injections.remove(spec)
                self.log.emit("fault_injected", spec=spec)
                self.nodes.kill(inj.index)

    def _on_report(self, chan: Channel, node: int | None, msg: Message) -> None:
        if "total" in msg:
            self.progress.total = int(msg["total"])
        metrics = msg.get("metrics") or {}
        if int(msg["rank"]) == 0 and metrics:
            self.last_loss = metrics.get("loss", self.last_loss)
            self.log.emit("report", step=msg["step"], **metrics)

    def _on_memory(self, chan: Channel, node: int | None, msg: Message) -> None:
        self.log.emit(
            "memory", node=node, rank=msg["rank"], tier=msg.get("tier", 0), bytes=msg["nbytes"]
        )

    def _on_skipped(self, chan: Channel, node: int | None, msg: Message) -> None:
        self.log.emit("snapshot_skipped", rank=msg["rank"], step=msg["step"])

    def _tiers(self) -> dict[str, int]:
        c = self.commits.committed
        named = {"memory": c[0], "peer": c[1], "durable": self.persister.committed}
        return {k: v for k, v in named.items() if v >= 0}

    def _on_finished(self, chan: Channel, node: int | None, msg: Message) -> None:
        self.finished.add(int(msg["rank"]))
        self.last_step = max(self.last_step, int(msg["step"]))
        if len(self.finished) == self.cfg.world_size:
            self.phase = "finishing"
            # the last step's checksums, commit and durable write: a slow disk is no failure
            self.deadline = time.monotonic() + max(self.cfg.startup_timeout, 600.0)
            self._maybe_done()

    def _maybe_done(self) -> None:
        memory = self.commits.committed[0]
        if self.phase != "finishing" or memory < self.last_step:
            return
        if self.persister.inflight is not None:
            return
        if self.persister.ok and self.persister.committed < memory:
            self.persister.maybe_persist(memory, final=True)
            if self.persister.inflight is not None:
                return
        self.phase = "done"
        self.log.emit(
            "job_finished", step=self.last_step, generation=self.generation, restarts=self.restarts
        )
        self.progress.message(
            f"finished step {self.last_step + 1} "
            f"after {self.restarts} recoveries; committed {self._tiers()}"
        )
