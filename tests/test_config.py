"""Config: validated once, each error naming its field; a round trip through TIERSWAP_* vars."""

from __future__ import annotations

import platform
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierswap.config import ENV_PREFIX, Config
from tierswap.errors import UsageError
from tierswap.faults import Injection

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"nodes": 0}, "nodes must be >= 1, got 0"),
        ({"nproc_per_node": -1}, "nproc_per_node must be >= 1, got -1"),
        ({"persist_every": 0}, "persist_every must be >= 1, got 0"),
        ({"keep": 0}, "keep must be >= 1, got 0"),
        ({"slots": 1}, r"slots must be >= 2 \(the committed step and one being written\), got 1"),
        ({"nodes": 3, "peer_parity": 1}, "peer_parity must be 0 .* or a group of >= 2 nodes"),
        (
            {"nodes": 3, "peer_parity": 3, "replicas": 2},
            r"--peer-parity 3 .* needs --replicas 1 \(got 2\)",
        ),
        (
            {"nodes": 3, "peer_parity": 3, "max_redo": 0},
            r"--peer-parity 3 needs --max-redo 1 or more: a parity is of use only while",
        ),
        (
            {"nodes": 3, "peer_parity": 3, "memory_tiers": "delta"},
            r"needs --replicas 1 .* and --memory-tiers full \(got 'delta'\)",
        ),
        ({"max_restarts": -1}, "max_restarts"),
        ({"threads": -2}, "threads"),
        ({"startup_timeout": 0.0}, "startup_timeout must be > 0, got 0.0"),
        ({"spares": -1}, "spares must be >= 0, got -1"),
        ({"max_redo": -1}, "max_redo must be >= 0, got -1"),
        ({"nodes": 2, "peer_slots": 1}, r"peer_slots must be >= 2 \(the step committed in tier 1"),
        ({"on_no_spare": "retry"}, "on_no_spare must be 'wait', 'fail' or 'shrink', got 'retry'"),
        ({"heartbeat": 1.0, "lease": 1.5}, r"lease \(1.5 s\) must be at least 2 heartbeats"),
        ({"collective_timeout": float("nan")}, "collective_timeout must be > 0"),
        ({"backend": "mpi"}, "backend must be 'gloo' or 'nccl', got 'mpi'"),
        (
            {"nodes": 2, "inject": (Injection("kill", "node", 2, 5),)},
            r"--inject kill:node=2:step=5: there are only 2 nodes",
        ),
        (
            {"nodes": 2, "nproc_per_node": 2, "inject": (Injection("kill", "rank", 4, 1),)},
            r"--inject kill:rank=4:step=1: there are only 4 ranks",
        ),
    ],
)
def test_validation_errors_name_the_field(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Config(**fields)


def test_nan_startup_timeout_is_rejected() -> None:
    with pytest.raises(ValueError, match="startup_timeout"):
        Config(startup_timeout=float("nan"))


def test_defaults_are_valid_and_world_size_multiplies() -> None:
    assert Config().world_size == 1
    assert Config(nodes=3, nproc_per_node=4).world_size == 12


def test_unset_slots_follow_max_redo_and_fewer_given_are_said_with_the_fix() -> None:
    """With ``--max-redo`` K of 2 or more tier 1 may trail tier 0 by K steps, each holding
    its slot: unset, the ring gets K + 1 (K + 2 with a tier-2 write's slot); given fewer,
    the job is told what to give instead, as its snapshots would be skipped."""
    assert [Config(nodes=2, max_redo=k).tier0_slots for k in (0, 1, 2, 3)] == [2, 2, 3, 4]
    assert Config(nodes=2, max_redo=2, persist="/t").tier0_slots == 4
    assert Config(nodes=2, max_redo=3, replicas=0).tier0_slots == 2, "no tier 1"
    assert Config(nodes=1, max_redo=3).tier0_slots == 2, "one node: no peer to replicate to"
    two = Config(nodes=2, max_redo=2)
    assert two.slot_advice() is None and Config(nodes=2, slots=2).slot_advice() is None
    assert Config(nodes=2, max_redo=3, slots=4).slot_advice() is None
    assert Config(nodes=2, max_redo=2, slots=2, replicas=0).slot_advice() is None
    advice = Config(nodes=2, max_redo=3, slots=3).slot_advice()
    assert advice is not None and "--slots 3 with --max-redo 3" in advice, advice
    assert "give --slots 4 or more" in advice, advice
    advice = Config(nodes=2, max_redo=2, slots=3, persist="/t").slot_advice()
    assert advice is not None and "give --slots 4 or more" in advice, "a tier-2 write's slot"
    assert Config(nodes=2, max_redo=2, slots=4, persist="/t").slot_advice() is None
    assert Config(nodes=2, slots=2, persist="/t").slot_advice() is None, "--max-redo 1: as before"


def test_unset_peer_parity_is_groups_of_3_where_they_apply_and_never_an_error() -> None:
    """The defaults hold 3x a node's state from 3 nodes on (2 + 2 slots, parity over groups
    of 3); elsewhere unset keeps full copies instead of refusing the job."""
    assert (Config().tier0_slots, Config().peer_slots, Config().peer_parity) == (2, 2, None)
    assert Config(persist="/t").tier0_slots == 3, "a tier-2 write holds its step's slot"
    assert Config(persist="/t", slots=2).tier0_slots == 2
    assert [Config(nodes=n).parity_group for n in (1, 2, 3, 4, 7)] == [0, 0, 3, 3, 3]
    for other in ({"replicas": 2}, {"replicas": 0}, {"memory_tiers": "delta"},
                  {"max_redo": 0}, {"on_no_spare": "shrink", "persist": "/t"}):  # fmt: skip
        assert Config(nodes=4, **other).parity_group == 0, other  # type: ignore[arg-type]
    assert Config(nodes=4, peer_parity=0).parity_group == 0
    assert Config(nodes=2, peer_parity=2).parity_group == 2
    with pytest.raises(ValueError, match="--peer-parity 3 needs --max-redo 1"):
        Config(nodes=4, peer_parity=3, max_redo=0)
    unset = Config(nodes=3)
    assert unset.to_env()["TIERSWAP_PEER_PARITY"] == "", "unset travels as unset"
    assert Config.from_env(unset.to_env()).parity_group == 3
    # a host's own environment never overrides what the job was given (workers read both)
    host = {"TIERSWAP_PEER_PARITY": "3", "TIERSWAP_SLOTS": "5"}
    cfg = Config(nodes=3, max_redo=0)
    assert Config.from_env({**host, **cfg.to_env()}) == cfg


@st.composite
def configs(draw: st.DrawFn) -> Config:
    nodes = draw(st.integers(min_value=1, max_value=6))
    nproc = draw(st.integers(min_value=1, max_value=4))
    targets = st.sampled_from(["node", "rank"])
    inject = []
    for target in draw(st.lists(targets, max_size=3)):
        limit = nodes if target == "node" else nodes * nproc
        index = draw(st.integers(min_value=0, max_value=limit - 1))
        inject.append(
            Injection("kill", target, index, draw(st.integers(min_value=0, max_value=10**6)))
        )
    text = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\0"))
    return Config(
        nodes=nodes,
        nproc_per_node=nproc,
        persist=draw(st.none() | text),
        persist_every=draw(st.integers(min_value=1, max_value=1000)),
        keep=draw(st.integers(min_value=1, max_value=9)),
        run_dir=draw(st.none() | text),
        slots=draw(st.none() | st.integers(min_value=2, max_value=8)),
        peer_slots=draw(st.integers(min_value=2, max_value=8)),
        peer_parity=draw(st.sampled_from([None, 0, 2, 3, 5])),
        inject=tuple(inject),
        max_restarts=draw(st.integers(min_value=0, max_value=50)),
        startup_timeout=draw(
            st.floats(min_value=1e-3, max_value=1e6, allow_nan=False, allow_infinity=False)
        ),
        threads=draw(st.integers(min_value=0, max_value=64)),
        console=draw(st.booleans()),
    )


@settings(max_examples=100, deadline=None)
@given(configs())
def test_env_round_trip(cfg: Config) -> None:
    env = cfg.to_env()
    assert all(k.startswith(ENV_PREFIX) and isinstance(v, str) for k, v in env.items())
    assert Config.from_env(env) == cfg


def test_env_round_trip_with_injections() -> None:
    cfg = Config(
        nodes=3,
        nproc_per_node=2,
        persist="file:///tmp/ckpt",
        inject=(Injection("kill", "node", 1, 20), Injection("kill", "rank", 5, 7)),
        startup_timeout=2.5,
        console=False,
    )
    env = cfg.to_env()
    assert env["TIERSWAP_INJECT"] == "kill:node=1:step=20,kill:rank=5:step=7"
    assert "TIERSWAP_RUN_DIR" not in env  # None is left out, and read back as the default
    assert Config.from_env(env) == cfg


def test_from_env_overrides_win_and_none_is_ignored() -> None:
    env = {"TIERSWAP_NODES": "2", "TIERSWAP_KEEP": "5", "TIERSWAP_OTHER": "x"}
    cfg = Config.from_env(env, nodes=4, keep=None)
    assert (cfg.nodes, cfg.keep) == (4, 5)


@pytest.mark.parametrize(
    ("raw", "value"), [("1", True), ("true", True), ("YES", True), ("0", False), ("no", False)]
)
def test_from_env_reads_booleans(raw: str, value: bool) -> None:
    assert Config.from_env({"TIERSWAP_CONSOLE": raw}).console is value


def test_from_env_names_the_bad_variable() -> None:
    with pytest.raises(ValueError, match=r"TIERSWAP_NODES='two' is not (an integer|of type int)"):
        Config.from_env({"TIERSWAP_NODES": "two"})
    with pytest.raises(
        ValueError, match=r"TIERSWAP_STARTUP_TIMEOUT='soon' is not (a number|of type float)"
    ):
        Config.from_env({"TIERSWAP_STARTUP_TIMEOUT": "soon"})
    with pytest.raises(ValueError, match="slots must be >= 2"):
        Config.from_env({"TIERSWAP_SLOTS": "1"})


def test_from_env_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERSWAP_NPROC_PER_NODE", "3")
    assert Config.from_env().nproc_per_node == 3


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("kill:node=1:step=20", Injection("kill", "node", 1, 20)),
        (" kill:rank=0:step=0 ", Injection("kill", "rank", 0, 0)),
        ("kill:node=1:gen=2", Injection("kill", "node", 1, -1, gen=2)),
        (
            "kill:node=1:step=4:during=replication",
            Injection("kill", "node", 1, 4, during="replication"),
        ),
        ("stop:rank=1:step=6", Injection("stop", "rank", 1, 6)),
        ("stop:node=0:step=3", Injection("stop", "node", 0, 3)),
        ("delay:node=1:seconds=0.25", Injection("delay", "node", 1, -1, seconds=0.25)),
        ("delay:node=0:seconds=.5", Injection("delay", "node", 0, -1, seconds=0.5)),
        ("delay:node=0:seconds=1e-05", Injection("delay", "node", 0, -1, seconds=1e-05)),
        ("delay:node=0:seconds=2e+06", Injection("delay", "node", 0, -1, seconds=2e6)),
        ("kill:node=1:step=4:during=commit", Injection("kill", "node", 1, 4, during="commit")),
        ("kill:node=0:step=9:during=persist", Injection("kill", "node", 0, 9, during="persist")),
        (
            "kill:rank=0:step=5:during=snapshot",
            Injection("kill", "rank", 0, 5, during="snapshot"),
        ),
        (
            "kill:rank=1:gen=2:during=restore",
            Injection("kill", "rank", 1, -1, gen=2, during="restore"),
        ),
        ("slow:rank=1:seconds=0.2", Injection("slow", "rank", 1, -1, seconds=0.2)),
        ("slow:persist:seconds=1.5", Injection("slow", "persist", -1, -1, seconds=1.5)),
    ],
)
def test_injection_parse_and_str(spec: str, expected: Injection) -> None:
    inj = Injection.parse(spec)
    assert inj == expected
    assert Injection.parse(str(inj)) == inj


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "kill:node=1",
        "kill:gpu=1:step=2",
        "node=1:step=2",
        "kill:node=-1:step=2",
        "kill:rank=x:step=2",
        "kill:node=1:step=2:extra",
        "KILL:node=1:step=2",
        "kill:rank=1:step=2:during=commit",  # a worker's kill has no commit to wait for
        "kill:node=1:gen=2:during=restore",
        "slow:node=1:seconds=1",
        "slow:persist:step=3",
    ],
)
def test_injection_parse_rejects_bad_specs(spec: str) -> None:
    with pytest.raises(ValueError) as info:
        Injection.parse(spec)
    message = str(info.value)
    assert repr(spec) in message
    assert "kill:node=I:step=S" in message and "kill:rank=R:step=S" in message


