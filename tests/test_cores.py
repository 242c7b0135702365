"""The coordinator's and an agent's cores on hand-built states: each decision and its
reason, with no process, socket or clock (time is an argument)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest

from tierswap.cluster.candidate import job_config
from tierswap.config import Config
from tierswap.control import agent_events as ae
from tierswap.control import commands as cc
from tierswap.control import protocol as p
from tierswap.control.agent import AgentCore
from tierswap.control.commits import TierCommits
from tierswap.control.coordinator import CoordinatorCore
from tierswap.control.simworld import LAYOUT, FakeTier2, MemorySegment
from tierswap.control.states import PHASES, AgentPhase, IllegalTransition, Machine, Phase
from tierswap.control.workers import Spawn, Tell
from tierswap.tiers.memory import NodeRings, SlotState
from tierswap.tiers.replicas import PeerStore


class Coordinator:
    """A coordinator core whose hosts say hello and ready; what it says is kept."""

    def __init__(self, **kw: Any) -> None:
        cfg = Config(**{"nodes": 2, "console": False, **kw})
        self.tier2 = FakeTier2() if cfg.persist else None
        self.core = CoordinatorCore(
            cfg, job_id="t", script=["x.py"], address=("h", 1), store="h:2",
            tier2=self.tier2, now=0.0,
        )  # fmt: skip
        self.out: list[Any] = self.core.handle(cc.Begin(), 0.0)
        self.now = 0.0
        for host in range(cfg.nodes + cfg.spares):
            self.say(host, p.Hello(host=host, pid=100 + host), -1)
            self.say(host, p.Ready(replica=("h", 1000 + host), workers=[]), -1)

    def say(self, host: int, msg: p.Message, gen: int | None = None) -> list[Any]:
        """``host`` (connection ``host + 1``) sends ``msg``; the commands it caused."""
        self.now += 0.01
        g = self.core.generation if gen is None else gen
        event = cc.AgentMessage(host + 1, p.Envelope(g, msg), self.now)
        out = self.core.handle(event, self.now)
        self.out += out
        return out

    def sent(self, kind: type[Any], out: list[Any] | None = None) -> list[Any]:
        """Messages of ``kind`` sent or broadcast, in order."""
        return [c.msg for c in (self.out if out is None else out)
                if isinstance(c, cc.Send | cc.Broadcast) and isinstance(c.msg, kind)]  # fmt: skip

    def logged(self, event: str) -> list[dict[str, Any]]:
        return [c.fields for c in self.out if isinstance(c, cc.Log) and c.event == event]


def test_a_job_whose_slots_are_fewer_than_its_max_redo_needs_is_told_at_the_start() -> None:
    c = Coordinator(max_redo=2, slots=2)
    (short,) = c.logged("slots_short")
    assert short == {"slots": 2, "max_redo": 2}
    said = [x.text for x in c.out if isinstance(x, cc.Say) and "--slots 2 with" in x.text]
    assert said and "give --slots 3 or more" in said[0], said
    assert not Coordinator(max_redo=2).logged("slots_short"), "unset: the ring follows"


def test_a_leader_that_takes_over_runs_the_job_with_the_options_it_was_started_with() -> None:
    """A host launched with other options (``--max-redo 2`` here) that wins the election
    leads with the job's recorded ones, keeps only where it listens, its terminal, its
    directory and its CPU lists, and says which of its own it does not use."""
    c = Coordinator(max_redo=1, persist_every=5, agent_cpus="3")
    rec = c.core.record()
    own = Config(nodes=2, max_redo=2, persist_every=5, bind="10.0.0.2", console=False,
                 run_dir="/r", worker_cpus="0-1")  # fmt: skip
    job, ignored = job_config(own, rec)
    assert job == dataclasses.replace(c.core.cfg, bind="10.0.0.2", run_dir="/r",
                                      agent_cpus=None, worker_cpus="0-1")  # fmt: skip
    assert ignored == ["max_redo"] and job.tier0_slots == c.core.cfg.tier0_slots
    assert job_config(own, None) == (own, []), "a first leader: its own launch's"
    unset = dataclasses.replace(own, run_dir=None, init_from="ckpt")
    old = {**rec, "config": {**rec["config"], "TIERSWAP_RUN_DIR": "/old",
                             "TIERSWAP_INIT_FROM": os.path.abspath("ckpt")}}  # fmt: skip
    job2, ignored2 = job_config(unset, old)
    assert job2.run_dir is None, "its own unset --run-dir, not the old leader's folder"
    assert ignored2 == ["max_redo"], "a relative --init-from is compared as it was recorded"
    older = {k: v for k, v in rec.items() if k != "config"}
    assert job_config(own, older) == (own, []), "a record without them: its own"
    core = CoordinatorCore(job, job_id="t", script=["x.py"], address=("h", 1), store="h:2",
                           tier2=None, now=0.0)  # fmt: skip
    out = core.handle(cc.TakeOver(rec, 0, tuple(ignored)), 0.0)
    logs = [x for x in out if isinstance(x, cc.Log)]
    (took,) = [x.fields for x in logs if x.event == "coordinator_took_over"]
    assert took["ignored"] == ["max_redo"] and core.cfg.max_redo == 1
    assert any(isinstance(x, cc.Say) and "--max-redo otherwise" in x.text for x in out), out


# ---------------------------------------------------------------- commits


def test_a_step_commits_when_every_node_holds_it_and_not_before() -> None:
    c = Coordinator()
    assert len(c.sent(p.Start)) == 2 and c.core.generation == 0
    assert not c.sent(p.Committed, c.say(0, p.Held(tier=0, step=0)))
    (commit,) = c.sent(p.Committed, c.say(1, p.Held(tier=0, step=0)))
    assert commit == p.Committed(tier=0, step=0)
    assert c.logged("snapshot_committed") == [{"tier": 0, "step": 0}]
    assert not c.sent(p.Committed, c.say(1, p.Held(tier=0, step=0))), "a repeat changes nothing"


def test_nodes_holding_different_steps_release_the_older_one() -> None:
    c = Coordinator()
    c.say(0, p.Held(tier=1, step=4))
    out = c.say(1, p.Held(tier=1, step=5))  # node 1 passed 4 (it skipped it, say)
    assert c.sent(p.Release, out) == [p.Release(tier=1, step=4)]
    assert c.sent(p.Settled, out) == [p.Settled(step=4)], "tier 1 is done with 4"
    assert [s.conn for s in out if isinstance(s, cc.Send)] == [1], "only node 0 holds 4"
    (commit,) = c.sent(p.Committed, c.say(0, p.Held(tier=1, step=5)))
    assert commit == p.Committed(tier=1, step=5)


def test_a_job_of_3_nodes_keeps_tier_1_as_parity_by_default_and_of_2_as_copies() -> None:
    """Unset ``--peer-parity`` is parity over groups of 3 from 3 nodes on: every node is
    told the parities it holds and none holds a rank's copy; on 2 nodes, copies."""
    three = Coordinator(nodes=3)
    starts = three.sent(p.Start)
    assert starts and all(s.parity and all(k < 0 for k in s.parity) for s in starts), starts
    assert all(set(s.protects) == set(s.parity) for s in starts)
    two = Coordinator(nodes=2)
    assert [s.parity for s in two.sent(p.Start)] == [{}, {}]
    assert sorted(r for s in two.sent(p.Start) for r in s.protects) == [0, 1]


def test_a_skipped_snapshot_releases_holds_of_that_step_only() -> None:
    c = Coordinator(nodes=3)
    c.say(0, p.Held(tier=0, step=3))
    c.say(1, p.Held(tier=0, step=4))
    out = c.say(2, p.Skipped(rank=2, step=4))
    assert c.sent(p.Release, out) == [p.Release(tier=0, step=4)], "3 may still commit"
    assert c.sent(p.Settled, out) == [p.Settled(step=4)]


def test_tier_commits_never_count_a_lost_voter() -> None:
    t = TierCommits(0)
    t.reset(-1, voters={0, 1})
    assert t.held(0, 2).committed is None
    t.lost(1)
    assert t.held(0, 3).committed is None and t.broken, "node 1's ranks lost their tier 0"
    t.reset(2, voters={0, 1})
    assert t.held(0, 2).committed is None, "not newer than the commit"
    assert t.held(0, 3).committed is None and t.held(1, 3).committed == 3


def _tick(c: Coordinator, seconds: float) -> list[Any]:
    """Time passes, ticked as the coordinator's loop ticks (every half heartbeat at most)."""
    out: list[Any] = []
    while seconds > 0:
        step = min(seconds, 0.25)
        c.now, seconds = c.now + step, seconds - step
        heard = {conn: c.now for conn in c.core.hosts.conns.values()}
        out += c.core.handle(cc.Tick(heard), c.now)
    c.out += out
    return out


