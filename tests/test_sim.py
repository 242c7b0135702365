"""The control plane under generated failures, in the deterministic simulation.

The coordinator's and agents' real cores and the real codec run in ``tierswap.control.sim``
with workers that speak the protocol; hosts die, workers die, hosts freeze and links are
cut at random moments. After every event the simulation checks its invariants (one
generation running at most, a restore never mixing steps, a committed step never planned
away while a tier still holds it, one worker per rank, no host both member and spare);
every run must end, finished with the numbers of a run without failures, or stopped for a
reason that the failures explain. A failure names its seed: ``pytest tests/test_sim.py
--seed N`` replays it exactly and prints what the coordinator logged.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from tierswap.config import Config
from tierswap.control import hosts
from tierswap.control import protocol as p
from tierswap.control import workers as worker_table
from tierswap.control.sim import Sim
from tierswap.control.simworld import Chaos, Violation
from tierswap.control.states import Phase

SCENARIOS = int(os.environ.get("TIERSWAP_SIM_SCENARIOS", "1000"))
"""Seeded scenarios per run of the suite (about 50 a second on this machine; raise it
with TIERSWAP_SIM_SCENARIOS for a deeper search)."""

EXPLAINED = (
    "no step can be restored",  # every copy of some rank's state was lost with its hosts
    "more than --max-restarts",
    "no spare is left",
    "before it was ready",  # a worker killed while the job's first workers start: taken
    # for a script that cannot start (it stops the job rather than retry a broken script)
)
"""Why a job may stop under the failures it was given; anything else (a timeout above all,
which is a hang with a deadline) is a bug."""


def scenario(seed: int, since_12_05: bool = True) -> Sim:
    """A job shape and a chaos plan drawn from the seed (``since_12_05``: and tier 1 as
    parity, two-slot rings, drawn last; off, the scenario of the seed before them)."""
    rng = random.Random(seed)
    nodes = rng.choice([2, 2, 3, 4])
    cfg = Config(
        nodes=nodes,
        nproc_per_node=rng.choice([1, 1, 2]),
        spares=rng.choice([0, 1, 2]),
        spare_workers=rng.choice([0, 0, 1]),
        persist=rng.choice([None, "sim://tier2"]),
        persist_every=rng.choice([2, 5]),
        max_redo=rng.choice([0, 1, 1]),
        replicas=rng.choice([1, 1, min(2, nodes - 1)]),
        max_restarts=40,
        console=False,
        slots=3,  # the defaults these seeds were drawn with (before 12-05)
        peer_slots=3,
        peer_parity=0,
    )
    chaos = Chaos(
        host_kills=rng.choice([0.0, 0.2, 0.5]),
        worker_kills=rng.choice([0.0, 0.3, 0.6]),
        freezes=rng.choice([0.0, 0.0, 0.1]),
        link_cuts=rng.choice([0.0, 0.0, 0.1]),
        duplicate=rng.choice([0.0, 0.0, 0.02]),
        until=rng.uniform(1.0, 8.0),
    )
    step_time = rng.choice([0.005, 0.05, 0.2])
    steps = rng.choice([8, 16])
    if not since_12_05:
        return Sim(cfg, seed=seed, steps=steps, chaos=chaos, step_time=step_time)
    # drawn after the rest, so that a seed keeps the shape and chaos it had before these
    redo = rng.choice([cfg.max_redo, cfg.max_redo, 2]) if cfg.max_redo else 0
    cfg = dataclasses.replace(
        cfg,
        max_redo=redo,
        peer_parity=rng.choice([None, 0, 2, 3]) if cfg.replicas == 1 and redo else None,
        slots=rng.choice([None, 3, 2]),  # unset: Config.tier0_slots (it follows max_redo)
        peer_slots=rng.choice([2, 2, 3]),
    )
    return Sim(cfg, seed=seed, steps=steps, chaos=chaos, step_time=step_time)


def _explained(outcome: str) -> bool:
    return outcome == "finished" or any(why in outcome for why in EXPLAINED)


def _replay(sim: Sim) -> str:
    return "\n".join(f"{t:8.3f} {event} {fields}" for t, event, fields in sim.log[-40:])


def test_seeded_scenarios_keep_every_invariant(request: pytest.FixtureRequest) -> None:
    seed = request.config.getoption("--seed")
    seeds = range(SCENARIOS) if seed is None else [seed]
    finished, t0 = 0, time.monotonic()
    for s in seeds:
        sim = scenario(s)
        try:
            outcome = sim.run()
        except Exception as e:
            raise AssertionError(
                f"seed {s} ({type(e).__name__}): replay with --seed {s}\n{_replay(sim)}"
            ) from e
        assert _explained(outcome), f"seed {s} stopped for {outcome!r}\n{_replay(sim)}"
        finished += outcome == "finished"
    if seed is None:
        assert finished > 0.8 * SCENARIOS, f"only {finished} of {SCENARIOS} runs finished"
        print(f"{SCENARIOS} scenarios in {time.monotonic() - t0:.1f} s, {finished} finished")


# ---------------------------------------------------------------- the lifecycle bugs fixed so far


def _cfg(**kw: object) -> Config:
    old = {"slots": 3, "peer_slots": 3, "peer_parity": 0}  # the defaults the bugs were found with
    return Config(**{"nodes": 2, "console": False, "max_restarts": 10, **old, **kw})  # type: ignore[arg-type]


def test_a_replacement_worker_attaching_during_a_stop_waits_for_the_next_generation() -> None:
    """a01746a: rank 0's worker crashed and its replacement, given rank 0 while still
    starting, attaches only after the generation it was given has ended (node 1 died as
    it started, and the job waits for a host to take node 1); it must not run that
    generation (the next one would lack it)."""
    for seed in range(20):
        sim = Sim(_cfg(), seed=seed, steps=8)
        sim.kill_after("rank", 0, 3)
        sim.kill_at_generation(1, 1)
        assert sim.run() == "finished"
        assert [e for _, e, _ in sim.log].count("generation_started") >= 3


def test_a_node_is_ready_once_and_a_member_never_becomes_a_spare() -> None:
    """32a7912: each replacement worker made its agent say ready again, and the
    coordinator counted the member as a spare too; the next loss of that host was taken
    for a spare's, and its node was never refilled."""
    for seed in range(20):
        sim = Sim(_cfg(spares=1), seed=seed, steps=12)
        sim.kill_after("rank", 1, 2)  # a replacement worker attaches on node 1
        sim.kill_after("node", 1, 6)  # then the whole node goes: the spare must take it
        assert sim.run() == "finished"
        joined = [f["role"] for _, e, f in sim.log if e == "node_joined"]
        assert joined.count("member") == 2, joined
        assert any(e == "spare_assigned" for _, e, _ in sim.log)


