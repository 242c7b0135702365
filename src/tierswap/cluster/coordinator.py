"""The coordinator: membership, generations and recovery decisions (the commit records
are its ledger's, ``ledger.py``).

It runs in the launcher. One event loop handles what agents send, in order; the state it
keeps is what tiers hold, which step is committed where, and which generation is running.

A *node* is a place in the job (node i runs ranks i*P .. i*P+P-1, and placement is in
nodes); a *host* is an agent process that serves a node, or waits parked as a spare. When
a host fails, a spare host takes its node, and the survivors keep their processes.
"""

from __future__ import annotations

import json
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
from tierswap.cluster.hosts import Hosts
from tierswap.cluster.launch import LocalNodes, check_durable, new_job_id, node_faults_due
from tierswap.cluster.ledger import Ledger
from tierswap.cluster.persistence import Persistence
from tierswap.cluster.recovery import RecoveryClock
from tierswap.cluster.restore import Reports, committed_steps, lost_message, memory_lost
from tierswap.config import Config, Injection
from tierswap.events import EventLog, Progress
from tierswap.plan import Holdings, Plan, Tier
from tierswap.shm import remove_job_segments
from tierswap.tiers import peer
from tierswap.tiers.deltas import Traffic
from tierswap.wire import Channel, Message, reader, serve

LOGGED: dict[str, tuple[str, tuple[str, ...]]] = {
    "replica_served": ("replica_served", ("rank", "step", "kind", "base_step")),
    "replica_base_lost": ("replica_base_lost", ("rank", "step", "kept")),
    "replica_rejected": ("replica_rejected", ("rank", "step", "why")),
    "replicate_failed": ("replicate_failed", ("rank", "step", "peer=node", "error")),
    "agent_error": ("agent_error", ("rank", "request", "error")),
    "skipped": ("snapshot_skipped", ("rank", "step")),
    "memory": ("memory", ("rank", "tier", "bytes=nbytes", "scope?")),
    "lagging": ("tier1_wait_timeout", ("rank", "step", "seconds")),
    "exited_after_finish": ("worker_exited_after_finish", ("rank", "code")),
}
"""Agent messages that only go to the event log: op -> (event, fields). A field is kept as
``name``, renamed as ``name=field``, or kept when present as ``name?``; every event also
names the node it came from."""


