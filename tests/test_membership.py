"""The coordinator's pure parts of hot-swap: host bookkeeping, which node faults fire,
and the recovery clock's phases."""

from __future__ import annotations

import time
from typing import Any, cast

from tierswap.cluster.hosts import Hosts
from tierswap.cluster.launch import node_faults_due
from tierswap.cluster.recovery import RecoveryClock
from tierswap.cluster.workers import Workers
from tierswap.wire import Channel


def _chan() -> Channel:
    return cast(Channel, object())


def test_first_hosts_serve_their_nodes_and_later_ones_are_spares() -> None:
    hosts = Hosts(nodes=2, spares=1)
    chans = [_chan() for _ in range(3)]
    ids = [hosts.connected(i, 100 + i, c) for i, c in enumerate(chans)]
    assert ids == [0, 1, 2]
    assert [hosts.ready(h, ["127.0.0.1", 1000 + h]) for h in ids] == [True, True, False]
    assert hosts.members == {0: 0, 1: 1} and hosts.spares == [2] and not hosts.waiting
    assert hosts.peer_addresses == {0: ["127.0.0.1", 1000], 1: ["127.0.0.1", 1001]}
    # a second "ready" (a replaced worker attached) changes nothing: no member turns spare
    assert [hosts.ready(h, ["127.0.0.1", 1000 + h]) for h in ids] == [None, None, None]
    assert hosts.members == {0: 0, 1: 1} and hosts.spares == [2]
    # a host that joins from outside, or reuses an id, gets a fresh one
    assert hosts.connected(-1, 200, _chan()) == 3
    assert hosts.connected(1, 201, _chan()) == 4


def test_lost_member_leaves_a_vacancy_that_the_first_spare_fills() -> None:
    hosts = Hosts(nodes=3, spares=2)
    chans = {h: _chan() for h in range(5)}
    for h, c in chans.items():
        hosts.connected(h, h, c)
        hosts.ready(h, ["h", h])
    chan, node = hosts.lost(1)
    assert chan is chans[1] and node == 1
    hosts.vacant.add(1)
    assert hosts.lost(4) == (chans[4], None), "a spare serves no node"
    assert hosts.fill_vacancies() == [(1, 3)]
    assert hosts.members == {0: 0, 1: 3, 2: 2} and hosts.spares == [] and not hosts.vacant
    assert hosts.node_of(3) == 1 and hosts.host_of(chans[3]) == 3


def test_silent_hosts_are_those_past_their_lease() -> None:
    hosts = Hosts(nodes=2, spares=0)
    a, b = _chan(), _chan()
    hosts.connected(0, 1, a)
    hosts.connected(1, 2, b)
    now = time.monotonic()
    hosts.heard[a] = now - 1
    hosts.heard[b] = now - 11
    late = hosts.silent(now, lease=10)
    assert [h for h, _ in late] == [1] and late[0][1] > 10


def test_node_faults_fire_at_their_step_generation_or_transfer() -> None:
    specs = [
        "kill:node=1:step=5",
        "stop:node=0:step=3",
        "kill:node=1:gen=2",
        "kill:node=2:step=4:during=replication",
        "kill:rank=1:step=0",
    ]
    fired = [spec for spec, _ in node_faults_due(specs, step=4)]
    assert fired == ["stop:node=0:step=3"], "rank faults and other triggers wait"
    assert [s for s, _ in node_faults_due(specs, generation=2)] == ["kill:node=1:gen=2"]
    assert not node_faults_due(specs, transfer=(0, 1, 9)), "node 2 is not an end"
    assert not node_faults_due(specs, transfer=(2, 0, 3)), "too early a step"
    (due,) = node_faults_due(specs, transfer=(0, 2, 4))
    assert due[0] == "kill:node=2:step=4:during=replication"


def test_recovery_clock_splits_phases_and_names_kept_ranks() -> None:
    clock = RecoveryClock(world_size=2)
    clock.generation_started()
    for rank, pid in ((0, 10), (1, 11)):
        clock.worker_joined(rank, pid)
    assert clock.worker_stepped(0, -1) is None
    assert clock.worker_stepped(1, -1) is None, "no failure: nothing to report"
    clock.fault()
    assert (clock.failed(last_step=8) or 0) >= 0
    clock.generation_started()
    assert clock.worker_joined(0, 10) is None
    rebuilt: Any = clock.worker_joined(1, 21)
    assert rebuilt["kept"] == [0] and rebuilt["pids"] == {"0": 10, "1": 21}
    clock.restored()
    clock.worker_stepped(0, 7)
    resumed: Any = clock.worker_stepped(1, 7)
    assert resumed["kept"] == [0] and resumed["replaced"] == [1] and resumed["redone"] == 1
    assert set(resumed["phases"]) == {"detect", "decide", "rebuild", "restore", "resume"}
    assert all(v >= 0 for v in resumed["phases"].values())
    assert resumed["seconds"] >= sum(resumed["phases"].values()) - 1e-9


def test_a_node_is_ready_once_not_again_when_a_worker_is_replaced() -> None:
    workers = Workers(["-c", "import time; time.sleep(60)"], {}, lambda *a, **k: None)
    procs = []
    try:
        for local in (0, 1):
            workers.spawn(local)
            procs.append(workers.procs[local].proc)
        assert workers.attach(_chan(), 0, procs[0].pid) is False  # worker 1 still starting
        assert workers.attach(_chan(), 1, procs[1].pid) is True  # the node is ready
        procs[1].kill()
        workers.spawn(1)  # its replacement
        procs.append(workers.procs[1].proc)
        assert workers.attach(_chan(), 1, procs[2].pid) is False
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