def test_a_rank_failing_after_another_finished_gets_that_rank_a_new_worker() -> None:
    """312490f: rank 0 finished and exited, rank 1 died before it finished: the next
    generation needs a fresh worker for rank 0 too (it hung for the rendezvous before)."""
    for seed in range(20):
        sim = Sim(_cfg(), seed=seed, steps=6)
        sim.kill_after("rank", 1, 5)  # after its last step, before it says finished
        assert sim.run() == "finished"


def test_a_job_restored_at_its_last_step_on_a_new_node_finishes() -> None:
    """Node 0 killed as tier 0 commits the last step, while tier 2 writes it: the spare
    restores that step from node 1's replica, so its tier 0 lacks it, and no step comes
    after it to commit. The spare's worker snapshots it once more and node 1 offers the
    step it holds at the start; before, finishing waited for a commit that never came
    (seed 1247 of the scenarios, found when they drew 12-05's defaults)."""
    reached = 0
    for seed in range(15):
        cfg = _cfg(spares=1, max_redo=0, persist="sim://tier2", persist_every=5, slots=None,
                   peer_slots=2, peer_parity=None)  # fmt: skip
        sim = Sim(cfg, seed, steps=8, step_time=0.005)
        while sim.ended is None and not any(
            e == "snapshot_committed" and f["tier"] == 0 and f["step"] == 7 for _, e, f in sim.log
        ):
            sim.run_for(0.0005)
        (host,) = [h for h in sim.hosts.values() if h.alive and h.core and h.core.node == 0]
        host.die()
        outcome = sim.run()
        assert outcome == "finished", f"seed {seed}: {outcome}\n{_replay(sim)}"
        restored = [f for _, e, f in sim.log if e == "restored"]
        reached += any(f["step"] == 7 and 1 in f["tiers"].values() for f in restored)
    assert reached, "no run restored its last step from a peer: the case is not reached"