def test_a_replica_cut_off_is_given_up_a_heartbeat_later_unless_its_node_is_lost_first() -> None:
    """A transfer that broke off between two nodes most often means one of them is dying.
    Settling its step at once let the survivor's next optimizer step go on, and the node's
    loss, seen a moment later, cost two steps with ``--max-redo 1``. The step is given up
    one heartbeat later, and not at all once the loss ended the generation; a refusal for
    any other reason (a full ring, an encoding that failed) is given up at once."""
    c = Coordinator(spares=1)
    beat = c.core.cfg.heartbeat
    out = c.say(0, p.ReplicaRejected(rank=1, step=4, why=p.CUT_OFF))
    out += c.say(1, p.ReplicateFailed(rank=1, step=4, peer=0, error="EOFError", cut=True))
    out += _tick(c, 0.5 * beat)
    assert not c.sent(p.Settled, out), "given up before the sender could be found dead"
    out = _tick(c, beat)
    assert c.sent(p.Settled, out) == [p.Settled(step=4)], "nobody died: given up now"
    assert c.logged("tier1_given_up") == [{"step": 4, "generation": 0}]
    assert not c.sent(p.Settled, _tick(c, beat)), "once"
    out = c.say(0, p.ReplicaRejected(rank=1, step=5, why="no free slot"))
    assert c.sent(p.Settled, out) == [p.Settled(step=5)]
    out = c.say(1, p.ReplicateFailed(rank=1, step=6, peer=0, error="MemoryError()"))
    assert c.sent(p.Settled, out) == [p.Settled(step=6)]

    c.say(0, p.ReplicaRejected(rank=1, step=7, why=f"parity not made: {p.CUT_OFF}"))
    c.now += 1.1 * beat  # a loop held up: the connection's loss waits behind a late tick
    assert not c.sent(p.Settled, _tick(c, 0.1)), "a late tick gives nothing up"
    out = _fail_node(c, 1)
    assert c.sent(p.Stop, out)
    c.say(0, p.Stopped(verified=None, holdings={0: {}}, peer={}, peer_deltas={}))
    assert c.core.generation == 1 and c.core.phase == Phase.RUNNING
    out = _tick(c, 2 * beat)
    assert not c.sent(p.Settled, out), "the loss came first: step 7 is not given up"
    assert len(c.logged("tier1_given_up")) == 1 and not c.core.doubted


# ---------------------------------------------------------------- generations


def _fail_node(c: Coordinator, node: int) -> list[Any]:
    c.now += 0.01
    out = c.core.handle(cc.AgentClosed(node + 1), c.now)
    c.out += out
    return out


def test_chaos_strikes_again_only_once_the_last_strike_was_found_and_recovered_from() -> None:
    """12-06: a dying generation's last progress report let ``--chaos`` strike the next
    generation before its first step; both nodes of a 2-node job were then lost in one
    recovery, which went back to tier 2 and redid 9 steps."""
    c = Coordinator(spares=1, chaos="7:6000000")  # a strike at every chance

    def strikes() -> int:
        return len(c.logged("fault_injected"))

    c.say(0, p.Progress(step=3, stall=None))
    _tick(c, 0.1)
    assert strikes() == 1
    c.say(0, p.Progress(step=4, stall=None))  # reported as the strike landed
    _tick(c, 0.1)
    assert strikes() == 1, "the strike is not found yet"
    _fail_node(c, 1)
    c.say(0, p.Stopped(verified=None, holdings={0: {}}, peer={}, peer_deltas={}))
    assert c.core.generation == 1 and c.core.phase == Phase.RUNNING
    c.say(0, p.Progress(step=5, stall=None))
    _tick(c, 0.1)
    assert strikes() == 1, "its recovery has not made a step yet"
    for rank, host in ((0, 0), (1, 2)):
        c.say(host, p.Joined(rank=rank, pid=500 + rank, seconds=0.0))
    for rank, host in ((0, 0), (1, 2)):
        c.say(host, p.Stepped(rank=rank, step=0))
    assert len(c.logged("resumed")) == 1
    _tick(c, 0.1)
    assert strikes() == 2, "training goes on"


def test_training_that_keeps_waiting_for_tier_1_is_told_why_once_while_it_lasts() -> None:
    """12-06: with the agents of a 2-core machine pinned to one core, the trainers waited
    for tier 1 16 % of every step and nothing said so but the stall of the progress line."""
    c = Coordinator()

    def steps(first: int, gates: list[float]) -> None:
        for i, gate in enumerate(gates):
            c.now += 0.98  # (say adds 0.01: a step a second)
            c.say(0, p.Progress(step=first + i, stall=gate, gate=gate))
            c.say(1, p.Progress(step=first + i, stall=None))  # another node's: no wait

    def said() -> list[str]:
        return [x.text for x in c.out if isinstance(x, cc.Say) and "tier 1" in x.text]

    steps(0, [0.01, 0.01, 5.0] + [0.01] * 9)  # a generation's first replica makes slots
    assert not c.logged("tier1_behind"), "one long wait is no lasting lack of CPU"
    steps(12, [0.2] * 5)
    assert not c.logged("tier1_behind"), "5 of the last 10 steps: not most of them"
    steps(17, [0.2])
    (behind,) = c.logged("tier1_behind")
    assert behind["share"] == pytest.approx(0.2, abs=0.01) and behind["step"] == 17
    (text,) = said()
    assert "(--agent-cpus)" in text and "--max-redo 2 --slots 3 --peer-slots 3" in text, text
    steps(18, [0.2] * 12 + [0.04] * 12)
    assert len(said()) == 1, "said once while it lasts, and 4 % is not below half of 5 %"
    steps(42, [0.0] * 12 + [0.2] * 12)
    assert len(said()) == 2 and len(c.logged("tier1_behind")) == 2, "it came back"
    c.core.multihost = True  # each host pins by its own line: no one list to name
    steps(66, [0.0] * 12 + [0.2] * 12)
    assert "more CPUs on each host (its --agent-cpus)" in said()[-1], said()[-1]


def test_tier_1_lag_weighs_each_generation_s_steps_apart() -> None:
    """A new generation's first steps are not weighed with the last one's."""
    from tierswap.control.progress import LAG_STEPS, Tier1Lag

    lag = Tier1Lag()
    for i in range(LAG_STEPS):
        assert lag.add(0, float(i), 0.5) is None
    assert lag.add(1, float(LAG_STEPS), 0.5) is None, "a new generation's first step"
    for i in range(LAG_STEPS - 1):
        assert lag.add(1, LAG_STEPS + 1.0 + i, 0.5) is None
    assert lag.add(1, 2.0 * LAG_STEPS, 0.5) == pytest.approx(0.5)


def test_tier_1_waits_of_a_commit_s_round_trip_are_not_said_whatever_their_share() -> None:
    """Steps of a millisecond wait a commit's round trip for tier 1, a large share of
    them: no CPUs or bandwidth would shorten it, so it is no advice to give."""
    from tierswap.control.progress import LAG_MIN_S, LAG_STEPS, Tier1Lag

    small, large = Tier1Lag(), Tier1Lag()
    for i in range(LAG_STEPS + 1):
        assert small.add(0, 0.002 * i, LAG_MIN_S / 2) is None  # half of each 2 ms step
        said = large.add(0, 0.2 * i, 3 * LAG_MIN_S)  # 7.5 % of each 200 ms step
    assert said == pytest.approx(0.075)


def test_a_message_of_an_ended_generation_is_dropped_at_the_door_and_counted() -> None:
    """790919f: a "never" of an abandoned timeline released the next generation's waits."""
    c = Coordinator(spares=1)
    assert c.sent(p.Stop, _fail_node(c, 1))
    c.say(0, p.Stopped(verified=None, holdings={0: {}}, peer={}, peer_deltas={}))
    assert c.core.generation == 1 and c.core.phase == Phase.RUNNING
    out = c.say(0, p.ReplicaRejected(rank=1, step=9, why="late"), gen=0)
    out += c.say(0, p.Held(tier=0, step=9), gen=0)
    assert not c.sent(p.Settled, out) and not c.sent(p.Release, out)
    assert c.core.door.dropped == {"replica_rejected": 1, "held": 1}


def test_a_second_ready_does_not_make_a_member_a_spare() -> None:
    """32a7912: a replaced worker made its agent say ready again."""
    c = Coordinator(spares=1)
    c.say(1, p.Ready(replica=("h", 1001), workers=[]), -1)
    assert c.core.hosts.spares == [2] and c.core.hosts.members == {0: 0, 1: 1}
    _fail_node(c, 1)
    c.say(0, p.Stopped(verified=None, holdings={}, peer={}, peer_deltas={}))
    assert c.logged("spare_assigned")[0]["host"] == 2, "the real spare takes node 1"


def test_a_finished_while_a_generation_is_torn_down_is_ignored() -> None:
    c = Coordinator()
    _fail_node(c, 1)
    c.say(0, p.Finished(rank=0, step=9))
    assert c.core.finished == set() and c.core.phase == Phase.RECOVERING


def test_a_first_host_lost_while_starting_is_replaced() -> None:
    cfg = Config(nodes=2, console=False)
    core = CoordinatorCore(cfg, job_id="t", script=["x.py"], address=("h", 1), store="h:2",
                           tier2=None, now=0.0)  # fmt: skip
    out = core.handle(cc.Begin(), 0.0)
    assert [x.host for x in out if isinstance(x, cc.StartHost)] == [0, 1]
    core.handle(cc.AgentMessage(1, p.Envelope(-1, p.Hello(host=0, pid=1)), 0.1), 0.1)
    out = core.handle(cc.AgentClosed(1), 0.2)  # host 0 dies before it is ready
    assert cc.KillHost(0) in out
    assert [x.host for x in out if isinstance(x, cc.StartHost)] == [2], "another host for node 0"
    assert core.hosts.vacant == {0} and core.hosts.waiting == {1}