def test_bad_injection_in_env_shows_the_forms() -> None:
    with pytest.raises(ValueError, match="expected one of kill:node=I:step=S, kill:node=I:gen=G"):
        Config.from_env({"TIERSWAP_INJECT": "kill:node=0:step=1,boom"})


def test_advertised_address_must_be_one_others_can_reach() -> None:
    from tierswap.cluster.address import check_advertised, interface_of, worker_env

    assert check_advertised("127.0.0.1", "--bind") == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"
    assert worker_env("127.0.0.1", {})["GLOO_SOCKET_IFNAME"] == "lo"
    assert worker_env("127.0.0.1", {"GLOO_SOCKET_IFNAME": "eth9"})["GLOO_SOCKET_IFNAME"] == "eth9"
    assert worker_env("127.0.0.1", {})["THP_MEM_ALLOC_ENABLE"] == "1"
    assert worker_env("127.0.0.1", {"THP_MEM_ALLOC_ENABLE": "0"})["THP_MEM_ALLOC_ENABLE"] == "0"
    if platform.machine().lower() in ("x86_64", "amd64"):  # copies of a chunk and more: NT
        assert "x86_non_temporal_threshold" in worker_env("127.0.0.1", {})["GLIBC_TUNABLES"]
    with pytest.raises(UsageError, match="wildcard"):
        check_advertised("0.0.0.0", "--bind")
    with pytest.raises(
        UsageError, match=r"no interface of this host has it; it has \[.*127\.0\.0\.1"
    ):
        check_advertised("192.0.2.7", "--bind")  # TEST-NET-1: never assigned
    with pytest.raises(UsageError, match="no IPv4 address is known for that name"):
        check_advertised("no-such-host.invalid", "--bind")
    # Names resolve, and all of 127.0.0.0/8 is this host's loopback.
    assert check_advertised("localhost", "--bind") == "127.0.0.1"
    assert check_advertised("127.0.0.2", "--bind") == "127.0.0.2"
    assert interface_of("127.0.0.2") == "lo"