def test_every_node_killed_once_in_turn_with_spares() -> None:
    for seed in range(10):
        sim = Sim(_cfg(nodes=3, spares=1, persist="sim://tier2", persist_every=2), seed, steps=14)
        for node, step in ((0, 3), (1, 6), (2, 9)):
            sim.kill_after("node", node, step)
        assert sim.run() == "finished"
        assert sum(e == "resumed" for _, e, _ in sim.log) == 3


def test_a_member_lost_while_a_spare_that_took_a_node_waits_for_the_other_vacancy() -> None:
    """9d40743: nodes 1 and 2 die together, the one spare takes node 1 and the job waits
    for a host for node 2; node 0's host dies meanwhile. The stop that names node 0's
    rank reached the spare's agent, which had never started a generation, and it crashed
    (idle has no way to stopping); the healthy spare was then fenced."""
    for seed in range(5):
        sim = Sim(_cfg(nodes=3, spares=1, persist="sim://tier2", persist_every=2), seed, steps=14)
        sim.kill_after("node", 1, 3)
        sim.kill_after("node", 2, 3)
        killed: list[float] = []

        def watch(sim: Sim = sim, killed: list[float] = killed) -> None:
            c = sim.coordinator
            if killed or sim.ended is not None:
                return
            spare_took_node_1 = c.phase == Phase.RECOVERING and c.hosts.members.get(1) == 3
            host = sim.hosts.get(c.hosts.members.get(0, -1))
            if spare_took_node_1 and host is not None and host.alive:
                killed.append(sim.now)
                host.die()
                return
            sim.after(0.001, watch)

        sim.at(0.0, watch)
        outcome = sim.run()
        assert killed, f"seed {seed}: the spare never waited with node 1"
        assert outcome == "finished", f"seed {seed}: {outcome}\n{_replay(sim)}"


def test_a_node_lost_before_tier_1_ever_committed_starts_the_job_over_and_finishes() -> None:
    """A node killed after its first step, before any replica of it committed: no step is
    left on every rank, and nothing protected had been lost, so the job starts over from
    its first step (the chaos runs of `bench goodput` stopped here) and ends with the
    numbers of a run without failures."""
    outcomes = []
    for seed in range(200):  # few seeds land the kill in that window (about 1 in 20)
        sim = Sim(_cfg(spares=1), seed=seed, steps=6)
        sim.kill_after("node", 1, 0)
        assert sim.run() == "finished", seed
        outcomes.append(any(e == "started_over" for _, e, _ in sim.log))
    assert any(outcomes), "no seed lost the node before tier 1 committed: the test tests nothing"


def test_a_node_killed_mid_step_with_its_replica_on_the_way_redoes_one_step_at_most() -> None:
    """A node dies after its ranks exchanged a step's gradients, before their optimizer
    step, while its snapshot of the step before is still on its way to a peer (cut off
    there): the survivor's optimizer step waits for tier 1 (``--max-redo 1``), so the
    recovery redoes at most one step and ends with the numbers of a run without
    failures."""
    cut = 0
    for seed in range(40):
        sim = Sim(_cfg(spares=1, max_redo=1), seed, steps=10, step_time=0.005)
        sim.kill_after("mid-node", 1, 5)
        assert sim.run() == "finished", f"seed {seed}\n{_replay(sim)}"
        redone = [f["redone"] for _, e, f in sim.log if e == "resumed"]
        assert len(redone) == 1 and redone[0] <= 1, f"seed {seed}: {redone}\n{_replay(sim)}"
        cut += any(e == "replica_rejected" and f["why"] == p.CUT_OFF for _, e, f in sim.log)
    assert cut > 10, f"only {cut} of 40 kills cut a replica off: the test tests little"