def test_a_job_that_waits_too_long_stops_and_says_for_what() -> None:
    c = Coordinator(spares=0, revive=False, join_timeout=5)
    _fail_node(c, 1)
    c.say(0, p.Stopped(verified=None, holdings={}, peer={}, peer_deltas={}))
    out: list[Any] = []
    for i in range(13):  # ticks every half second, as the shell gives them
        out += c.core.handle(cc.Tick(), c.now + 0.5 * (i + 1))
    (end,) = [x for x in out if isinstance(x, cc.End)]
    assert end.code == 1 and "no spare left" in str(end.reason)


# ---------------------------------------------------------------- tier 2


def test_commit_is_written_last_once_every_part_is_in() -> None:
    c = Coordinator(persist="sim://t2", persist_every=2)
    for host in (0, 1):
        c.say(host, p.Held(tier=0, step=0))
    (persist,) = c.sent(p.Persist)
    assert persist.step == 0 and persist.world_size == 2
    part = c.tier2.write_part(0, 0, b"x" * 8)  # type: ignore[union-attr]
    c.say(0, p.Parts(token=persist.token, step=0, parts=[part], errors={}))
    assert 0 not in c.tier2.commits  # type: ignore[union-attr]
    other = c.tier2.write_part(0, 1, b"y" * 8)  # type: ignore[union-attr]
    c.say(1, p.Parts(token=persist.token, step=0, parts=[other], errors={}))
    assert c.tier2.commits[0][0] == 2  # type: ignore[union-attr]
    assert {"tier": 2, "step": 0, "deleted": []} in c.logged("snapshot_committed")


def test_a_failing_tier2_is_reported_and_training_goes_on() -> None:
    c = Coordinator(persist="sim://t2")
    assert c.tier2 is not None
    c.tier2.fail = True
    for host in (0, 1):
        c.say(host, p.Held(tier=0, step=0))
    (persist,) = c.sent(p.Persist)
    c.say(0, p.Parts(token=persist.token, step=0, parts=[], errors={0: "disk full"}))
    c.say(1, p.Parts(token=persist.token, step=0, parts=[], errors={1: "disk full"}))
    assert "rank 0: disk full" in c.logged("durability_failing")[0]["reason"]
    assert c.core.phase == Phase.RUNNING and not c.tier2.commits


# ---------------------------------------------------------------- shrink and grow


def _persisted(c: Coordinator, step: int, hosts: list[int]) -> p.Persist:
    """Tier 0 commits ``step`` on ``hosts``; their parts are written; the Persist asked."""
    before = len(c.sent(p.Persist))
    for host in hosts:
        c.say(host, p.Held(tier=0, step=step))
    persist = c.sent(p.Persist)[before]
    assert c.tier2 is not None and persist.step == step
    for host in hosts:
        node = c.core.hosts.node_of(host)
        assert node is not None
        ranks = range(node * 1, node * 1 + 1)
        parts = [c.tier2.write_part(step, r, b"x" * 8) for r in ranks]
        c.say(host, p.Parts(token=persist.token, step=step, parts=parts, errors={}))
    return persist


def test_shrink_goes_on_from_tier2_and_grows_back_when_a_host_joins() -> None:
    c = Coordinator(nodes=3, persist="sim://t2", on_no_spare="shrink", revive=False)
    assert c.tier2 is not None
    _persisted(c, 0, [0, 1, 2])
    assert c.tier2.commits[0][0] == 3
    _fail_node(c, 1)
    before = len(c.sent(p.Start))
    for host in (0, 2):
        c.say(host, p.Stopped(verified=None, holdings={}, peer={}, peer_deltas={}))
    starts = c.sent(p.Start)[before:]
    assert [(s.node, s.ranks, s.world_size) for s in starts] == [(0, [0], 2), (1, [1], 2)]
    assert {s.init for s in starts} == {p.InitFrom(path="sim://tier2", step=0, world_size=3)}
    (shrank,) = c.logged("shrank")
    assert (shrank["nodes"], shrank["from_world_size"], shrank["step"]) == (2, 3, 0)
    assert shrank["renumbered"] == {"2": 1} and c.core.hosts.members == {0: 0, 1: 2}
    assert c.core.restarts == 1

    c.say(3, p.Hello(host=-1, pid=103, spare=True), -1)  # a host joins while it runs shrunk
    c.say(3, p.Ready(replica=("h", 1003), workers=[]), -1)
    assert c.logged("grow_pending") and not c.logged("growing")
    persist = _persisted(c, 1, [0, 2])  # asked at once, whatever --persist-every says
    assert persist.world_size == 2 and c.tier2.commits[1][0] == 2
    (growing,) = c.logged("growing")
    assert (growing["nodes"], growing["step"]) == (3, 1) and c.sent(p.Stop)[-1] == p.Stop(verify=[])
    before = len(c.sent(p.Start))
    for host in (0, 2):
        c.say(host, p.Stopped(verified=None, holdings={0: {1: "c"}}, peer={}, peer_deltas={}))
    starts = c.sent(p.Start)[before:]
    assert [(s.node, s.world_size) for s in starts] == [(0, 3), (1, 3), (2, 3)]
    assert {s.init for s in starts} == {p.InitFrom(path="sim://tier2", step=1, world_size=2)}
    assert c.core.hosts.members == {0: 0, 1: 2, 2: 3} and c.core.restarts == 1
    assert c.core.durable_steps() == frozenset(), "the 3-rank step 0 is superseded"


def test_shrink_first_writes_the_newest_step_memory_holds_lost_ranks_from_replicas() -> None:
    c = Coordinator(nodes=3, persist="sim://t2", on_no_spare="shrink", revive=False)
    assert c.tier2 is not None
    _persisted(c, 0, [0, 1, 2])
    _fail_node(c, 1)
    c.say(
        0,
        p.Stopped(
            verified=None, holdings={0: {0: "a", 5: "b"}}, peer={2: {5: "c"}}, peer_deltas={}
        ),
    )
    c.say(2, p.Stopped(verified=None, holdings={2: {5: "d"}}, peer={1: {5: "e"}}, peer_deltas={}))
    (persist,) = c.sent(p.Persist)[-1:]
    assert (persist.step, persist.world_size, persist.replicas) == (5, 3, {1: 2})
    assert not c.logged("shrank"), "it shrinks once step 5 is in tier 2"
    parts = {r: c.tier2.write_part(5, r, b"x" * 8) for r in range(3)}
    c.say(0, p.Parts(token=persist.token, step=5, parts=[parts[0]], errors={}))
    c.say(2, p.Parts(token=persist.token, step=5, parts=[parts[1], parts[2]], errors={}))
    assert c.tier2.commits[5][0] == 3
    (shrank,) = c.logged("shrank")
    assert shrank["step"] == 5
    starts = c.sent(p.Start)[-2:]
    assert {s.init for s in starts} == {p.InitFrom(path="sim://tier2", step=5, world_size=3)}


def test_a_failed_salvage_shrinks_from_the_older_tier2_step() -> None:
    c = Coordinator(nodes=3, persist="sim://t2", on_no_spare="shrink", revive=False)
    assert c.tier2 is not None
    _persisted(c, 0, [0, 1, 2])
    _fail_node(c, 1)
    c.say(0, p.Stopped(verified=None, holdings={0: {5: "b"}}, peer={}, peer_deltas={}))
    c.say(2, p.Stopped(verified=None, holdings={2: {5: "d"}}, peer={1: {5: "e"}}, peer_deltas={}))
    (persist,) = c.sent(p.Persist)[-1:]
    c.say(0, p.Parts(token=persist.token, step=5, parts=[], errors={0: "disk gone"}))
    c.say(2, p.Parts(token=persist.token, step=5, parts=[], errors={1: "x", 2: "y"}))
    (shrank,) = c.logged("shrank")
    assert shrank["step"] == 0 and 5 not in c.tier2.commits


def test_a_shrunk_job_with_no_host_joining_finishes_on_the_nodes_it_has() -> None:
    c = Coordinator(nodes=3, persist="sim://t2", on_no_spare="shrink", revive=False)
    assert c.tier2 is not None
    c.say(0, p.Report(rank=0, step=-1, total=4))
    _persisted(c, 0, [0, 1, 2])
    _fail_node(c, 1)
    for host in (0, 2):
        c.say(host, p.Stopped(verified=None, holdings={}, peer={}, peer_deltas={}))
    assert c.core.world_size == 2 and c.logged("shrank")
    answered = len(c.sent(p.Persist))
    for step in (1, 2, 3):
        for host in (0, 2):
            c.say(host, p.Held(tier=0, step=step))
        if step == 3:
            for rank, host in ((0, 0), (1, 2)):
                c.say(host, p.Finished(rank=rank, step=3))
        for persist in c.sent(p.Persist)[answered:]:  # each write asked, at 2 ranks
            answered += 1
            assert persist.world_size == 2
            for rank, host in ((0, 0), (1, 2)):
                part = c.tier2.write_part(persist.step, rank, b"x" * 8)
                c.say(host, p.Parts(token=persist.token, step=persist.step, parts=[part],
                                    errors={}))  # fmt: skip
    assert c.core.phase == Phase.DONE and c.tier2.commits[3][0] == 2
    assert c.logged("job_finished")[0]["restarts"] == 1


