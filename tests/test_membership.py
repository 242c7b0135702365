"""The coordinator's pure parts of hot-swap: host bookkeeping, which node faults fire,
and the recovery clock's phases."""

from __future__ import annotations

from typing import Any

from tierswap.control.hosts import Hosts
from tierswap.control.recovery import RecoveryClock
from tierswap.control.workers import Spawn, WorkerTable
from tierswap.faults import FaultPlan


def test_first_hosts_serve_their_nodes_and_later_ones_are_spares() -> None:
    hosts = Hosts(nodes=2, spares=1)
    ids = [hosts.connected(i, 100 + i, conn=10 + i, now=0.0) for i in range(3)]
    assert ids == [0, 1, 2]
    assert [hosts.ready(h, ("127.0.0.1", 1000 + h)) for h in ids] == [True, True, False]
    assert hosts.members == {0: 0, 1: 1} and hosts.spares == [2] and not hosts.waiting
    assert [hosts.address_of(n) for n in (0, 1)] == [("127.0.0.1", 1000), ("127.0.0.1", 1001)]
    # a second "ready" (a replaced worker attached) changes nothing: no member turns spare
    assert [hosts.ready(h, ("127.0.0.1", 1000 + h)) for h in ids] == [None, None, None]
    assert hosts.members == {0: 0, 1: 1} and hosts.spares == [2]
    # a host that joins from outside, or reuses an id, gets a fresh one
    assert hosts.connected(-1, 200, conn=20, now=0.0) == 3
    assert hosts.connected(1, 201, conn=21, now=0.0) == 4


def test_lost_member_leaves_a_vacancy_that_the_first_spare_fills() -> None:
    hosts = Hosts(nodes=3, spares=2)
    for h in range(5):
        hosts.connected(h, h, conn=10 + h, now=0.0)
        hosts.ready(h, ("h", h))
    conn, node = hosts.lost(1)
    assert conn == 11 and node == 1
    hosts.vacant.add(1)
    assert hosts.lost(4) == (14, None), "a spare serves no node"
    assert hosts.fill_vacancies() == [(1, 3)]
    assert hosts.members == {0: 0, 1: 3, 2: 2} and hosts.spares == [] and not hosts.vacant
    assert hosts.node_of(3) == 1 and hosts.host_of(13) == 3
    assert hosts.host_of(11) is None, "a lost host's connection names no host"


def test_silent_hosts_are_those_past_their_lease() -> None:
    hosts = Hosts(nodes=2, spares=0)
    hosts.connected(0, 1, conn=1, now=0.0)
    hosts.connected(1, 2, conn=2, now=0.0)
    hosts.heard[0] = 99.0
    hosts.heard[1] = 89.0
    late = hosts.silent(100.0, lease=10)
    assert [h for h, _ in late] == [1] and late[0][1] > 10


def test_node_faults_fire_at_their_step_generation_or_transfer_once() -> None:
    specs = [
        "kill:node=1:step=5",
        "stop:node=0:step=3",
        "kill:node=1:gen=2",
        "kill:node=2:step=4:during=replication",
        "kill:rank=1:step=0",
    ]
    plan = FaultPlan.parse(specs)
    assert [str(f) for f in plan.at_step(4)] == ["stop:node=0:step=3"], "others wait"
    assert plan.at_step(4) == [], "a fault fires once"
    assert [str(f) for f in plan.at_generation(2)] == ["kill:node=1:gen=2"]
    assert not plan.at_transfer(0, 1, 9), "node 2 is not an end"
    assert not plan.at_transfer(2, 0, 3), "too early a step"
    (due,) = plan.at_transfer(0, 2, 4)
    assert str(due) == "kill:node=2:step=4:during=replication"
    assert [str(f) for f in plan.of_rank(1)] == ["kill:rank=1:step=0"]
    plan.fired("kill:rank=1:step=0")
    assert plan.specs() == ["kill:node=1:step=5"]


def test_recovery_clock_splits_phases_and_names_kept_ranks() -> None:
    clock = RecoveryClock(world_size=2)
    clock.generation_started(0.0)
    for rank, pid in ((0, 10), (1, 11)):
        clock.worker_joined(rank, pid, 0.1)
    assert clock.worker_stepped(0, -1, 0.2) is None
    assert clock.worker_stepped(1, -1, 0.2) is None, "no failure: nothing to report"
    clock.fault(10.0)
    assert clock.failed(last_step=8, now=10.5) == 0.5
    clock.generation_started(11.0)
    assert clock.worker_joined(0, 10, 11.25) is None
    rebuilt: Any = clock.worker_joined(1, 21, 11.5)
    assert rebuilt["kept"] == [0] and rebuilt["pids"] == {"0": 10, "1": 21}
    assert rebuilt["seconds"] == 0.5
    clock.restored(12.0)
    clock.worker_stepped(0, 7, 12.5, {"load": 0.25})
    resumed: Any = clock.worker_stepped(1, 7, 13.0, {"fetch": 0.5, "load": 0.5})
    assert resumed["kept"] == [0] and resumed["replaced"] == [1] and resumed["redone"] == 1
    assert resumed["phases"] == {
        "detect": 0.5,
        "decide": 0.5,
        "rebuild": 0.5,
        "restore": 0.5,
        "resume": 1.0,
    }
    assert resumed["seconds"] == 3.0
    assert resumed["ranks"] == {"0": {"load": 0.25}, "1": {"fetch": 0.5, "load": 0.5}}


def test_recovery_clock_ends_at_the_first_step_not_at_the_snapshot_after_it() -> None:
    clock = RecoveryClock(world_size=2)
    clock.generation_started(0.0)
    clock.fault(10.0)
    clock.failed(last_step=8, now=10.5)
    clock.generation_started(11.0)
    clock.worker_joined(0, 10, 11.0)
    clock.worker_joined(1, 21, 11.0)
    clock.restored(12.0)
    clock.worker_stepped(0, 8, 13.5, {"step": 1.0, "snapshot": 0.25})  # stepped at 13.25
    resumed: Any = clock.worker_stepped(1, 8, 13.0, {"step": 0.75})
    assert resumed["seconds"] == 3.25 and resumed["phases"]["resume"] == 1.25


def test_a_node_is_ready_once_not_again_when_a_worker_is_replaced() -> None:
    workers = WorkerTable()
    for local in (0, 1):
        workers.spawn(local, now=0.0)
    spawned = workers.take()
    assert spawned == [Spawn(0, 1), Spawn(1, 2)]
    assert workers.attach(100, 0, 1, pid=500, now=1.0) is False  # worker 1 still starting
    assert workers.attach(101, 1, 1, pid=501, now=1.0) is False, "another incarnation's"
    assert workers.attach(101, 1, 2, pid=501, now=1.0) is True  # the node is ready
    workers.spawn(1, now=2.0)  # its replacement
    (replacement,) = workers.take()
    assert workers.attach(102, 1, replacement.incarnation, pid=502, now=3.0) is False
