"""One Config for a job, validated once; settable from the CLI and TIERSWAP_* variables."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from tierswap.affinity import parse_cpus
from tierswap.faults import Chaos, Injection

ENV_PREFIX = "TIERSWAP_"
AUTO_PARITY = 3
"""The parity group an unset ``--peer-parity`` picks where the job has that many nodes:
3x a node's state in all with the default slots, the least group that saves memory."""


@dataclass(kw_only=True, slots=True)
class Config:
    """Everything a job is run with. Each field can be set as ``TIERSWAP_<NAME>``."""

    nodes: int = 1
    """Nodes in the job; on one machine each is simulated by an agent with its workers."""
    nproc_per_node: int = 1
    """Workers (ranks) per node."""
    persist: str | None = None
    """Durable root (tier 2): a local path or any fsspec URL. None keeps memory tiers only."""
    persist_every: int = 10
    """Write the committed step to tier 2 every this many steps."""
    keep: int = 2
    """Committed steps kept in tier 2; the newest committed one is never deleted."""
    job_name: str | None = None
    """The job's name in tier 2: a durable root holds one job's steps (its JOB file), and a
    job started on it resumes them. None takes the root's name (or makes one up for a new
    root); another name than the root's is refused."""
    take_over_root: bool = False
    """Take the durable root although another job's lease on it looks alive (its host is
    gone for good, say). Two jobs writing one root lose each other's steps."""
    run_dir: str | None = None
    """Where the event log and sockets go; a fresh folder under ./runs when None."""
    slots: int | None = None
    """Tier-0 slots per rank: the step committed in tier 0 and one being written. Unset (the
    default): 2, or 3 with ``--persist``, whose write of a step to tier 2 holds that step's
    slot until it is written (with two, every snapshot taken meanwhile finds no slot and is
    skipped); with tier 1 on and ``--max-redo`` K of 2 or more, K + 1 (K + 2 with
    ``--persist``), as tier 1 may then trail tier 0 by K steps, each holding its slot (with
    2 slots and ``--max-redo 2`` a 2-node job whose replicas lag skipped 23 of its 32
    snapshots and committed 3 of 16 steps in tier 1; with 3, none and 14). A ring given
    fewer is said at the start (:meth:`Config.slot_advice`). In a ring of 2 a step is
    skipped (and counted) whenever the one before is not yet committed when its snapshot is
    taken; with tier 1 on, the step tier 1 committed is the one kept, tier 0's own newer
    commit giving way when they differ. ``--max-redo 1``, the default, makes them the same
    step wherever replication keeps up, so nothing is skipped there. A third slot keeps the
    newest step apart from the committed one, a fourth every step while tier 1 trails tier
    0, each at one more snapshot of memory per rank. With ``--max-redo 0`` give both rings a
    third (``--slots 3 --peer-slots 3``): in the simulation 2 + 2 then skipped 2.5x the
    snapshots of 3 + 3 and committed 13 % fewer tier-1 steps (with ``--max-redo 1``, 0.3 %
    fewer)."""
    peer_slots: int = 2
    """Tier-1 slots per protected rank on each of the ``--replicas`` peers holding its
    replicas (or per parity, with ``--peer-parity``): the step committed in tier 1 and
    one being received. A node holds ``slots + peer_slots * replicas`` times its ranks'
    state with full copies. A replica that arrives while the newest one waits for its
    commit is refused, so where the network is slow against the step (``--max-redo 0``)
    tier 1 commits fewer steps; a third slot holds the newest received apart from the
    committed one."""
    inject: tuple[Injection, ...] = ()
    """Faults to inject, for tests and the demo (``tierswap.faults`` lists the forms)."""
    chaos: str | None = None
    """``SEED[:RATE[:COUNT]]``: kill random nodes and workers of this machine at random
    moments, about RATE a minute (default 6), COUNT in all (no end by default), each
    logged as a ``fault_injected``; for soak tests. A strike waits until the job has
    recovered from the last one and trained a step. Spares or revived nodes keep the job
    going; raise --max-restarts to match."""
    replicas: int = 1
    """Tier-1 copies of each rank's snapshots in other nodes' memory (0 turns tier 1 off;
    a job with fewer nodes uses what it has)."""
    peer_parity: int | None = None
    """Tier 1 as parity instead of copies: the nodes form groups of this many (at least 2;
    a job's last nodes join the group before), each rank's snapshot is cut into
    ``group - 1`` stripes, and each node of a group holds the XOR of one stripe of every
    other node's, so a node holds ``slots + peer_slots / (group - 1)`` times its ranks'
    state (3x with the default slots and groups of 3) instead of ``slots + peer_slots``
    (4x). It survives one lost node per group (two in one group fall back to tier 2); a
    lost rank is rebuilt from its parities and the survivors' own tier 0, reading
    ``group - 1`` times its state where a copy reads it once. 0 keeps ``--replicas`` full
    copies. Needs ``--replicas 1``, ``--memory-tiers full`` and ``--max-redo`` 1 or more.
    Unset (the default): groups of 3 where the job has 3 nodes or more and those hold,
    and ``--on-no-spare`` is not shrink (a shrink writes a lost rank from a whole
    replica); else full copies."""
    max_redo: int = 1
    """Steps of work a node failure may cost while tier 1 is on. The ``optimizer.step()``
    of step t waits until tier 1 has committed step t - max_redo (or a failure there, a
    skipped snapshot or a rejected replica, means it never will), so replication can never
    fall further behind than that; where it keeps up the wait is zero. 0 never waits:
    training then runs ahead of a slow network and a failure redoes as many steps as
    tier 1 trails by."""
    max_peer_memory: int = 0
    """Bytes of replicas one node may hold for others; 0 is no bound."""
    bind: str = "127.0.0.1"
    """Address the job's first host listens on and is reached at: the coordinator, its
    store and the replica servers of the nodes it simulates. Hosts that join from other
    machines listen on their own address."""
    tls: Literal["auto", "on", "off"] = "auto"
    """TLS (1.3, with a certificate every process derives from the job's secret) for
    replica traffic: "auto" for every connection that leaves loopback, "on" for every
    one, "off" for none (a fabric that is private already; then a host on the path can
    read replicas, though never inject a message: every frame carries a MAC)."""
    max_restarts: int = 10
    """Failures the job recovers from before it gives up."""
    startup_timeout: float = 120.0
    """Seconds to wait for agents and workers to start and join."""
    stop_grace: float = 20.0
    """Seconds a job stopped by a signal to the coordinator's launcher (SIGTERM, SIGINT,
    SIGHUP: Ctrl-C at its terminal, ``kill`` of its pid, a container runtime's SIGTERM to
    the container's main process) spends writing its newest step in memory to tier 2
    first, where tier 2 lacks it; 0 stops at once. Keep it below the grace the sender
    gives before SIGKILL. A scheduler that signals every process of the job (Slurm)
    stops its agents too: that job resumes from its last periodic step."""
    threads: int = 0
    """torch threads per worker; 0 leaves torch's default."""
    agent_cpus: str | None = None
    """CPUs (a list such as ``0-3,8``) that tierswap's own work runs on, by affinity:
    each host's agent, the launcher, and the workers' snapshot copy and restore fetch
    threads, so that the trainers keep their cores, as on a GPU host. None: no pinning.
    Each host of a multi-host launch pins by its own line's."""
    worker_cpus: str | None = None
    """CPUs the workers' training threads run on; None: every CPU but ``agent_cpus``
    when those are given, else no pinning."""
    console: bool = True
    """Print progress and failures on the launcher's console."""
    spares: int = 0
    """Spare nodes, started with their workers imported and parked; a failed node's ranks
    go to one while the survivors keep their processes."""
    warm_spares: bool = True
    """Parked spare hosts make the shared memory a node's snapshots take (its tier-0
    slots and tier-1 rings, as the members report them) while they wait, so that taking
    over a node allocates none; parked workers (spare workers, a spare host's, survivors
    between generations) make the private memory a restore of a rank reads into and keeps
    (one rank's state each, on a CPU). Off leaves that memory free until it is needed."""
    interrupt_steps: bool = True
    """A survivor's step is cut short as soon as its generation ends (``GenerationEnded``
    raised in the training loop's own code, never inside tierswap's calls), instead of
    running on until its next collective fails; off lets every step run to a collective
    or its end (for loop code that must not be interrupted halfway)."""
    spare_workers: int = 0
    """Extra workers per node, imported and parked: a crashed worker's rank goes to one
    at once instead of to a process that must first start and import (seconds)."""
    on_no_spare: Literal["wait", "fail", "shrink"] = "wait"
    """When a node fails and no spare is parked: "wait" for a node to join (up to
    ``join_timeout``), "fail" (stop; every committed tier is kept for a resume), or
    "shrink" (go on with the nodes left, resharded from tier 2's newest step, which
    leaves the bit-exact path; back to full size at the step boundary after hosts join;
    needs ``persist``)."""
    join_timeout: float = 300.0
    """Seconds to wait for a node to join when a failed node's ranks have no spare."""
    heartbeat: float = 1.0
    """Seconds between heartbeats: agents to the coordinator, workers to their agent."""
    lease: float = 10.0
    """Seconds without a heartbeat after which a process counts as failed: a silent agent
    is fenced (its node is killed) and replaced, a silent worker is killed and replaced."""
    collective_timeout: float = 60.0
    """Seconds a collective may block before it fails (torch's default is 30 minutes);
    also how long a worker may take to leave its step when a generation ends."""
    backend: Literal["gloo", "nccl"] = "gloo"
    """Collective backend of the workers' process group: "gloo" (CPU, the simulated
    nodes) or "nccl" (GPUs; a generation's end aborts the communicator, so that kernels
    blocked on a dead peer return at once)."""
    revive: bool = True
    """Simulated nodes: a killed node comes back empty, as a rebooted host would, and
    joins the spare pool when the job needs a spare."""
    memory_tiers: Literal["full", "delta"] = "full"
    """How tier 1 holds replicas: "full" (every replica a whole snapshot) or "delta" (one
    base per rank plus each step as a delta against it, encoded in the agent). Tier 0 is
    always full: a local rollback runs at memcpy speed. "full" is the default because on
    pretraining a delta is most of a snapshot and the codec is slower than the network
    (docs/measurements.md, ``tierswap bench delta``); "delta" pays where few bytes change
    per step (fine-tuning, sparse embeddings, bf16), in peer memory and traffic."""
    base_every: int = 50
    """``--memory-tiers delta``: a new base every this many steps at most."""
    persist_deltas: bool = False
    """Incremental tier 2: a rank's part is written as a delta against its part of an older
    full step (at most ``base_every`` steps old; a delta past ``delta_threshold`` is written
    full instead), so frequent durable checkpoints cost the bytes that changed. A step
    whose base is gone is never restored from; retention keeps the bases that kept steps
    need."""
    init_from: str | None = None
    """A DCP checkpoint folder (``torch.distributed.checkpoint``) the job starts from when
    no tier holds a step of it: the first ``job.steps`` loads it into the live objects
    through ``dcp.load``, resharded to this job, and goes on at the step after the one it
    holds. Keys it lacks are left as built and named. Its ``.metadata`` is a pickle: give
    only a checkpoint you trust."""
    init_step: int | None = None
    """``--init-from``: the step the checkpoint holds (the job's first step is the next);
    None reads a ``step`` value saved in it."""
    delta_threshold: float = 0.5
    """``--memory-tiers delta``: a delta larger than this fraction of its snapshot makes
    the next replica a new base (deltas are never chained; each is against its base)."""

    def __post_init__(self) -> None:
        for name in ("nodes", "nproc_per_node", "persist_every", "keep"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.slots is not None and self.slots < 2:
            raise ValueError(
                f"slots must be >= 2 (the committed step and one being written), got {self.slots}"
            )
        if self.peer_slots < 2:
            raise ValueError(
                f"peer_slots must be >= 2 (the step committed in tier 1 and one being "
                f"received), got {self.peer_slots}"
            )
        for name in ("max_restarts", "threads", "replicas", "max_peer_memory", "max_redo"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.peer_parity is not None and (self.peer_parity == 1 or self.peer_parity < 0):
            raise ValueError(
                f"peer_parity must be 0 (full replicas) or a group of >= 2 nodes, got "
                f"{self.peer_parity}"
            )
        if self.peer_parity and self.max_redo < 1:  # an explicit group; unset never errs
            raise ValueError(
                f"--peer-parity {self.peer_parity} needs --max-redo 1 or more: a parity is of "
                "use only while the other ranks of its set still hold its step in tier 0, and "
                "without the trainers waiting for tier 1 their tier 0 moves on before the "
                "parities are made (a lost node then finds no step to come back to)"
            )
        if self.peer_parity and (self.replicas != 1 or self.memory_tiers != "full"):
            raise ValueError(
                f"--peer-parity {self.peer_parity} holds one parity per group in place of "
                f"--replicas copies: it needs --replicas 1 (got {self.replicas}) and "
                f"--memory-tiers full (got {self.memory_tiers!r})"
            )
        for name in ("spares", "spare_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("startup_timeout", "join_timeout", "heartbeat", "collective_timeout"):
            if not getattr(self, name) > 0:  # also refuses NaN
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.stop_grace < float("inf"):
            raise ValueError(f"stop_grace must be >= 0 and finite, got {self.stop_grace}")
        if not self.lease >= 2 * self.heartbeat:
            raise ValueError(
                f"lease ({self.lease} s) must be at least 2 heartbeats ({self.heartbeat} s) "
                "or one late heartbeat fails a healthy process"
            )
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.tls not in ("auto", "on", "off"):
            raise ValueError(f"tls must be 'auto', 'on' or 'off', got {self.tls!r}")
        if self.memory_tiers not in ("full", "delta"):
            raise ValueError(f"memory_tiers must be 'full' or 'delta', got {self.memory_tiers!r}")
        if self.base_every < 1:
            raise ValueError(f"base_every must be >= 1, got {self.base_every}")
        if not 0 < self.delta_threshold <= 1:
            raise ValueError(
                f"delta_threshold must be in (0, 1] (a fraction of a snapshot's bytes), "
                f"got {self.delta_threshold}"
            )
        if self.on_no_spare not in ("wait", "fail", "shrink"):
            raise ValueError(
                f"on_no_spare must be 'wait', 'fail' or 'shrink', got {self.on_no_spare!r}"
            )
        if self.on_no_spare == "shrink" and self.persist is None:
            raise ValueError(
                "--on-no-spare shrink needs --persist: the nodes left go on from tier 2's "
                "newest step, resharded to their world size"
            )
        if self.init_step is not None and (self.init_from is None or self.init_step < 0):
            raise ValueError(
                f"init_step {self.init_step}: needs --init-from, and a step number >= 0"
            )
        for name in ("agent_cpus", "worker_cpus"):
            if getattr(self, name) is not None:
                try:
                    parse_cpus(getattr(self, name))
                except ValueError as e:
                    raise ValueError(f"{name}: {e}") from None
        if self.chaos is not None:
            Chaos.parse(self.chaos)  # refused here, with the forms, rather than mid-run
        for inj in self.inject:
            limit = self.nodes if inj.target == "node" else self.world_size
            if inj.index >= limit:
                raise ValueError(f"--inject {inj}: there are only {limit} {inj.target}s")

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    @property
    def tier0_slots(self) -> int:
        """The slots of each rank's tier-0 ring: ``--slots``, or what unset picks."""
        return self.slots if self.slots is not None else self._unset_slots()

    def _unset_slots(self) -> int:
        """What an unset ``--slots`` picks: :meth:`_ring_need`, and one more with
        ``--persist`` (a tier-2 write holds its step's slot while it lasts)."""
        return self._ring_need() + (1 if self.persist is not None else 0)

    def _ring_need(self) -> int:
        """Tier-0 slots a ring needs for tier 1 to trail it by ``--max-redo`` steps and
        one more to be written (2 at the least), not counting a tier-2 write's."""
        return max(2, self.max_redo + 1) if self.replicas and self.nodes >= 2 else 2

    def slot_advice(self) -> str | None:
        """What to give where ``--slots`` leaves tier 0's ring fewer slots than an unset one
        would have with ``--max-redo`` 2 or more (tier 1 may trail it by that many steps,
        each holding its slot): snapshots would be skipped whenever it does; None where
        the ring is large enough, ``--slots`` is unset, or ``--max-redo`` is 0 or 1."""
        need = self._unset_slots()
        if self.slots is None or self._ring_need() <= 2 or self.slots >= need:
            return None
        persist = self.persist is not None
        return (
            f"--slots {self.slots} with --max-redo {self.max_redo}"
            + (" and --persist" if persist else "")
            + f": tier 1 may trail tier 0 by {self.max_redo} steps, each holding its slot"
            + (", and a tier-2 write holds one more" if persist else "")
            + f", so snapshots will be skipped whenever it does; give --slots {need} or "
            "more (leave it unset and it follows --max-redo), one more snapshot of memory "
            "per rank each"
        )

    @property
    def parity_group(self) -> int:
        """The parity group tier 1 is kept in (``--peer-parity``, or what unset picks); 0
        for full copies."""
        if self.peer_parity is not None:
            return self.peer_parity
        fits = self.replicas == 1 and self.memory_tiers == "full" and self.max_redo >= 1
        if fits and self.nodes >= AUTO_PARITY and self.on_no_spare != "shrink":
            return AUTO_PARITY
        return 0

    def to_env(self) -> dict[str, str]:
        """TIERSWAP_* variables that ``from_env`` reads back to an equal Config."""
        env = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None and _unset_int(f):  # unset has a meaning: kept over a host's own
                env[ENV_PREFIX + f.name.upper()] = ""
                continue
            if v is None:
                continue
            text = ",".join(str(i) for i in v) if f.name == "inject" else str(v)
            env[ENV_PREFIX + f.name.upper()] = text
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Config:
        """A Config from TIERSWAP_* variables, with ``overrides`` (not None) winning."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(ENV_PREFIX + f.name.upper())
            if raw is not None:
                values[f.name] = _parse(f, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _unset_int(f: dataclasses.Field[Any]) -> bool:
    """An ``int | None`` field, whose None (unset) picks a value from the others."""
    return f.default is None and str(f.type).startswith("int")


def _parse(f: dataclasses.Field[Any], raw: str) -> Any:
    default = f.default
    if raw == "" and _unset_int(f):
        return None
    if f.name == "inject":
        return tuple(Injection.parse(s) for s in raw.split(",") if s)
    try:
        if isinstance(default, bool):
            return raw.lower() in ("1", "true", "yes", "on")
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
        if default is None and str(f.type).startswith("int"):
            return int(raw)
    except ValueError:
        kind = {"int": "an integer", "float": "a number"}.get(
            "int" if default is None else type(default).__name__, "a value of its kind"
        )
        raise ValueError(f"{ENV_PREFIX}{f.name.upper()}={raw!r} is not {kind}") from None
    return raw


def field_docs() -> dict[str, str]:
    """Each Config field's sentence (the string under it in the class), by name: what
    ``tierswap run -h`` shows, written once."""
    import ast
    import inspect
    import itertools
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(Config)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for prev, node in itertools.pairwise(body):
        is_doc = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        if isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name) and is_doc:
            docs[prev.target.id] = " ".join(str(node.value.value).split())
    return docs