def _salvage_pending(spares: int = 0) -> Coordinator:
    """3 nodes, step 0 in tier 2, node 1 lost; step 5 is being written before a shrink."""
    c = Coordinator(nodes=3, persist="sim://t2", on_no_spare="shrink", revive=False)
    _persisted(c, 0, [0, 1, 2])
    _fail_node(c, 1)
    c.say(0, p.Stopped(verified=None, holdings={0: {5: "b"}}, peer={}, peer_deltas={}))
    c.say(2, p.Stopped(verified=None, holdings={2: {5: "d"}}, peer={1: {5: "e"}}, peer_deltas={}))
    assert c.core.salvage == 5
    return c


def test_a_spare_parking_while_the_step_is_written_takes_the_node_after_it() -> None:
    c = _salvage_pending()
    before = len(c.sent(p.Start))
    c.say(3, p.Hello(host=-1, pid=103, spare=True), -1)
    c.say(3, p.Ready(replica=("h", 1003), workers=[]), -1)
    assert len(c.sent(p.Start)) == before, "no generation while step 5 is written"
    assert c.tier2 is not None
    (persist,) = c.sent(p.Persist)[-1:]
    parts = {r: c.tier2.write_part(5, r, b"x" * 8) for r in range(3)}
    c.say(0, p.Parts(token=persist.token, step=5, parts=[parts[0]], errors={}))
    c.say(2, p.Parts(token=persist.token, step=5, parts=[parts[1], parts[2]], errors={}))
    starts = c.sent(p.Start)[before:]
    assert [(s.node, s.world_size) for s in starts] == [(0, 3), (1, 3), (2, 3)]
    assert not c.logged("shrank") and c.logged("spare_assigned")[-1]["host"] == 3
    assert {s.restart_step for s in starts} == {5}, "a hot-swap from memory, at full size"


def test_tier2_lost_while_the_step_is_written_waits_instead() -> None:
    c = _salvage_pending()
    c.out += c.core.handle(cc.DurableLost(why="another job took the root"), c.now + 0.01)
    assert c.core.salvage is None and not c.logged("shrank")
    # tier 2 is not the job's any more: nothing to go on from, so it waits and says why
    (refused,) = c.logged("shrink_refused")
    assert "another job took the root" in refused["reason"] and c.logged("waiting_for_node")
    assert c.core.phase == Phase.RECOVERING


def test_shrink_from_the_last_step_finishes_at_once() -> None:
    c = Coordinator(
        nodes=2, persist="sim://t2", persist_every=1, on_no_spare="shrink", revive=False
    )
    c.say(0, p.Report(rank=0, step=-1, total=4))
    for step in range(4):
        _persisted(c, step, [0, 1])  # every step trained and in tier 2
    _fail_node(c, 1)  # before the Finished came
    c.say(0, p.Stopped(verified=None, holdings={0: {3: "a"}}, peer={1: {3: "b"}}, peer_deltas={}))
    (shrank,) = c.logged("shrank")
    assert shrank["step"] == 3 and c.core.phase == Phase.RUNNING
    c.say(0, p.Finished(rank=0, step=3))  # its worker trains no step past 3
    assert c.core.phase == Phase.DONE and c.logged("job_finished")


def test_shrink_with_nothing_in_tier2_waits_and_says_why() -> None:
    c = Coordinator(nodes=3, persist="sim://t2", on_no_spare="shrink", revive=False)
    _fail_node(c, 2)
    for host in (0, 1):
        c.say(host, p.Stopped(verified=None, holdings={}, peer={}, peer_deltas={}))
    (refused,) = c.logged("shrink_refused")
    assert "holds no step yet" in refused["reason"] and c.logged("waiting_for_node")
    assert c.core.phase == Phase.RECOVERING and c.core.nodes == 3


def test_shrink_needs_a_tier2() -> None:
    with pytest.raises(ValueError, match="shrink needs --persist"):
        Config(nodes=2, on_no_spare="shrink")


# ---------------------------------------------------------------- state machines


def test_an_illegal_transition_names_both_states() -> None:
    m = Machine("coordinator", Phase.DONE, PHASES)
    with pytest.raises(IllegalTransition, match="coordinator: no transition from done to running"):
        m.move(Phase.RUNNING)


# ---------------------------------------------------------------- an agent's core


class Agent:
    def __init__(self, nproc: int = 1, **kw: Any) -> None:
        cfg = Config(nodes=2, nproc_per_node=nproc, console=False, **kw)
        segs: dict[str, MemorySegment] = {}
        self.segs = segs
        rings = NodeRings("t", cfg.tier0_slots, create=lambda n, s: MemorySegment(n, s, segs))
        peers = PeerStore("t", cfg.peer_slots, 0, lambda m, g: None,
                          create=lambda n, s: MemorySegment(n, s, segs))  # fmt: skip
        self.core = AgentCore(0, cfg, rings=rings, peers=peers, replica_address=("h", 9),
                              coord_host="h")  # fmt: skip
        self.out = self.core.handle(ae.Boot(), 0.0)
        self.spawned = [c for c in self.out if isinstance(c, Spawn)]
        for i, s in enumerate(self.spawned):
            self.worker(10 + i, p.Attach(local=s.local, incarnation=s.incarnation, pid=500 + i), -1)

    def worker(self, conn: int, msg: p.Message, gen: int | None = None) -> list[Any]:
        g = self.core.generation if gen is None else gen
        out = self.core.handle(ae.FromWorker(conn, p.Envelope(g, msg), 0.0), 0.0)
        self.out += out
        return self.made(out)

    def made(self, out: list[Any]) -> list[Any]:
        """What a shell does at once with ``MakeSegment``: the slot, made, back in."""
        for c in [c for c in out if isinstance(c, ae.MakeSegment)]:
            seg = MemorySegment(c.name, c.nbytes, self.segs)
            out += self.core.handle(ae.SegmentMade(c.tier, c.rank, c.alloc, c.index, seg), 0.0)
        return out

    def coordinator(self, msg: p.Message, gen: int) -> list[Any]:
        out = self.core.handle(ae.FromCoordinator(p.Envelope(gen, msg)), 0.0)
        self.out += out
        return out

    def start(self, gen: int, restart: int = -1) -> list[Any]:
        ranks = list(range(self.core.cfg.nproc_per_node))
        start = p.Start(
            node=0, world_size=2 * len(ranks), ranks=ranks, store="h:2", backend="gloo",
            plans={r: p.RankPlan(step=None) for r in ranks}, inject=[], restart_step=restart,
            committed=(-1, -1), max_redo=1, placement={r: [1] for r in ranks}, protects=[],
            peers={1: ("h", 8)},
        )  # fmt: skip
        return self.coordinator(start, gen)

    def to_coordinator(self, out: list[Any] | None = None) -> list[p.Message]:
        return [
            c.msg for c in (self.out if out is None else out) if isinstance(c, ae.ToCoordinator)
        ]


def test_the_agent_says_ready_once_when_its_first_workers_attached() -> None:
    a = Agent(nproc=2)
    assert [type(m) for m in a.to_coordinator()] == [p.Ready]


def test_a_finished_that_arrives_after_a_stop_lets_the_node_report_stopped() -> None:
    """32a7912: rank 0's "finished" reached its agent after the stop; the node never
    reported stopped, and the next generation hung."""
    a = Agent()
    a.start(0)
    a.coordinator(p.Stop(), 0)
    assert not [m for m in a.to_coordinator() if isinstance(m, p.Stopped)]
    out = a.worker(1, p.Finished(rank=0, step=5))
    assert isinstance(a.to_coordinator(out)[-1], p.Stopped)


def test_a_request_of_an_ended_generation_is_answered_with_an_error() -> None:
    a = Agent()
    a.start(0)
    a.coordinator(p.Stop(), 0)
    a.worker(10, p.Parked(generation=0, rank=0, reason="ended", why="told to"))
    a.start(1)
    out = a.worker(1, p.SlotRequest(rank=0, step=3, alloc=1), gen=0)
    (reply,) = [c for c in out if isinstance(c, ae.Reply)]
    assert reply.msg == p.Error(message="generation 0 has ended")
    assert a.core.door.dropped == {"slot": 1}


def test_the_agent_holds_one_step_at_a_time_and_the_newest_after_a_commit() -> None:
    a = Agent()
    a.start(0)
    (alloc,) = [
        c.msg for c in a.worker(1, p.Alloc(rank=0, layout=LAYOUT)) if isinstance(c, ae.Reply)
    ]
    assert isinstance(alloc, p.Allocated)
    for step in (0, 1):
        grant = next(c.msg for c in a.worker(1, p.SlotRequest(rank=0, step=step, alloc=alloc.alloc))
                     if isinstance(c, ae.Reply))  # fmt: skip
        out = a.worker(1, p.Written(rank=0, step=step, slot=grant.slot, alloc=alloc.alloc,
                                    tree={}, stall=0.0))  # fmt: skip
        (check,) = [c for c in out if isinstance(c, ae.Checksum)]
        out = a.core.handle(ae.Checked(0, step, check.slot, f"c{step}"), 0.0)
        held = [m for m in a.to_coordinator(out) if isinstance(m, p.Held)]
        assert held == ([p.Held(tier=0, step=0)] if step == 0 else []), "one held at a time"
    out = a.coordinator(p.Committed(tier=0, step=0), 0)
    assert [m for m in a.to_coordinator(out) if isinstance(m, p.Held)] == [p.Held(tier=0, step=1)]
    assert [c for c in out if isinstance(c, Tell)] == []