def test_without_tier_1_a_node_lost_after_a_commit_still_stops_the_job() -> None:
    """With tier 1 and 2 off, a node's loss loses steps tier 0 committed: the job stops
    (it does not silently start over)."""
    sim = Sim(_cfg(spares=1, replicas=0), seed=0, steps=6)
    sim.kill_after("node", 1, 3)
    assert "no step can be restored" in sim.run()
    assert not any(e == "started_over" for _, e, _ in sim.log)


# ---------------------------------------------------------------- proof that it can fail


def test_the_seeded_scenarios_catch_the_32a7912_bug_when_its_fix_is_reverted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Proof that the generated suite can fail: with the fix of 32a7912 reverted (an agent
    says ready each time a worker attaches, and the coordinator takes a member that says
    ready again for a spare too), the seeded scenarios find runs that break an invariant.
    The scripted regressions above do the same for a01746a and 312490f."""
    attach, ready = worker_table.WorkerTable.attach, hosts.Hosts.ready

    def attach_and_say_ready_again(self: worker_table.WorkerTable, *a: Any) -> bool:
        self.all_attached = False
        return attach(self, *a)

    def ready_even_if_known(self: hosts.Hosts, host: int, replica: Any) -> bool | None:
        if host in self.node_by_host:
            self.spares.append(host)
            return False
        return ready(self, host, replica)

    monkeypatch.setattr(worker_table.WorkerTable, "attach", attach_and_say_ready_again)
    monkeypatch.setattr(hosts.Hosts, "ready", ready_even_if_known)
    caught = []
    for s in range(min(SCENARIOS, 300)):
        try:
            scenario(s).run()
        except Violation as e:
            caught.append(str(e))
    assert caught, "no scenario caught the reverted fix"
    assert any("both member and spare" in c for c in caught), caught[:3]


# ---------------------------------------------------------------- generated event orders


class ControlPlane(RuleBasedStateMachine):
    """Hypothesis picks the job and the order of failures; shrinking finds the shortest
    sequence that breaks an invariant."""

    sim: Sim

    @initialize(
        nodes=st.integers(2, 4),
        nproc=st.integers(1, 2),
        spares=st.integers(0, 2),
        persist=st.booleans(),
        max_redo=st.sampled_from([0, 1]),
        seed=st.integers(0, 2**16),
    )
    def start(
        self, nodes: int, nproc: int, spares: int, persist: bool, max_redo: int, seed: int
    ) -> None:
        cfg = _cfg(
            nodes=nodes,
            nproc_per_node=nproc,
            spares=spares,
            persist="sim://tier2" if persist else None,
            persist_every=2,
            max_redo=max_redo,
            max_restarts=40,
        )
        self.sim = Sim(cfg, seed=seed, steps=10)

    @rule(seconds=st.floats(0.001, 0.4))
    def time_passes(self, seconds: float) -> None:
        self.sim.run_for(seconds)

    @rule(pick=st.integers(0, 7))
    def a_host_dies(self, pick: int) -> None:
        live = [h for h in self.sim.hosts.values() if h.alive]
        if live:
            live[pick % len(live)].die()

    @rule(pick=st.integers(0, 15))
    def a_worker_dies(self, pick: int) -> None:
        workers = [w for h in self.sim.hosts.values() for w in h.workers.values() if w.alive]
        if workers:
            workers[pick % len(workers)].die(-9)

    @rule(pick=st.integers(0, 7))
    def a_host_freezes(self, pick: int) -> None:
        live = [h for h in self.sim.hosts.values() if h.alive and not h.frozen]
        if live:
            live[pick % len(live)].frozen = True

    @rule(pick=st.integers(0, 7))
    def a_link_is_cut(self, pick: int) -> None:
        live = [h for h in self.sim.hosts.values() if h.alive]
        if live:
            live[pick % len(live)].up.close()

    def teardown(self) -> None:
        sim = getattr(self, "sim", None)
        if sim is None:
            return
        outcome = sim.run(horizon=sim.now + 900)
        assert _explained(outcome), f"stopped for {outcome!r}\n{_replay(sim)}"


ControlPlane.TestCase.settings = settings(
    max_examples=int(os.environ.get("TIERSWAP_SIM_EXAMPLES", "150")),
    # the same examples on every run, so CI is reproducible; TIERSWAP_SIM_RANDOM=1 explores
    derandomize=os.environ.get("TIERSWAP_SIM_RANDOM") != "1",
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_generated_event_orders_keep_every_invariant = ControlPlane.TestCase


def test_a_refused_slot_on_the_last_step_is_retried_and_the_job_finishes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: the first refusal of the last step's slot was reported as a skip,
    which released the other node's hold of that step for good; the retry then got a
    slot, and the two nodes never held the same step again (the job timed out finishing)."""
    from tierswap.control import protocol as p
    from tierswap.control import simworker as simmod
    from tierswap.tiers import memory

    steps, state = 10, {"refused": False, "delayed": False}
    begin = memory.RankRing.begin_write

    def refuse_once(self: memory.RankRing, step: int, alloc: int) -> tuple[int | None, list[int]]:
        if self.rank == 0 and step == steps - 1 and not state["refused"]:  # tier 1 is off
            state["refused"] = True
            return None, []
        return begin(self, step, alloc)

    call = simmod.SimWorker._call

    def slow_last_request(self: simmod.SimWorker, msg: p.Message, gen: int) -> Any:
        last = isinstance(msg, p.SlotRequest) and msg.rank == 0 and msg.step == steps - 1
        if last and not state["delayed"]:
            state["delayed"] = True
            yield 0.2  # rank 0 asks late: node 1 holds the last step already
        return (yield from call(self, msg, gen))

    monkeypatch.setattr(memory.RankRing, "begin_write", refuse_once)
    monkeypatch.setattr(simmod.SimWorker, "_call", slow_last_request)
    for seed in range(5):
        state.update(refused=False, delayed=False)
        sim = Sim(_cfg(replicas=0), seed=seed, steps=steps, step_time=0.05)
        assert sim.run() == "finished"
        assert state["refused"]


