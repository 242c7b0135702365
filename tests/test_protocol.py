"""The protocol: every message round-trips its channel's codec, tags are unique, bad bytes
are refused naming what is wrong, and the door drops what an ended generation sent."""

from __future__ import annotations

import types
from typing import Any, Union, get_args, get_origin, get_type_hints

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierswap.control import protocol as p
from tierswap.state import Layout, TensorEntry
from tierswap.tiers.durable import PartInfo

ALL = sorted(
    {cls for union in p.CHANNELS.values() for cls in p.members(union)}, key=lambda c: c.__name__
)

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


def _strategy(tp: Any) -> st.SearchStrategy[Any]:
    """Values of a message field's type (JSON-like where the type is ``Any``)."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return _json
    if tp in (int, float, str, bool, bytes):
        small: dict[Any, st.SearchStrategy[Any]] = {
            int: st.integers(-(2**62), 2**62),
            float: st.floats(allow_nan=False),
            str: st.text(max_size=12),
            bytes: st.binary(max_size=12),
            bool: st.booleans(),
        }
        return small[tp]
    if tp is type(None):
        return st.none()
    if origin in (Union, types.UnionType):
        return st.one_of(*(_strategy(a) for a in args))
    if origin is list:
        return st.lists(_strategy(args[0]), max_size=3)
    if origin is dict:
        return st.dictionaries(_strategy(args[0]), _strategy(args[1]), max_size=3)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(_strategy(args[0]), max_size=3).map(tuple)
        return st.tuples(*(_strategy(a) for a in args))
    if tp is Layout:
        entry = st.builds(
            TensorEntry,
            key=st.text(max_size=6),
            dtype=st.sampled_from(["F32", "BF16", "I64"]),
            shape=st.lists(st.integers(0, 9), max_size=3).map(tuple),
            offset=st.integers(0, 99),
            nbytes=st.integers(0, 99),
        )
        return st.builds(
            Layout, entries=st.lists(entry, max_size=2).map(tuple), nbytes=st.integers(0, 999)
        )
    if tp is PartInfo:
        return st.builds(PartInfo, rank=st.integers(0, 9), data=st.text(max_size=4),
                         json=st.text(max_size=4), nbytes=st.integers(0, 99),
                         base=st.none() | st.integers(0, 9))  # fmt: skip
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return _message(tp)
    raise AssertionError(f"no strategy for {tp!r}")


def _message(cls: type[Any]) -> st.SearchStrategy[Any]:
    hints = get_type_hints(cls, include_extras=False)
    fields = {f: _strategy(hints[f]) for f in cls.__struct_fields__}
    return st.fixed_dictionaries(fields).map(lambda kw: cls(**kw))


def _channels_of(cls: type[Any]) -> list[Any]:
    return [u for u in p.CHANNELS.values() if cls in p.members(u)]


@pytest.mark.parametrize("cls", ALL, ids=lambda c: p.tag_of(c))
@settings(max_examples=25, deadline=None)
@given(data=st.data(), gen=st.integers(-1, 2**31))
def test_every_message_round_trips_each_channel_that_carries_it(
    cls: type[p.Message], data: st.DataObject, gen: int
) -> None:
    msg = data.draw(_message(cls))
    for union in _channels_of(cls):
        env = p.Codec(union).decode(p.Codec.encode(msg, gen))
        assert env == p.Envelope(gen, msg)


def test_a_name_means_one_thing() -> None:
    tags = [p.tag_of(cls) for cls in ALL]
    assert len(tags) == len(set(tags)), sorted(t for t in tags if tags.count(t) > 1)
    subclasses = {c for c in _all_subclasses(p.Message) if c.__module__ == p.__name__}
    orphans = sorted(c.__name__ for c in subclasses - set(ALL))
    assert not orphans, f"messages no channel carries: {orphans}"


def _all_subclasses(cls: type[Any]) -> set[type[Any]]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub, *_all_subclasses(sub)}
    return out


def test_calls_are_requests_a_worker_waits_for() -> None:
    calls = sorted(p.tag_of(c) for c in ALL if c.call and not _store(c))
    assert calls == [
        "alloc", "corrupt", "fatal", "finished", "inject_fired", "plan", "raised", "slot"
    ]  # fmt: skip
    assert all(c in get_args(p.WorkerToAgent) for c in ALL if c.call and not _store(c))
    assert all(c.call for c in get_args(p.WorkerToStore)), "every store operation is a call"


def _store(cls: Any) -> bool:
    return cls in get_args(p.WorkerToStore)


@pytest.mark.parametrize(
    "raw, says",
    [
        (msgspec.msgpack.encode([0, {"op": "held", "tier": "0", "step": 1}]), "tier"),
        (msgspec.msgpack.encode([0, {"op": "held", "step": 1}]), "tier"),
        (msgspec.msgpack.encode([0, {"op": "nonsense"}]), "nonsense"),
        (msgspec.msgpack.encode({"gen": 0}), "array"),
        (b"\xc1", "invalid"),
    ],
)
def test_bad_bytes_are_refused_naming_what_is_wrong(raw: bytes, says: str) -> None:
    with pytest.raises(p.ProtocolError, match=says):
        p.Codec(p.AgentToCoordinator).decode(raw)


def test_the_door_drops_what_an_ended_generation_sent_and_counts_it() -> None:
    door = p.Door()
    door.generation = 3
    assert door.admit(p.Envelope(3, p.Held(tier=0, step=5)))
    assert not door.admit(p.Envelope(2, p.Held(tier=0, step=5)))
    assert not door.admit(p.Envelope(1, p.Held(tier=1, step=4)))
    stopped = p.Stopped(holdings={}, peer={}, peer_deltas={}, verified=[])
    assert not door.admit(p.Envelope(2, stopped))
    assert door.admit(p.Envelope(-1, p.Beat())), "a host-level message has no generation"
    assert door.admit(p.Envelope(0, p.Ready(replica=("h", 1), workers=[])))
    assert door.take_counts() == {"held": 2, "stopped": 1}
    assert door.take_counts() == {}


def test_an_envelope_is_small() -> None:
    """What a node sends per step: a few dozen bytes, not a JSON object per rank."""
    assert len(p.Codec.encode(p.Held(tier=1, step=123_456), 7)) < 32
    progress = p.Progress(step=123_456, stall=0.001, gate=0.0005)  # rank 0's node's
    assert len(p.Codec.encode(progress, 7)) < 56


def test_the_architecture_page_holds_the_protocol_and_state_tables_of_the_code() -> None:
    """``docs/architecture.md`` has one row per message (channels, fields, who sends and
    handles it) and every transition table, as ``python -m tierswap.control.doc`` makes
    them: change a message and the page must change with it."""
    from pathlib import Path

    from tierswap.control.doc import protocol_table, state_tables

    doc = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    assert protocol_table() in doc, "regenerate the protocol table: python -m tierswap.control.doc"
    assert state_tables() in doc, "regenerate the state tables: python -m tierswap.control.doc"
    missing = [p.tag_of(c) for c in ALL if f"`{p.tag_of(c)}`" not in doc]
    assert not missing, f"messages the architecture's protocol table lacks: {missing}"


def test_the_scale_bench_drives_the_real_core_at_a_tiny_size(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``tierswap bench control-plane`` runs here at 8 and 16 nodes, so it cannot rot: every
    step commits in both tiers, a node's loss starts the next generation on every node."""
    from tierswap.bench import controlplane

    res = controlplane.run([8, 16], ranks_per_node=2, steps=4)
    for r, nodes in zip(res["runs"], (8, 16), strict=True):
        assert r["nodes"] == nodes and r["ranks"] == 2 * nodes
        assert r["messages_per_step"] == 3 * nodes, "a node sends 3 messages per step"
        assert 0 < r["step_cpu_s"]["median"] < 1 and 0 < r["failover_s"] < 5
    assert res["codec"]["msgpack_us"] > 0
    controlplane.report(res)
    assert "failure->start" in capsys.readouterr().out