def test_a_newest_step_written_over_is_reported_as_never_held() -> None:
    """A ring of 3 whose every other slot is kept lets its newest step give way to the
    next; the node will then never hold that step, and says so (``skipped``), or another
    node holding it for a commit would wait on this one for the rest of the generation."""
    a = Agent(slots=3, peer_slots=3)  # a ring of 3 (the defaults before 12-05)
    a.start(0)
    (alloc,) = [
        c.msg for c in a.worker(1, p.Alloc(rank=0, layout=LAYOUT)) if isinstance(c, ae.Reply)
    ]
    assert isinstance(alloc, p.Allocated) and a.core.cfg.tier0_slots == 3
    told: list[p.Message] = []
    for step in range(4):
        out = a.worker(1, p.SlotRequest(rank=0, step=step, alloc=alloc.alloc))
        grant = next(c.msg for c in out if isinstance(c, ae.Reply))
        told += a.to_coordinator(out)
        assert isinstance(grant, p.SlotGranted) and grant.slot is not None
        out = a.worker(1, p.Written(rank=0, step=step, slot=grant.slot, alloc=alloc.alloc,
                                    tree={}, stall=0.0))  # fmt: skip
        (check,) = [c for c in out if isinstance(c, ae.Checksum)]
        told += a.to_coordinator(a.core.handle(ae.Checked(0, step, check.slot, f"c{step}"), 0.0))
        if step == 1:  # 0 committed, 1 held for the next commit: 2 will be the newest only
            told += a.to_coordinator(a.coordinator(p.Committed(tier=0, step=0), 0))
    assert [m for m in told if isinstance(m, p.Held)] == [p.Held(tier=0, step=0),
                                                          p.Held(tier=0, step=1)]  # fmt: skip
    assert [m for m in told if isinstance(m, p.Skipped)] == [p.Skipped(rank=0, step=2)]
    assert sorted(a.core.rings[0].held()) == [0, 1, 3]


def test_a_replica_arriving_after_the_node_reported_its_holdings_leaves_them_as_reported() -> None:
    """A fenced sender's replica that lands between a node's ``stopped`` and the next start
    would take the room of a step the coordinator plans a restore from (a ring of 3 lets
    its newest give way): it is refused, the holdings stay as reported, and the next
    generation takes replicas again."""
    a = Agent(slots=3, peer_slots=3)  # a ring of 3 (the defaults before 12-05)
    a.start(0)
    peers = a.core.peers
    peers.later = False  # the ring's slots made at once (the replica server is not here)
    from tierswap.checksum import checksum_chunks

    def send(step: int, gen: int) -> bool:
        got = peers.slot(5, step, LAYOUT, generation=gen)
        if got is None or isinstance(got, str):
            return False
        token, buf = got
        buf[: LAYOUT.nbytes] = bytes([step]) * LAYOUT.nbytes
        checksum = checksum_chunks(LAYOUT.chunks(buf))  # re-read at the stop: a real one
        peers.written(5, token, True, step, LAYOUT, {}, checksum, generation=gen)
        return True

    assert all(send(step, 0) for step in range(3))
    peers.committed(0)
    assert peers.propose(1, ranks=[5])
    a.coordinator(p.Stop(), 0)
    a.worker(10, p.Parked(generation=0, rank=0, reason="ended", why="told to"))
    (stopped,) = [m for m in a.to_coordinator() if isinstance(m, p.Stopped)]
    assert sorted(stopped.peer[5]) == [0, 1, 2]
    reports: list[p.Message] = []
    peers.report = lambda m, g: reports.append(m)
    assert not send(3, 0), "step 2, reported, would have given way to it"
    assert sorted(peers.holdings()[5]) == [0, 1, 2]
    assert [type(m) for m in reports] == [p.ReplicaRejected]
    assert "reported its holdings" in reports[0].why  # type: ignore[attr-defined]
    a.start(1, restart=2)
    assert send(3, 1), "the next generation takes replicas again"


def test_parked_workers_are_told_what_to_hold_ready_for_a_restore() -> None:
    """A restore reads into memory a parked worker made ahead: the node's spare worker is
    told the largest rank state once the node knows it, and the node's tier-0 slots to
    map as each is made; a survivor when it parks; with --no-warm-spares nobody."""

    def reserves(out: list[Any]) -> list[tuple[int, int, tuple[str, ...]]]:
        return [(c.conn, c.msg.nbytes, c.msg.slots) for c in out if isinstance(c, Tell)
                and isinstance(c.msg, p.Reserve)]  # fmt: skip

    a = Agent(nproc=1, spare_workers=1)
    a.start(0)
    assert not reserves(a.out), "no rank's size is known yet"
    (assigned,) = [w for w in a.core.workers.procs.values() if w.rank == 0]
    (spare,) = [w for w in a.core.workers.procs.values() if w.rank is None]
    out = a.worker(1, p.Alloc(rank=0, layout=LAYOUT))
    names = a.core.rings[0].alloc.names  # type: ignore[union-attr]
    told = reserves(out)
    assert told[0] == (spare.ctl, LAYOUT.nbytes, (names[0],)), "the slot made at once"
    assert told[-1] == (spare.ctl, LAYOUT.nbytes, tuple(sorted(names))), "then every slot"
    assert len(told) == len(names), "told again as each slot was made, only then"
    a.coordinator(p.Stop(), 0)
    assert assigned.ctl is not None
    out = a.worker(assigned.ctl, p.Parked(generation=0, rank=0, reason="ended", why="told to"))
    assert reserves(out) == [(assigned.ctl, LAYOUT.nbytes, tuple(sorted(names)))]

    cold = Agent(nproc=1, spare_workers=1, warm_spares=False)
    cold.start(0)
    cold.worker(1, p.Alloc(rank=0, layout=LAYOUT))
    assert not reserves(cold.out)


def test_the_agent_makes_a_rings_first_slot_at_once_and_the_others_off_its_loop() -> None:
    """A layout's first slot is made in the loop (the first snapshot needs it), the others
    by its shell (``MakeSegment``); a step that finds no free slot only because they are
    being made is told to wait (``filling``), not skipped; a slot that cannot be made
    fails the rank's next snapshot with what to do about it."""
    a = Agent(slots=3, peer_slots=3)  # a ring of 3 (the defaults before 12-05)
    a.start(0)
    out = a.core.handle(ae.FromWorker(1, p.Envelope(0, p.Alloc(rank=0, layout=LAYOUT)), 0.0), 0.0)
    (alloc,) = [c.msg for c in out if isinstance(c, ae.Reply)]
    assert isinstance(alloc, p.Allocated) and len(alloc.segments) == a.core.cfg.tier0_slots
    makes = [c for c in out if isinstance(c, ae.MakeSegment)]
    assert [c.index for c in makes] == list(range(1, a.core.cfg.tier0_slots))
    assert {c.name for c in makes} == set(alloc.segments[1:])

    def ask(step: int) -> tuple[p.SlotGranted, list[Any]]:
        req = p.SlotRequest(rank=0, step=step, alloc=alloc.alloc)
        out = a.core.handle(ae.FromWorker(1, p.Envelope(0, req), 0.0), 0.0)
        (grant,) = [c.msg for c in out if isinstance(c, ae.Reply)]
        assert isinstance(grant, p.SlotGranted)
        return grant, out

    grant, _ = ask(0)
    assert grant.slot == 0
    a.worker(1, p.Written(rank=0, step=0, slot=0, alloc=alloc.alloc, tree={}, stall=0.0,
                          checksum="c0"))  # fmt: skip
    grant, out = ask(1)  # slot 0 holds the newest step, the others are not made yet
    assert grant == p.SlotGranted(slot=None, filling=True)
    assert not [m for m in a.to_coordinator(out) if isinstance(m, p.Skipped)]
    first, *rest = makes
    seg = MemorySegment(first.name, first.nbytes, a.segs)
    a.core.handle(ae.SegmentMade(0, 0, first.alloc, first.index, seg), 0.0)
    assert ask(1)[0] == p.SlotGranted(slot=1)
    out = a.core.handle(ae.SegmentMade(0, 0, rest[0].alloc, rest[0].index, None, "ENOSPC"), 0.0)
    (error,) = [m for m in a.to_coordinator(out) if isinstance(m, p.AgentError)]
    assert "cannot allocate" in error.error and "Free or enlarge" in error.error
    a.worker(1, p.Written(rank=0, step=1, slot=1, alloc=alloc.alloc, tree={}, stall=0.0,
                          checksum="c1"))  # fmt: skip
    req = p.SlotRequest(rank=0, step=2, alloc=alloc.alloc)
    out = a.core.handle(ae.FromWorker(1, p.Envelope(0, req), 0.0), 0.0)
    (reply,) = [c.msg for c in out if isinstance(c, ae.Reply)]
    assert isinstance(reply, p.Error) and "UsageError: node 0 cannot allocate" in reply.message