@pytest.mark.parametrize("seed", [1538, 1573])
def test_rings_of_3_slots_with_tier_1_on_keep_committing(seed: int) -> None:
    """With 3 tier-0 and 3 tier-1 slots (the defaults since 12-03) these scenarios timed
    out finishing while a ring kept its newest step at any cost: once a rank's newest step
    parted from its node's other ranks' (one of them skipped a snapshot), every slot of
    its ring was protected, it refused every later step, and its node never held a step
    in common again. The newest now gives way when every other slot is kept."""
    sim = scenario(seed, since_12_05=False)
    assert (sim.cfg.slots, sim.cfg.peer_slots) == (3, 3)
    outcome = sim.run()
    assert outcome == "finished", f"seed {seed}: {outcome}\n{_replay(sim)}"


def test_a_launcher_paused_longer_than_the_lease_renews_leases_and_fences_nobody() -> None:
    """Issue 14: the launcher was stopped (SIGSTOP) longer than ``--lease``; on waking it
    blamed every healthy host for the missing heartbeats, fenced them and threw away
    every memory tier. Now it sees the gap in its own ticks and renews the leases."""
    for seed in range(5):
        sim = Sim(_cfg(spares=1), seed=seed, steps=30, step_time=0.05)
        sim.pause_coordinator(at=2.0, seconds=25.0)  # lease 10 s
        assert sim.run() == "finished"
        events = [e for _, e, _ in sim.log]
        assert "coordinator_paused" in events
        assert "failure_detected" not in events, "a host fenced for the launcher's pause"
        assert events.count("generation_started") == 1


def test_chaos_kills_nodes_and_workers_and_the_job_ends_bit_exact() -> None:
    """``--chaos SEED:RATE:COUNT`` in the simulation: ten strikes at random moments, every
    invariant after every event, and the numbers of a run without failures at the end."""
    for seed in range(3):
        cfg = _cfg(spares=1, chaos=f"{seed}:60:10", max_restarts=40, persist="sim://tier2")
        sim = Sim(cfg, seed=seed, steps=400, step_time=0.1)
        assert sim.run(horizon=3000) == "finished"
        strikes = [f["spec"] for _, e, f in sim.log if e == "fault_injected"]
        assert len(strikes) == 10, strikes
        assert {s.split("=")[0] for s in strikes} == {"chaos:kill:node", "chaos:kill:rank"}