def test_a_name_that_resolves_to_loopback_is_taken_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    from tierswap.cluster.address import check_advertised

    real = socket.gethostbyname
    # as /etc/hosts has it on Debian-like hosts: the host's own name on 127.0.1.1
    fake = {"node-a": "127.0.1.1"}
    monkeypatch.setattr(socket, "gethostbyname", lambda n: fake.get(n) or real(n))
    assert check_advertised("node-a", "--bind") == "127.0.1.1"
    assert "--bind node-a is 127.0.1.1, a loopback address" in capsys.readouterr().err
    assert check_advertised("localhost", "--bind") == "127.0.0.1"
    assert capsys.readouterr().err == ""


def test_every_config_field_is_an_option_of_run_with_its_sentence_and_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import dataclasses

    from tierswap import cli
    from tierswap.config import field_docs

    with pytest.raises(SystemExit):
        cli.main(["run", "-h"])
    text = " ".join(capsys.readouterr().out.split())
    docs = field_docs()
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        assert flag in text, flag
        assert docs[f.name].split(".")[0][:40] in text, f"{flag} lacks its sentence"
    assert "--lease LEASE Seconds without a heartbeat" in text
    assert "(default: 10.0)" in text and "{gloo,nccl}" in text and "--no-revive" in text
    for form in ("kill:node=I:gen=G", "delay:node=I:seconds=F", "corrupt:rank=R:step=S"):
        assert form in text