def test_an_injected_persist_failure_fails_every_part_of_that_step() -> None:
    from tierswap.faults import FaultPlan, Injection

    (fault,) = FaultPlan.parse(["fail:persist:step=4"]).faults
    assert fault == Injection("fail", "persist", -1, 4) and str(fault) == "fail:persist:step=4"
    a = Agent(nproc=2)
    start = p.Start(
        node=0, world_size=4, ranks=[0, 1], store="h:2", backend="gloo",
        plans={r: p.RankPlan(step=None) for r in (0, 1)}, inject=["fail:persist:step=4"],
        restart_step=-1, committed=(-1, -1), max_redo=1, placement={0: [1], 1: [1]},
        protects=[], peers={1: ("h", 8)},
    )  # fmt: skip
    a.coordinator(start, 0)
    persist = p.Persist(step=4, root="/x", world_size=4, token=7, bases={})
    out = a.coordinator(persist, 0)
    (parts,) = [m for m in a.to_coordinator(out) if isinstance(m, p.Parts)]
    assert parts.parts == [] and set(parts.errors) == {0, 1}
    assert not [c for c in out if isinstance(c, ae.WritePart)]


def test_an_agent_writes_a_lost_ranks_part_from_the_replica_it_holds() -> None:
    a = Agent()
    a.start(0)
    token, buf = a.core.peers.slot(1, 5, LAYOUT, 0)  # type: ignore[misc]
    buf[:8] = b"12345678"
    a.core.peers.written(1, token, True, 5, LAYOUT, {"v": 1}, "c5", generation=0)
    persist = p.Persist(step=5, root="/x", world_size=2, token=3, bases={}, replicas={1: 0})
    out = a.coordinator(persist, 0)
    writes = {c.part.rank: c.part for c in out if isinstance(c, ae.WritePart)}
    assert sorted(writes) == [1], "rank 0's tier 0 holds nothing of step 5"
    assert writes[1].slot is token and writes[1].slot.leases == 1
    out = a.core.handle(ae.PartWritten(1, 5, 3, token, None, "no room"), 0.0)
    assert token.leases == 0, "the replica's lease is given back"
    (parts,) = [m for m in a.to_coordinator(out) if isinstance(m, p.Parts)]
    assert set(parts.errors) == {0, 1} and "tier 0 no longer holds it" in parts.errors[0]


def test_a_node_drops_the_rings_of_ranks_it_no_longer_serves() -> None:
    segs: dict[str, MemorySegment] = {}
    rings = NodeRings("t", 2, create=lambda n, s: MemorySegment(n, s, segs))
    rings.serve([4, 5], -1, -1, -1)
    rings[4].allocate(LAYOUT)
    rings[5].allocate(LAYOUT)
    slot = rings[5].alloc.slots[0]  # type: ignore[union-attr]
    slot.state, slot.step = SlotState.HELD, 3
    assert rings[5].lease(3) is slot  # a part being written from it
    rings.serve([2, 3], -1, -1, -1)  # the job shrank: this node's ranks are 2 and 3 now
    assert sorted(rings.by_rank) == [2, 3] and len(segs) == 2, "rank 4's slots are gone"
    assert rings.holdings() == {2: {}, 3: {}}
    assert rings.unlease(slot) and not segs and not rings.left, "rank 5's once unleased"


def test_a_step_a_node_no_longer_holds_is_not_counted_for_a_commit() -> None:
    """Found by review: a new layout made the agent's slots anew and dropped its held step;
    the coordinator still counted it and committed a step that node no longer had."""
    c = Coordinator()
    c.say(0, p.Held(tier=0, step=0))
    c.say(0, p.Unheld(tier=0, step=0))
    assert not c.sent(p.Committed, c.say(1, p.Held(tier=0, step=0)))
    (commit,) = c.sent(
        p.Committed, c.say(0, p.Held(tier=0, step=1)) + c.say(1, p.Held(tier=0, step=1))
    )
    assert commit == p.Committed(tier=0, step=1)


def test_a_step_ruled_out_stays_out_when_a_node_holds_it_later() -> None:
    c = Coordinator()
    c.say(1, p.Held(tier=0, step=9))
    out = c.say(0, p.Skipped(rank=0, step=9))
    assert c.sent(p.Release, out) == [p.Release(tier=0, step=9)]
    out = c.say(0, p.Held(tier=0, step=9))  # rank 0 got a slot for 9 after all
    assert c.sent(p.Release, out) == [p.Release(tier=0, step=9)], "released at once"
    assert not c.sent(p.Committed, out)


def test_a_first_worker_dying_before_it_attaches_stops_the_job_a_replacement_is_retried() -> None:
    a = Agent()
    (first,) = a.spawned
    a.start(0)
    out = a.core.handle(ae.WorkerExited(first.local, first.incarnation, -9), 0.0)
    assert p.Exited(rank=0, code=-9) in a.to_coordinator(out)
    (spawn,) = [c for c in out if isinstance(c, Spawn)]  # its replacement
    out = a.core.handle(ae.WorkerExited(spawn.local, spawn.incarnation, -9), 0.0)
    assert [c for c in out if isinstance(c, Spawn)], "killed while it imported: started again"
    assert not [m for m in a.to_coordinator(out) if isinstance(m, p.StartFailed)]

    # a node whose first worker fails before it attaches
    core = AgentCore(1, a.core.cfg, rings=a.core.rings, peers=a.core.peers,
                     replica_address=("h", 9), coord_host="h")  # fmt: skip
    (boot,) = [c for c in core.handle(ae.Boot(), 0.0) if isinstance(c, Spawn)]
    out = core.handle(ae.WorkerExited(boot.local, boot.incarnation, 1), 0.0)
    told = [c.msg for c in out if isinstance(c, ae.ToCoordinator)]
    assert told == [p.StartFailed(local=0, code=1)], "the script is broken: the job stops"


@pytest.mark.parametrize("module", ["tierswap.cluster.agent", "tierswap.cluster.coordinator"])
def test_an_agent_or_launcher_process_imports_no_torch(module: str) -> None:
    """An agent only moves and checks bytes, a launcher only decides and serves keys:
    importing torch would add seconds to every host's start (a spare's boot, a revived
    host's), to every job's launch, and hundreds of MB to each."""
    import subprocess
    import sys

    code = f"import sys, {module}; print(sorted({{'torch', 'safetensors'}} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_the_dcp_bridge_is_reached_from_a_plain_import_of_the_package() -> None:
    """README's ``tierswap.dcp.StorageReader`` after ``import tierswap``, in a fresh process
    (an earlier test's ``import tierswap.dcp`` would set the attribute)."""
    import subprocess
    import sys

    code = "import tierswap; print(tierswap.dcp.StorageReader.__name__, 'dcp' in tierswap.__all__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["StorageReader", "True"], done.stdout + done.stderr


CORE_PARTS = ["coordinator", "failures", "membership", "progress", "resize", "takeover",
              "generation"]  # fmt: skip


def test_each_part_of_the_coordinators_core_imports_first_in_a_fresh_process() -> None:
    """The core's parts import each other: none may need another to be imported first
    (a cycle fails only in some import orders)."""
    import subprocess
    import sys

    for name in CORE_PARTS:
        code = f"import tierswap.control.{name}"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert done.returncode == 0, f"{name} imported first: {done.stderr[-800:]}"


def test_a_node_drops_the_replicas_of_ranks_it_no_longer_protects() -> None:
    segs: dict[str, MemorySegment] = {}
    peers = PeerStore("t", 2, 0, lambda m, g: None, create=lambda n, s: MemorySegment(n, s, segs))
    for rank in (3, 4):
        token, _ = peers.slot(rank, 7, LAYOUT)  # type: ignore[misc]
        peers.written(rank, token, True, 7, LAYOUT, {}, f"c{rank}")
    lease = peers.lease(4, 7)  # rank 4's replica is being served to a restoring worker
    assert lease is not None and len(segs) == 4
    peers.keep_only([3])  # resized: this node protects rank 3 only
    assert sorted(peers.holdings()) == [3] and len(segs) == 4, "kept while it is leased"
    peers.unlease(4, lease.token)
    assert len(segs) == 2 and not peers.left, "rank 4's slots go once it is given back"
    peers.keep_only([])
    assert not segs


def _held_replicas(peers: PeerStore, ranks: tuple[int, ...], step: int = 7) -> None:
    """Replicas of ``ranks`` held, each under a checksum its bytes do not match: any
    replica read again is found corrupt."""
    for rank in ranks:
        gen = peers.generation
        token, _ = peers.slot(rank, step, LAYOUT, gen)  # type: ignore[misc]
        peers.written(rank, token, True, step, LAYOUT, {}, "not their checksum", generation=gen)


def test_a_node_reads_again_only_the_replicas_of_the_ranks_it_is_told() -> None:
    segs: dict[str, MemorySegment] = {}
    peers = PeerStore("t", 2, 0, lambda m, g: None, create=lambda n, s: MemorySegment(n, s, segs))
    _held_replicas(peers, (3, 4, 5))
    assert peers.verify([]) == [] and sorted(peers.holdings()) == [3, 4, 5]
    assert peers.verify([4, 9]) == [(4, 7)], "rank 4's replica is read and found corrupt"
    assert sorted(r for r, held in peers.holdings().items() if held) == [3, 5]
    assert sorted(peers.verify()) == [(3, 7), (5, 7)], "None: every replica"