def _logged(msg: Message, fields: tuple[str, ...]) -> dict[str, Any]:
    out = {}
    for f in fields:
        name, _, source = f.rstrip("?").partition("=")
        if f.endswith("?") and (source or name) not in msg:
            continue
        out[name] = msg[source or name]
    return out


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
        # agents (including hosts that join later) and workers reach both on --bind
        self.listener = Listener((cfg.bind, 0), authkey=self.secret)
        self._stop_accepting: Callable[[], None] = self.listener.close
        self.store = TCPStore(
            cfg.bind,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=cfg.startup_timeout),
        )
        self.nodes = LocalNodes(cfg, script, run_dir, self.job_id, self.secret)
        self.events: queue.SimpleQueue[tuple[Channel, Message | None]] = queue.SimpleQueue()
        self.hosts = Hosts(cfg.nodes, cfg.spares)
        self.waiting_since: float | None = None
        self.booting: set[int] = set()
        """Revived hosts started and not ready yet."""
        self.to_revive = 0
        """Simulated hosts lost and to be started again as spares, as rebooted machines
        would come back: when the job needs one (a vacant node and no spare parked), not
        earlier, so that booting (seconds of imports) never competes with training and
        replication for this machine's cores."""
        self.clock = RecoveryClock(cfg.world_size)
        self.injections = [str(i) for i in cfg.inject]
        self.generation = -1
        self.phase = "starting"
        self.restarts = 0
        self.replicas = min(cfg.replicas, cfg.nodes - 1)
        self.targets = peer.placement(cfg.nodes, cfg.nproc_per_node, self.replicas)
        self.commits = Commits(cfg.world_size, self.targets, self._send_to)
        self.plan: Plan | None = None
        self.restored: dict[int, Message] = {}
        self.finished: set[int] = set()
        self.stopping: set[int] = set()
        self.reports = Reports(cfg.world_size, cfg.persist)
        self.traffic = Traffic()
        """Delta mode: what replication sent, logged as ``replica_traffic`` at the end."""
        self.persister = Persistence(cfg, self.log, self.progress, self._broadcast)
        self.ledger = Ledger(
            self.commits,
            self.persister,
            self.reports,
            self.log,
            self._broadcast,
            proposing=lambda: self.phase in ("running", "finishing"),
            changed=self._maybe_done,
        )
        self.last_step = -1
        self.last_loss: float | None = None
        self.deadline = time.monotonic() + cfg.startup_timeout

    # ---------------------------------------------------------------- main loop

    def run(self) -> int:
        """Run the job to its end; 0 when it finished, 1 when it stopped for good."""
        warning = check_durable(self.cfg)
        self._stop_accepting = serve(self.listener, self._on_channel, "tierswap-coord-accept")
        self._write_join_ticket()
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
        for host in range(self.cfg.nodes + self.cfg.spares):
            self.nodes.start(host, self.address)
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

    def _write_join_ticket(self) -> None:
        """What ``tierswap run --join`` needs, readable by this user only."""
        ticket = self.run_dir / "join.json"
        fd = os.open(ticket, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"address": "{}:{}".format(*self.address), "secret": self.secret.hex()}, f)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.listener.address
        return str(host), int(port)

    def _on_channel(self, chan: Channel) -> None:
        def deliver(msg: Message | None) -> None:
            self.hosts.mark_heard(chan)  # the lease is timed on arrival
            if msg is None or msg["op"] != "beat":
                self.events.put((chan, msg))

        reader(chan, deliver, "tierswap-coord-agent")

    def _tick(self) -> None:
        try:
            chan, msg = self.events.get(timeout=min(0.5, self.cfg.heartbeat / 2))
        except queue.Empty:
            chan, msg = None, None
        now = time.monotonic()
        for quiet_host, quiet in self.hosts.silent(now, self.cfg.lease):
            self._host_lost(quiet_host, f"no heartbeat for {quiet:.1f} s (lease expired)")
        if chan is None:
            if self.hosts.waiting:
                gone = self.nodes.exited_before_joining(set(self.hosts.conns))
                if gone:
                    raise JobStopped(f"{gone}; its output above says why") from None
            if now > self.deadline:
                raise JobStopped(f"timed out {self._waiting_for()}") from None
            return
        host = self.hosts.host_of(chan)
        if msg is None:
            if host is not None:
                self._host_lost(host, "agent connection lost")
            return
        op = msg["op"]
        if host is None and op != "hello":
            return  # a host already declared lost (fenced): what it says no longer counts
        node = self.hosts.node_of(host)
        if op in LOGGED:  # a fact for the event log, nothing to decide
            event, fields = LOGGED[op]
            self.log.emit(event, node=node, **_logged(msg, fields))
            self.ledger.logged(op, msg)
            return
        if (handler := getattr(self, f"_on_{op}", None)) is not None:
            handler(chan, node, msg)
        elif (entry := getattr(self.ledger, f"on_{op}", None)) is not None:
            entry(node, msg)  # what tiers hold, and commits
        else:
            raise JobStopped(f"unknown message {op!r} from host {host}")

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
        chan = self.hosts.agents.get(node)
        if chan is not None:
            try:
                chan.send(op, **fields)
            except OSError:
                pass  # its reader reports the loss

    def _broadcast(self, op: str, **fields: Any) -> None:
        """Send to every member's agent; a dead one is noticed by its reader, not here."""
        for chan in list(self.hosts.agents.values()):
            try:
                chan.send(op, **fields)
            except OSError:
                pass

    def _waiting_for(self) -> str:
        if self.hosts.waiting:
            return f"waiting for nodes {sorted(self.hosts.waiting)} to join"
        if self.hosts.vacant:
            vacant = sorted(self.hosts.vacant)
            return f"waiting for a node to join to take the place of nodes {vacant} (no spare left)"
        if self.stopping:
            return f"waiting for nodes {sorted(self.stopping)} to stop their workers"
        if self.persister.inflight is not None:
            step = self.persister.inflight.step
            return f"waiting for step {step} to be written to {self.cfg.persist}"
        return (
            f"in phase {self.phase!r} waiting for step {self.last_step} to be committed "
            f"in memory (committed: {self.ledger.tiers()})"
        )

    def shutdown(self) -> None:
        for chan in list(self.hosts.conns.values()):
            try:
                chan.send("exit")
            except OSError:
                pass
        self.nodes.stop_all(told=set(self.hosts.conns))
        self._stop_accepting()
        n = remove_job_segments(self.job_id)
        if n:
            self.log.emit("memory_released", segments=n)
        self.log.close()

    # ---------------------------------------------------------------- membership

    def _on_hello(self, chan: Channel, node: int | None, msg: Message) -> None:
        """A host connected: give it its id, the job's config and script."""
        host = self.hosts.connected(int(msg["host"]), int(msg["pid"]), chan)
        chan.send(
            "welcome",
            host=host,
            config=self.cfg.to_env(),
            job_id=self.job_id,
            script=[str(Path(self.nodes.script[0]).resolve()), *self.nodes.script[1:]],
        )

    def _on_ready(self, chan: Channel, node: int | None, msg: Message) -> None:
        """Its agent runs and its workers are parked: a member of the first generation,
        or a spare."""
        host = self.hosts.host_of(chan)
        assert host is not None
        pid, workers = self.hosts.pids[host], list(msg.get("workers", []))
        self.booting.discard(host)
        seen = {"host": host, "pid": pid, "address": msg["replica"][0], "workers": workers}
        role = self.hosts.ready(host, list(msg["replica"]))
        if role is None:
            return
        if role:
            self.commits.live.add(host)
            self.log.emit("node_joined", node=host, role="member", **seen)
        else:
            self.log.emit("node_joined", node=None, role="spare", **seen)
            self.progress.message(f"spare host {host} (pid {pid}) parked")
        self._maybe_start()

    def _ranks_of(self, node: int) -> list[int]:
        p = self.cfg.nproc_per_node
        return list(range(node * p, (node + 1) * p))

    def _host_lost(self, host: int, why: str) -> None:
        """A host is gone (its connection closed or its lease expired): fence it, let its
        node be taken by a spare, and start a fresh host in its place when simulating."""
        spare = host in self.hosts.spares
        self.booting.discard(host)
        chan, node = self.hosts.lost(host)
        self.nodes.kill(host)  # fencing: a host declared lost must not come back by itself
        remove_job_segments(self.job_id, self.hosts.pids.get(host, -1))
        if chan is not None:
            chan.close()
        if self.phase != "done" and self.cfg.revive and self.nodes.is_local(host):
            self.to_revive += 1  # once the job runs again, or at once when it waits for one
        if spare:
            self.log.emit("spare_lost", host=host, reason=why)
            self.progress.message(f"spare host {host} lost: {why}")
        elif node is not None:
            self._node_lost(node, host, why)
        else:  # a host still booting: one waited for may need starting again
            self._maybe_start()

    def _revive(self, needed: int) -> None:
        """Start lost simulated hosts again, as many as ``needed`` beyond those booting."""
        for _ in range(min(needed - len(self.booting), self.to_revive)):
            self.to_revive -= 1
            host = self.hosts.new_id()
            self.booting.add(host)
            self.nodes.start(host, self.address)

    def _node_lost(self, node: int, host: int, why: str) -> None:
        self.commits.node_lost(node)
        if self.phase == "done":
            return
        if self.phase != "running":  # finishing, or a second failure while recovering
            self.log.emit(
                "failure_detected",
                what="node",
                node=node,
                host=host,
                ranks=self._ranks_of(node),
                detail=f"host {host}: {why} (during {self.phase})",
                generation=self.generation,
            )
            self.progress.message(f"node {node} (host {host}) lost during {self.phase}: {why}")
        if self.phase == "finishing":
            self.persister.cancel()
            self.persister.ok = False  # finish with what is committed; say what is not
            kept = self.ledger.tiers()
            self.progress.message(f"finishing with the steps already committed: {kept}")
            self.last_step = min(self.last_step, self.commits.committed[0])
            self._maybe_done()
            return
        self.hosts.vacant.add(node)
        self.stopping.discard(node)
        self.reports.forget(node)
        if self.phase == "running":
            self._failure("node", node, self._ranks_of(node), f"host {host}: {why}", host)
        self._maybe_start()

    def _on_exited(self, chan: Channel, node: int | None, msg: Message) -> None:
        rank, code = int(msg["rank"]), int(msg["code"])
        if code == 0 and rank in self.finished:
            return
        if self.phase == "running":
            self._failure("worker", node, [rank], f"exit code {code}")

    def _on_left(self, chan: Channel, node: int | None, msg: Message) -> None:
        """A worker left its generation by itself: a collective failed under it
        (``collective``), or its restore source was corrupt (``corrupt``)."""
        if self.phase == "running":
            reason = str(msg.get("reason", "collective"))
            self._failure(reason, node, [int(msg["rank"])], str(msg["why"]))

    def _on_hung(self, chan: Channel, node: int | None, msg: Message) -> None:
        self.log.emit("worker_hung", node=node, rank=msg["rank"], pid=msg["pid"], why=msg["why"])
        self.progress.message(f"rank {msg['rank']} (pid {msg['pid']}) killed: {msg['why']}")

    def _on_start_failed(self, chan: Channel, node: int | None, msg: Message) -> None:
        raise JobStopped(
            f"a worker of host {msg['host']} exited with code {msg['code']} before it was "
            "ready; the script's output above says why"
        )

    def _on_spare_worker_exited(self, chan: Channel, node: int | None, msg: Message) -> None:
        self.log.emit("spare_worker_exited", host=self.hosts.host_of(chan), code=msg["code"])

    # ---------------------------------------------------------------- failure and restore

    def _failure(
        self, what: str, node: int | None, ranks: list[int], detail: str, host: int | None = None
    ) -> None:
        detect = self.clock.failed(self.last_step)
        if host is None and node is not None:
            host = self.hosts.members.get(node)
        self.log.emit(
            "failure_detected",
            what=what,
            node=node,
            host=host,
            ranks=ranks,
            detail=detail,
            generation=self.generation,
            seconds=detect,
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
        self.reports.forget()
        self.stopping = set(self.hosts.agents)
        self._broadcast("stop")

    def _on_stopped(self, chan: Channel, node: int | None, msg: Message) -> None:
        assert node is not None
        self.stopping.discard(node)
        self.reports.stopped(node, msg)
        self._maybe_start()

    def _maybe_start(self) -> None:
        if self.phase not in ("starting", "recovering"):
            return
        if self.hosts.waiting or self.stopping:
            return
        for node, host in self.hosts.fill_vacancies():
            self.commits.live.add(node)
            self.log.emit(
                "spare_assigned",
                node=node,
                host=host,
                pid=self.hosts.pids[host],
                ranks=self._ranks_of(node),
                spares_left=len(self.hosts.spares),
            )
            self.progress.message(f"spare host {host} takes node {node}")
        if self.hosts.vacant:
            self._no_spare()
            return
        self.waiting_since = None
        self._start_generation()

    def _no_spare(self) -> None:
        nodes = sorted(self.hosts.vacant)
        if self.cfg.on_no_spare == "fail":
            keep = self.ledger.tiers()
            hint = (
                f" Tier 2 at {self.cfg.persist} keeps step {self.persister.committed}: run the "
                "job again with the same --persist to resume."
                if self.persister.committed >= 0
                else " Nothing was written to tier 2 (no --persist, or no step persisted yet):"
                " memory tiers end with the job. Run with --persist and --spares to survive this."
            )
            raise JobStopped(
                f"nodes {nodes} failed and no spare is left (--on-no-spare fail); "
                f"committed: {keep}.{hint}"
            )
        self._revive(len(nodes))
        if self.waiting_since is None:
            self.waiting_since = time.monotonic()
            self.deadline = self.waiting_since + self.cfg.join_timeout
            self.log.emit("waiting_for_node", nodes=nodes, timeout=self.cfg.join_timeout)
            self.progress.message(
                f"no spare for nodes {nodes}: waiting up to {self.cfg.join_timeout:g} s for a "
                f"node to join (tierswap run --join {self.address[0]}:{self.address[1]})"
            )

    def _durable_steps(self) -> frozenset[int]:
        if self.cfg.persist is None:
            return frozenset()
        try:
            return committed_steps(self.cfg.persist, self.cfg.world_size)
        except OSError as e:
            self.persister.failing(f"cannot list {self.cfg.persist}: {e}")
            return frozenset()

    def _bad_commit(self, step: int, why: str) -> None:
        self.log.emit("corrupt_part", step=step, tier=2, where="COMMIT", why=why)
        self.persister.forget(step)

    def _start_generation(self) -> None:
        holdings, plan, plans = self.reports.plan(
            self._durable_steps, self.hosts.peer_addresses, self._bad_commit
        )
        for step, why in plan.skipped:
            self.log.emit("restore_skipped", step=step, reason=why)
        if plan.step is None and (self.ledger.ever_committed or holdings.durable):
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
        self.ledger.restart(self.generation)
        self.persister.cancel(restart)
        # parts of later steps will be written anew by this timeline
        self.reports.restarted(restart)
        self.deadline = float("inf")
        self.clock.generation_started()
        for node, chan in sorted(self.hosts.agents.items()):
            ranks = self._ranks_of(node)
            try:
                chan.send(
                    "start",
                    node=node,
                    generation=self.generation,
                    backend=self.cfg.backend,
                    world_size=self.cfg.world_size,
                    ranks=ranks,
                    store=f"{self.cfg.bind}:{self.store.port}",
                    plans={str(r): plans[r] for r in ranks},
                    inject=self.injections,
                    restart_step=restart,
                    committed=[self.commits.committed[0], self.commits.committed[1]],
                    max_redo=self.cfg.max_redo if self.replicas else 0,
                    placement={str(r): list(self.targets[r]) for r in ranks},
                    protects=[r for r, t in self.targets.items() if node in t],
                    peers={str(n): a for n, a in self.hosts.peer_addresses.items()},
                )
            except OSError:
                pass  # its reader reports the loss, and the node is replaced
        self.log.emit(
            "generation_started",
            generation=self.generation,
            step=plan.step,
            members={str(n): h for n, h in sorted(self.hosts.members.items())},
            spares=list(self.hosts.spares),
        )
        self._inject_nodes(node_faults_due(self.injections, generation=self.generation))

    def _say_fallback(self, holdings: Holdings, plan: Plan) -> None:
        ever = self.ledger.ever_committed
        gone = memory_lost(holdings, plan) if plan.step is not None and ever else []
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
        self.clock.restored()

    def _on_joined(self, chan: Channel, node: int | None, msg: Message) -> None:
        """A worker joined this generation's process group."""
        rebuilt = self.clock.worker_joined(int(msg["rank"]), int(msg["pid"]))
        if rebuilt is not None:
            self.log.emit("rebuilt", generation=self.generation, **rebuilt)

    def _on_stepped(self, chan: Channel, node: int | None, msg: Message) -> None:
        """A worker finished its first step of this generation."""
        step = -1 if self.plan is None or self.plan.step is None else self.plan.step
        resumed = self.clock.worker_stepped(int(msg["rank"]), step)
        if resumed is None:
            return
        self.log.emit("resumed", generation=self.generation, step=step, **resumed)
        text = ", ".join(f"{k} {v:.2f}" for k, v in resumed["phases"].items())
        self.progress.message(f"resumed in {resumed['seconds']:.2f} s ({text})")

    def _on_corrupt(self, chan: Channel, node: int | None, msg: Message) -> None:
        rank, step, tier = int(msg["rank"]), msg.get("step"), msg.get("tier")
        if step is not None and tier is not None:
            self.reports.bad.add((Tier(int(tier)), int(step), rank))
            if int(tier) == Tier.DURABLE:
                self.persister.forget(int(step))
        self.log.emit(
            "corrupt_part", rank=rank, where=msg["where"], why=msg["why"], step=step, tier=tier
        )
        self.progress.message(f"rank {rank}: {msg['where']}: {msg['why']}; trying an older step")

    def _on_fatal(self, chan: Channel, node: int | None, msg: Message) -> None:
        raise JobStopped(f"rank {msg['rank']}: {msg['message']}")

    def _on_inject_fired(self, chan: Channel, node: int | None, msg: Message) -> None:
        self.clock.fault()
        if msg["spec"] in self.injections:
            self.injections.remove(msg["spec"])
        self.log.emit("fault_injected", spec=msg["spec"])

    # ---------------------------------------------------------------- memory limits

    def _on_peer_memory_exceeded(self, chan: Channel, node: int | None, msg: Message) -> None:
        raise JobStopped(
            f"node {node} must hold {msg['need']:,} bytes of replicas for ranks {msg['ranks']} "
            f"({self.cfg.slots} slots each, --memory-tiers {self.cfg.memory_tiers}), more than "
            f"--max-peer-memory {msg['limit']:,}. Raise --max-peer-memory, add nodes, or "
            "lower --replicas."
        )

    # ---------------------------------------------------------------- progress and the end

    def _on_progress(self, chan: Channel, node: int | None, msg: Message) -> None:
        step = int(msg["step"])
        self._inject_nodes(node_faults_due(self.injections, step=step))
        self.last_step = max(self.last_step, step)
        if int(msg["rank"]) == 0:
            self.progress.update(step, self.last_loss, float(msg["stall"]), self.ledger.tiers())

    def _on_replicating(self, chan: Channel, node: int | None, msg: Message) -> None:
        """A replica transfer starts (reported only when an injection waits for one)."""
        transfer = (node, int(msg["peer"]), int(msg["step"]))
        self._inject_nodes(node_faults_due(self.injections, transfer=transfer))

    def _inject_nodes(self, due: list[tuple[str, Injection]]) -> None:
        """Fault injection: kill (or freeze) the hosts serving these nodes, at once."""
        for spec, inj in due:
            host = self.hosts.members.get(inj.index)
            if host is None:
                continue
            self.injections.remove(spec)
            self.log.emit("fault_injected", spec=spec, host=host)
            self.clock.fault()
            if inj.action == "kill":
                self.nodes.kill(host)
            else:
                self.nodes.freeze(host)

    def _on_report(self, chan: Channel, node: int | None, msg: Message) -> None:
        if "total" in msg:
            self.progress.total = int(msg["total"])
        metrics = msg.get("metrics") or {}
        if int(msg["rank"]) == 0 and metrics:
            self.last_loss = metrics.get("loss", self.last_loss)
            self.log.emit("report", step=msg["step"], **metrics)

    def _on_replica_sent(self, chan: Channel, node: int | None, msg: Message) -> None:
        self.traffic.add(msg["kind"], int(msg["nbytes"]), int(msg["full"]), msg["encode_s"])

    def _on_finished(self, chan: Channel, node: int | None, msg: Message) -> None:
        if self.phase != "running":  # a generation being torn down: the next one reruns it
            return
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
        if self.traffic.full:
            self.log.emit("replica_traffic", **self.traffic.summary())
        self.log.emit(
            "job_finished", step=self.last_step, generation=self.generation, restarts=self.restarts
        )
        self.progress.message(
            f"finished step {self.last_step + 1} "
            f"after {self.restarts} recoveries; committed {self.ledger.tiers()}"
        )