def test_options_given_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from tierswap import cli

    monkeypatch.setenv("TIERSWAP_LEASE", "30")
    monkeypatch.setenv("TIERSWAP_NODES", "3")
    args = cli.parser().parse_args(
        ["run", "--nodes", "2", "--no-revive", "--inject", "kill:rank=0:step=1", "x.py"]
    )
    cfg = Config.from_env(**cli._config_args(args))
    assert (cfg.nodes, cfg.lease, cfg.revive) == (2, 30.0, False)
    assert cfg.inject == (Injection("kill", "rank", 0, 1),)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from tierswap import cli

    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert capsys.readouterr().out.startswith("tierswap 0.")


def test_chaos_is_parsed_once_and_refused_with_its_form() -> None:
    from tierswap.faults import Chaos

    assert Chaos.parse("7") == Chaos(7) and Chaos.parse("7:30:10") == Chaos(7, 30.0, 10)
    assert str(Chaos.parse("7:30:10")) == "7:30.0:10"
    for bad in ("x", "7:0", "7:-1", "7:1:x"):
        with pytest.raises(ValueError, match=r"SEED\[:RATE\[:COUNT\]\]"):
            Config(chaos=bad)


def test_each_new_fault_point_is_asked_where_it_fires() -> None:
    from tierswap.faults import FaultPlan

    plan = FaultPlan.parse(
        [
            "kill:node=1:step=4:during=commit",
            "kill:node=0:step=7:during=persist",
            "kill:rank=0:step=5:during=snapshot",
            "kill:rank=0:gen=2:during=restore",
            "slow:rank=1:seconds=0.2",
            "slow:persist:seconds=1.5",
        ]
    )
    assert plan.at_step(10) == [] and plan.at_generation(2) == []  # neither fires them
    assert plan.at_parts(1, 3) == [] and plan.at_parts(0, 4) == []
    assert [str(f) for f in plan.at_parts(1, 6)] == ["kill:node=1:step=4:during=commit"]
    assert plan.at_parts(1, 8) == [], "a fault fires once"
    assert plan.at_persist(6, {0, 1}) == [] and plan.at_parts(0, 9) == []
    assert plan.at_persist(9, {1}) == [], "node 0 cannot be killed from here"
    assert [str(f) for f in plan.at_persist(9, {0, 1})] == ["kill:node=0:step=7:during=persist"]
    assert [f.during for f in plan.of_rank(0)] == ["snapshot", "restore"]
    assert [f.action for f in plan.of_rank(1)] == ["slow"]
    assert plan.persist_delay() == 1.5 and not plan.fails_persist(4)