def test_a_parity_is_read_again_for_any_rank_it_is_made_of() -> None:
    segs: dict[str, MemorySegment] = {}
    peers = PeerStore("t", 2, 0, lambda m, g: None, create=lambda n, s: MemorySegment(n, s, segs))
    peers.set_parity({9: [1, 2]})  # the ring held under key 9 is the XOR of ranks 1 and 2
    _held_replicas(peers, (9,))
    assert peers.verify([0, 3]) == [], "of neither rank: not read"
    assert peers.verify([2]) == [(9, 7)], "rank 2's stripes are in it"


@pytest.mark.parametrize(("verify", "kept"), [([], [3, 4]), ([4], [3]), (None, [])])
def test_a_stopping_agent_reports_what_it_did_not_read_again_and_drops_what_it_found_bad(
    verify: list[int] | None, kept: list[int]
) -> None:
    a = Agent()
    a.start(0)
    _held_replicas(a.core.peers, (3, 4))
    a.coordinator(p.Stop(verify=verify), 0)
    a.worker(10, p.Parked(generation=0, rank=0, reason="ended", why="told to"))
    (stopped,) = [m for m in a.to_coordinator() if isinstance(m, p.Stopped)]
    assert sorted(r for r, held in stopped.peer.items() if held) == kept
    rejected = sorted(m.rank for m in a.to_coordinator() if isinstance(m, p.ReplicaRejected))
    assert rejected == sorted({3, 4} - set(kept))


def _stopped(a: Agent, out: list[Any]) -> p.Stopped:
    (stopped,) = [m for m in a.to_coordinator(out) if isinstance(m, p.Stopped)]
    return stopped


def _rejected(a: Agent, out: list[Any]) -> list[int]:
    return sorted(m.rank for m in a.to_coordinator(out) if isinstance(m, p.ReplicaRejected))


def test_a_stop_that_names_more_ranks_has_them_read_too_before_or_after_the_report() -> None:
    """A node lost after the stop went out: the stop that names its ranks has their
    replicas read, while the node is still stopping or in a report made anew; asked
    again for what it read, the node answers with the report it made."""
    a = Agent()
    a.start(0)
    _held_replicas(a.core.peers, (3, 4, 5))
    a.coordinator(p.Stop(verify=[]), 0)
    a.coordinator(p.Stop(verify=[3]), 0)  # still stopping: its worker has not parked
    out = a.worker(10, p.Parked(generation=0, rank=0, reason="ended", why="told to"))
    assert sorted(r for r, held in _stopped(a, out).peer.items() if held) == [4, 5]
    assert _rejected(a, out) == [3]
    out = a.coordinator(p.Stop(verify=[4]), 0)  # stopped: read, and reported anew
    assert sorted(r for r, held in _stopped(a, out).peer.items() if held) == [5]
    assert _rejected(a, out) == [4]
    first = _stopped(a, out)
    out = a.coordinator(p.Stop(verify=[3, 4]), 0)  # nothing unread: the same report
    assert _stopped(a, out) is first and not _rejected(a, out)
    out = a.coordinator(p.Stop(verify=None), 0)  # every rank: rank 5 is read too
    assert _stopped(a, out).peer.get(5, {}) == {} and _rejected(a, out) == [5]


def _report(read: list[int] | None) -> p.Stopped:
    return p.Stopped(holdings={}, peer={}, peer_deltas={}, verified=read)


def test_a_node_lost_while_the_others_stop_has_every_node_report_anew() -> None:
    """A report counts only once it covers every rank this recovery's stops named: one
    that crossed the second stop (made after reading nothing again) is not taken."""
    c = Coordinator(nodes=3, spares=1)
    c.say(1, p.Exited(rank=1, code=-9))
    assert c.sent(p.Stop)[-1] == p.Stop(verify=[])
    c.say(0, _report([]))
    _fail_node(c, 2)  # lost before it reported: its rank may come from replicas now
    assert c.sent(p.Stop)[-1] == p.Stop(verify=[2])
    generation = c.core.generation
    c.say(1, _report([]))  # the answer to the first stop, crossed with the second
    c.say(0, _report([2]))
    assert c.core.generation == generation, "node 1 has not answered the second stop"
    c.say(1, _report([2]))
    assert c.core.generation == generation + 1 and c.core.phase == Phase.RUNNING


def test_a_node_lost_while_the_job_waits_for_a_host_keeps_the_wait_it_had() -> None:
    """Stopping the others again must not cut the wait for a host to join short."""
    c = Coordinator(nodes=3, revive=False, join_timeout=300.0, startup_timeout=120.0)
    _fail_node(c, 2)
    for host in (0, 1):
        c.say(host, _report([2]))
    assert c.core.phase == Phase.RECOVERING and c.core.deadline == pytest.approx(c.now + 300)
    wait_ends = c.core.deadline
    c.now += 10
    _fail_node(c, 1)  # while it waits: node 1's rank may come from replicas now
    assert c.sent(p.Stop)[-1] == p.Stop(verify=[1, 2])
    c.say(0, _report([1, 2]))
    assert c.core.deadline == wait_ends, "the wait for a host is what it was"
    assert c.core.phase == Phase.RECOVERING


def test_an_idle_member_asked_to_stop_reports_that_it_holds_nothing() -> None:
    """A spare given a node whose generation never started there (the job waits for
    another vacancy) is stopped with the others when a member is lost."""
    a = Agent()
    out = a.coordinator(p.Stop(verify=[1]), 3)
    assert a.to_coordinator(out) == [_report(None)] and a.core.phase == AgentPhase.IDLE


def test_a_stop_names_the_ranks_of_a_lost_node_and_none_for_a_failed_worker() -> None:
    """A failed worker's rank comes back from its own node's tier 0: no replica is read
    again on the way (that costs a read of every byte); a lost node's ranks may come from
    replicas, which are read again before the nodes report them."""
    c = Coordinator(spares=1)
    c.say(1, p.Exited(rank=1, code=-9))
    assert c.sent(p.Stop)[-1] == p.Stop(verify=[])
    for host in (0, 1):
        c.say(host, p.Stopped(verified=None, holdings={}, peer={}, peer_deltas={}))
    assert c.core.phase == Phase.RUNNING
    _fail_node(c, 1)
    assert c.sent(p.Stop)[-1] == p.Stop(verify=[1])


def test_replication_is_told_the_generations_world_size() -> None:
    """A base written to tier 2 records the job's size now, not the configured one (the
    job may have shrunk)."""
    a = Agent()
    out = a.start(0)
    (conf,) = [c for c in out if isinstance(c, ae.ConfigureReplication)]
    assert conf.world_size == 2


# ---------------------------------------------------------------- a spare made ready ahead


def test_a_spare_is_told_the_segments_a_node_holds_and_again_when_they_grow() -> None:
    c = Coordinator(spares=1)
    c.say(0, p.Memory(rank=0, tier=0, nbytes=400, segments=[100] * 4))
    c.say(0, p.Memory(rank=1, tier=1, nbytes=400, segments=[100] * 4))
    warm = [m for m in c.sent(p.Warm)]
    assert warm[-1].segments == [100] * 8, "its tier-0 slots and the replicas it keeps"
    sends = [x for x in c.out if isinstance(x, cc.Send) and isinstance(x.msg, p.Warm)]
    assert {x.conn for x in sends} == {3}, "to the spare (host 2) only"
    n = len(warm)
    c.say(1, p.Memory(rank=1, tier=0, nbytes=400, segments=[100] * 4))
    assert len(c.sent(p.Warm)) == n, "node 1 takes no more than node 0: nothing new"
    c.say(1, p.Memory(rank=1, tier=0, nbytes=1200, segments=[300] * 4))
    assert c.sent(p.Warm)[-1].segments == [300] * 4, "the node that takes the most"


def test_warm_spares_off_tells_spares_nothing() -> None:
    c = Coordinator(spares=1, warm_spares=False)
    c.say(0, p.Memory(rank=0, tier=0, nbytes=400, segments=[100] * 4))
    assert not c.sent(p.Warm)


def test_a_spare_agent_makes_segments_ahead_and_frees_the_rest_once_it_committed() -> None:
    a = Agent()
    out = a.coordinator(p.Warm(segments=[10, 10, 20]), 0)
    assert [c for c in out if isinstance(c, ae.WarmSegments)] == [ae.WarmSegments((10, 10, 20))]
    a.start(0)
    assert not [c for c in a.coordinator(p.Warm(segments=[5]), 0) if isinstance(c, ae.WarmSegments)]
    out = a.coordinator(p.Committed(tier=1, step=3), 0)
    assert [c for c in out if isinstance(c, ae.WarmSegments)] == [ae.WarmSegments(())]
    out = a.coordinator(p.Committed(tier=1, step=4), 0)
    assert not [c for c in out if isinstance(c, ae.WarmSegments)], "once"


# ---------------------------------------------------------------- a crashed worker replaced


def _exit(a: Agent, local: int) -> list[Any]:
    w = a.core.workers.procs[local]
    out = a.core.handle(ae.WorkerExited(local, w.incarnation, -9), 0.0)
    a.out += out
    return out


def test_a_crashed_workers_replacement_waits_until_the_spare_worker_has_stepped() -> None:
    a = Agent(spare_workers=1)
    a.start(0)
    assert a.core.workers.by_rank[0].local == 0
    out = _exit(a, 0)
    assert not [c for c in out if isinstance(c, Spawn)], "no import while the job recovers"
    a.coordinator(p.Stop(), 0)
    a.start(1)
    assert a.core.workers.by_rank[0].local == 1, "the spare worker took the rank"
    out = a.worker(11, p.Stepped(rank=0, step=5))
    assert [c.local for c in out if isinstance(c, Spawn)] == [0]
    assert not a.core.workers.deferred


def test_a_crashed_worker_without_a_spare_is_replaced_at_once() -> None:
    a = Agent()
    a.start(0)
    assert [c.local for c in _exit(a, 0) if isinstance(c, Spawn)] == [0]


def test_held_back_replacements_start_when_a_generation_needs_them() -> None:
    a = Agent(nproc=2, spare_workers=1)
    a.start(0)
    assert not [c for c in _exit(a, 0) if isinstance(c, Spawn)]
    assert not [c for c in _exit(a, 1) if isinstance(c, Spawn)], "the spare is still parked"
    a.coordinator(p.Stop(), 0)
    out = a.start(1)  # two ranks, one parked worker: both held back start now
    assert sorted(c.local for c in out if isinstance(c, Spawn)) == [0, 1]


def test_a_wait_that_times_out_names_the_option_that_bounds_it() -> None:
    """`timed out waiting for nodes [1] to join` alone does not say what to raise."""
    cfg = Config(nodes=2, console=False, startup_timeout=30.0)
    core = CoordinatorCore(cfg, job_id="t", script=["x.py"], address=("h", 1), store="h:2",
                           tier2=None, now=0.0)  # fmt: skip
    core.handle(cc.Begin(), 0.0)
    core.handle(cc.AgentMessage(1, p.Envelope(-1, p.Hello(host=0, pid=100)), 0.1), 0.1)
    out: list[Any] = []
    for i in range(1, 64):  # a tick each half second, as the loop makes them
        out += core.handle(cc.Tick(), 0.1 + 0.5 * i)
    (failed,) = [c.fields for c in out if isinstance(c, cc.Log) and c.event == "job_failed"]
    assert "timed out waiting for nodes [1] to join" in failed["reason"]
    assert failed["reason"].endswith("(--startup-timeout 30 s)"), failed


def test_the_end_of_a_job_says_what_each_tier_committed_and_a_durable_root_never_written() -> None:
    c = Coordinator(persist="/nowhere")
    c.core.tiers[0].committed, c.core.tiers[1].committed = 9, 8
    assert c.core._committed_said() == "memory 9, peer 8, durable none"
    c.core.persister.committed = 9
    assert c.core._committed_said() == "memory 9, peer 8, durable 9"


def test_an_injection_that_never_fired_is_said_at_the_end() -> None:
    from tierswap.control import progress
    from tierswap.control.states import Phase
    from tierswap.faults import Injection

    c = Coordinator(
        inject=[Injection.parse(s) for s in ("kill:node=1:step=999", "slow:rank=1:seconds=0.5")]
    )
    assert c.core.phase.state == Phase.RUNNING
    c.core.phase.move(Phase.FINISHING)
    c.core.last_step = c.core.tiers[0].committed = 5
    progress.maybe_done(c.core)
    c.out += c.core.out.take()
    (unfired,) = c.logged("faults_unfired")
    assert unfired["specs"] == ["kill:node=1:step=999"]
    assert c.core.phase.state == Phase.DONE


def test_every_line_the_console_writes_to_a_log_starts_with_its_prefix(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A batch log (no terminal) is grepped for ``[tierswap]``: rich must not take it
    for markup, and a message of several lines keeps it on each."""
    from tierswap.events import Progress

    out = Progress(enabled=True, total=40)
    out.live = False  # (pytest -s at a terminal: what a batch log gets)
    out.update(13, 0.5, 0.001, {"memory": 13, "peer": 12})
    out.message("tier-1 placement, 1 replica(s):\nnode 0: rank 0 -> node 1")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and all(line.startswith("[tierswap] ") for line in lines), lines
    assert "step 14/40 loss 0.5000" in lines[0]


# ---------------------------------------------------------------- a stop from outside


def _drained(c: Coordinator, signal: str = "SIGTERM", code: int = 143) -> list[Any]:
    out = c.core.handle(cc.Drain(signal, code), c.now)
    c.out += out
    return out


def test_a_signal_writes_tier_0_s_newest_step_to_tier_2_then_ends_with_its_code() -> None:
    c = Coordinator(persist="sim://t2", persist_every=100)
    _persisted(c, 0, [0, 1])
    for step in (1, 2, 3):
        for host in (0, 1):
            c.say(host, p.Held(tier=0, step=step))
    out = _drained(c)
    assert not [x for x in out if isinstance(x, cc.End)], "not before step 3 is written"
    persist = c.sent(p.Persist, out)[-1]
    assert persist.step == 3 and persist.replicas == {}
    assert c.core.handle(cc.Drain("SIGTERM", 143), c.now) == [], "a second is the shell's"
    c.say(0, p.Parts(token=persist.token, step=3, parts=[c.tier2.write_part(3, 0, b"x")],  # type: ignore[union-attr]
                     errors={}))  # fmt: skip
    assert not [x for x in c.out if isinstance(x, cc.End)]
    end = c.say(1, p.Parts(token=persist.token, step=3, parts=[c.tier2.write_part(3, 1, b"y")],  # type: ignore[union-attr]
                           errors={}))  # fmt: skip
    assert [x.code for x in end if isinstance(x, cc.End)] == [143]
    assert 3 in c.tier2.commits  # type: ignore[union-attr]
    (drain,) = c.logged("draining")
    assert drain == {"signal": "SIGTERM", "step": 3, "grace": 20.0}


def test_a_signal_ends_at_once_with_nothing_to_write_or_nowhere_to() -> None:
    bare = Coordinator()
    assert [x.code for x in _drained(bare, "SIGINT", 130) if isinstance(x, cc.End)] == [130]
    c = Coordinator(persist="sim://t2", persist_every=100)
    _persisted(c, 0, [0, 1])
    assert [x.code for x in _drained(c) if isinstance(x, cc.End)] == [143], "tier 2 has it"
    assert not c.logged("draining")


def test_a_write_past_the_stop_grace_or_a_failure_meanwhile_ends_the_wait() -> None:
    for late in (True, False):
        c = Coordinator(persist="sim://t2", persist_every=100, stop_grace=2.0)
        _persisted(c, 0, [0, 1])
        for host in (0, 1):
            c.say(host, p.Held(tier=0, step=1))
        _drained(c)
        if late:
            out = [x for i in range(1, 6) for x in c.core.handle(cc.Tick(), c.now + 0.5 * i)]
        else:
            out = c.core.handle(cc.AgentClosed(2), c.now + 0.1)  # host 1's connection
        c.out += out
        assert [x.code for x in out if isinstance(x, cc.End)] == [143]
        (failed,) = c.logged("drain_failed")
        assert ("--stop-grace 2 s" if late else "a failure came first") in failed["why"]
        assert c.core.phase == Phase.RUNNING, "no recovery: the job is stopping"


def test_a_durable_root_with_no_step_of_the_job_is_said_at_the_start() -> None:
    """A typo in a root's name trains from step 0 as a new root does: said, not silent."""
    said = [x.text for x in Coordinator(persist="sim://t2").out if isinstance(x, cc.Say)]
    assert "sim://t2 holds no step of this job: it starts from step 0" in said
    assert not [x for x in Coordinator().out if isinstance(x, cc.Say) and "holds no" in x.text]


def test_a_signal_while_finishing_or_while_the_step_is_being_written_adds_no_write() -> None:
    """A job already writing its last step finishes (one End: its own); one whose newest
    step is being written waits for that write, not a second of the same step."""
    c = Coordinator(persist="sim://t2", persist_every=1)
    _persisted(c, 0, [0, 1])
    for host in (0, 1):
        c.say(host, p.Held(tier=0, step=1))
    (writing,) = [x for x in c.sent(p.Persist) if x.step == 1]
    before = len(c.sent(p.Persist))
    _drained(c)
    assert len(c.sent(p.Persist)) == before, "the step in flight is waited for"
    for host in (0, 1):
        part = c.tier2.write_part(1, host, b"x")  # type: ignore[union-attr]
        c.say(host, p.Parts(token=writing.token, step=1, parts=[part], errors={}))
    assert [x.code for x in c.out if isinstance(x, cc.End)] == [143]
    from tierswap.control.states import Phase as Ph

    f = Coordinator(persist="sim://t2", persist_every=100)
    f.core.phase.move(Ph.FINISHING)
    assert not [x for x in _drained(f) if isinstance(x, cc.End)]
    assert f.core.draining is None, "finishing: the job ends by itself"


def test_a_root_lost_while_its_step_is_written_ends_the_wait_at_once() -> None:
    c = Coordinator(persist="sim://t2", persist_every=100)
    _persisted(c, 0, [0, 1])
    for host in (0, 1):
        c.say(host, p.Held(tier=0, step=1))
    _drained(c)
    out = c.core.handle(cc.DurableLost("another job took the root over"), c.now)
    c.out += out
    assert [x.code for x in out if isinstance(x, cc.End)] == [143]
    (failed,) = c.logged("drain_failed")
    assert failed["why"] == "its write failed"
