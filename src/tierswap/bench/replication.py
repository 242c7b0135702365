"""``tierswap bench replication``: what tier 1 costs, and what it buys when a node is lost.

One run, one state (Linear layers and an AdamW that has taken a step, ``--size-mib`` MiB),
flattened into a replica as a rank's snapshot is, against a real
:class:`~tierswap.tiers.peer.ReplicaServer` in a process of its own
(:mod:`tierswap.bench.peerserver`) on loopback:

1. replication throughput: ``peer.push`` of the replica (one request, the bytes, the
   server's checksum, its answer) against a plain TCP stream of as many bytes between the
   same two processes (``sendall``, ``recv_into`` a reused buffer, a one-byte answer),
   and ``peer.push`` over TLS (what ``--tls auto`` does between hosts), in alternating
   rounds; each with the CPU it cost the sender (this thread) and the receiver (the
   server's process), per GiB, and beside them one xxh3 pass over the replica (what the
   receiver's checksum costs): what tier 1 costs beyond the bytes' own transfer;
2. restore of a lost rank: ``peer.fetch`` of the replica (checksum verified) and
   ``state.load`` of it into the live state, against ``durable.read_part`` of the same
   snapshot from a local disk with the part's pages dropped from the page cache first (a
   replacement node starts cold) and the same load; also from a warm cache, for honesty.

The first round of each measurement is warm-up (slot allocation, page touching), left out.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import secrets
import socket
import struct
import tempfile
import time
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path
from typing import Any

import torch

from tierswap.bench import pagecache
from tierswap.bench.common import WARMUP, Sample, interleave, run_and_report
from tierswap.bench.measure import make_state
from tierswap.bench.peerserver import NSLOTS, PeerServer
from tierswap.checksum import checksum_chunks
from tierswap.state import Layout, flatten, load, make_layout, tensor_view
from tierswap.tiers import durable, peer
from tierswap.wire import Channel

DEFAULT_SIZE_MIB = 256
TARGETS: dict[str, tuple[str, float]] = {
    "push/stream": (">=", 0.7),
    "restore durable_cold/peer": (">=", 5.0),
}
RANK = 0


class _Replica:
    """A rank's snapshot of ``state`` as its agent holds and sends it."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        flat = flatten(state)
        self.tree = flat.tree
        self.layout = make_layout(flat)
        self.buf = bytearray(self.layout.nbytes)
        self.view = memoryview(self.buf)
        for e, t in zip(self.layout.entries, flat.tensors, strict=True):
            tensor_view(self.view, e).copy_(t)
        self.checksum = checksum_chunks(self.layout.chunks(self.view))


# ---------------------------------------------------------------- 1. replication


def _timed(server: PeerServer, nbytes: int, transfer: Callable[[], None]) -> Sample:
    """One transfer's speed and its CPU per GiB at both ends: the sender's is this
    thread's, the receiver's the server process's (its other threads idle meanwhile)."""
    far, near = server.cpu_s(), time.thread_time()
    t0 = time.monotonic()
    transfer()
    seconds = time.monotonic() - t0
    sent, received = time.thread_time() - near, server.cpu_s() - far
    gib = nbytes / 2**30
    return {"bps": nbytes / seconds, "sender_cpu_s_per_gib": sent / gib,
            "receiver_cpu_s_per_gib": received / gib}  # fmt: skip


def _push_once(server: PeerServer, chan: Channel, replica: _Replica, steps: list[int]) -> Sample:
    steps.append(steps[-1] + 1)
    r = replica

    def push() -> None:
        if not peer.push(chan, RANK, steps[-1], r.layout, r.tree, r.checksum, r.view):
            raise RuntimeError(f"the bench peer server refused step {steps[-1]}")

    return _timed(server, r.layout.nbytes, push)


def _stream_once(server: PeerServer, sock: socket.socket, data: memoryview) -> Sample:
    def stream() -> None:
        sock.sendall(struct.pack("<Q", len(data)))
        sock.sendall(data)
        if sock.recv(1) != b"k":
            raise EOFError("the bench sink closed the stream")

    return _timed(server, len(data), stream)


def _checksum_once(replica: _Replica) -> Sample:
    """One xxh3 pass over the replica, as the receiver checks it: its CPU per GiB."""
    t0 = time.thread_time()
    if checksum_chunks(replica.layout.chunks(replica.view)) != replica.checksum:
        raise RuntimeError("the bench's replica changed under it")
    return {"cpu_s_per_gib": (time.thread_time() - t0) / (replica.layout.nbytes / 2**30)}


def _bench_replication(
    server: PeerServer, replica: _Replica, repeats: int, steps: list[int]
) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        chan = peer.connect(server.replica, server.secret)
        stack.callback(chan.close)
        chan_tls = peer.connect(server.replica_tls, server.secret, "on")
        stack.callback(chan_tls.close)
        sock = stack.enter_context(socket.create_connection(server.stream, timeout=300))
        methods: dict[str, Callable[[], Sample]] = {
            "push": lambda: _push_once(server, chan, replica, steps),
            "push_tls": lambda: _push_once(server, chan_tls, replica, steps),
            "stream": lambda: _stream_once(server, sock, replica.view),
            "checksum": lambda: _checksum_once(replica),
        }
        res = interleave(methods, repeats, lambda: None, alternate=True)
    return {"nbytes": replica.layout.nbytes, **res}


# ---------------------------------------------------------------- 2. restore


def _load(state: MutableMapping[str, Any], layout: Layout, tree: Any, buf: memoryview) -> float:
    t0 = time.monotonic()
    views = [tensor_view(memoryview(buf), e) for e in layout.entries]
    load(state, tree, views, layout, what="the bench's snapshot")
    return time.monotonic() - t0


def _peer_once(server: PeerServer, step: int, state: MutableMapping[str, Any]) -> Sample:
    t0 = time.monotonic()
    layout, tree, buf = peer.fetch(server.replica, server.secret, RANK, step)
    read = time.monotonic() - t0
    loaded = _load(state, layout, tree, buf)
    return {"total": read + loaded, "read": read, "load": loaded}


def _durable_once(
    root: Path, step: int, info: durable.PartInfo, state: MutableMapping[str, Any], cold: bool
) -> Sample:
    files = sorted(root.glob(f"step-*/rank-{RANK:05d}.*"))
    if cold:
        for f in files:
            pagecache.drop(f)
    resident = sum(pagecache.resident(f) * f.stat().st_size for f in files)
    t0 = time.monotonic()
    layout, tree, buf = durable.read_part(str(root), step, RANK, info)
    read = time.monotonic() - t0
    loaded = _load(state, layout, tree, buf)
    total_bytes = sum(f.stat().st_size for f in files)
    return {"total": read + loaded, "read": read, "load": loaded,
            "resident": resident / total_bytes}  # fmt: skip


def _bench_restore(
    server: PeerServer,
    replica: _Replica,
    state: MutableMapping[str, Any],
    root: Path,
    repeats: int,
    step: int,
) -> dict[str, Any]:
    r = replica
    info = durable.write_part(str(root), step, RANK, 1, r.layout, r.tree, r.view, r.checksum)
    methods: dict[str, Callable[[], Sample]] = {
        "peer": lambda: _peer_once(server, step, state),
        "durable_cold": lambda: _durable_once(root, step, info, state, cold=True),
        "durable_warm": lambda: _durable_once(root, step, info, state, cold=False),
    }
    res = interleave(methods, repeats, lambda: None, alternate=True)
    return {"nbytes": r.layout.nbytes, "part_bytes": info.nbytes, **res}


# ---------------------------------------------------------------- the run


def ratios(res: Mapping[str, Any]) -> dict[str, float]:
    """Replication throughput over the plain stream's; restore speedups of the peer."""
    rep, rest = res["replication"], res["restore"]
    peer_s = rest["peer"]["total"]["median"]
    out = {
        "push/stream": rep["push"]["bps"]["median"] / rep["stream"]["bps"]["median"],
        "push_tls/push": rep["push_tls"]["bps"]["median"] / rep["push"]["bps"]["median"],
        "restore durable_cold/peer": rest["durable_cold"]["total"]["median"] / peer_s,
        "restore durable_warm/peer": rest["durable_warm"]["total"]["median"] / peer_s,
    }
    if "sender_cpu_s_per_gib" in rep["push"]:  # (older runs did not measure it)
        out["CPU push/stream"] = cpu(rep, "push") / cpu(rep, "stream")
    return out


def cpu(rep: Mapping[str, Any], method: str) -> float:
    """A transfer's CPU seconds per GiB, both ends, medians."""
    m = rep[method]
    return float(m["sender_cpu_s_per_gib"]["median"] + m["receiver_cpu_s_per_gib"]["median"])


def run(size_mib: int, repeats: int) -> dict[str, Any]:
    """Both measurements, then the ratios; the server process, its segments and the temp
    dir are gone when it returns."""
    job_id = f"bench-{secrets.token_hex(4)}"
    machine = {"cpu_count": os.cpu_count(), "torch": torch.__version__,
               "python": platform.python_version(), "platform": platform.platform()}  # fmt: skip
    state = make_state(size_mib)
    replica = _Replica(state)
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tierswap-bench-")))
        server = PeerServer(job_id)
        stack.callback(server.close)
        steps = [0]
        res = {"replication": _bench_replication(server, replica, repeats, steps)}
        res["restore"] = _bench_restore(server, replica, state, tmp / "durable", repeats, steps[-1])
    config = {"size_mib": size_mib, "repeats": repeats, "warmup": WARMUP, "slots": NSLOTS,
              "job_id": job_id, "server_pid": server.proc.pid, "disk_dir": str(tmp),
              "filesystem": pagecache.filesystem(tmp.parent)}  # fmt: skip
    return {"machine": machine, "config": config, **res, "ratios": ratios(res)}


# ---------------------------------------------------------------- the report

_ROWS = (  # section, measure, path to its stats, unit
    ("replication", "peer.push: request, bytes, server checksum", "replication/push/bps", "GiB/s"),
    ("", "peer.push over TLS (--tls auto off loopback)", "replication/push_tls/bps", "GiB/s"),
    ("", "plain TCP stream: sendall, recv_into", "replication/stream/bps", "GiB/s"),
    ("", "CPU, peer.push: sender", "replication/push/sender_cpu_s_per_gib", "CPU-s/GiB"),
    ("", "  receiver, checksum included", "replication/push/receiver_cpu_s_per_gib", "CPU-s/GiB"),
    ("", "CPU, over TLS: sender", "replication/push_tls/sender_cpu_s_per_gib", "CPU-s/GiB"),
    ("", "  receiver", "replication/push_tls/receiver_cpu_s_per_gib", "CPU-s/GiB"),
    ("", "CPU, plain TCP stream: sender", "replication/stream/sender_cpu_s_per_gib", "CPU-s/GiB"),
    ("", "  receiver", "replication/stream/receiver_cpu_s_per_gib", "CPU-s/GiB"),
    ("", "CPU, one xxh3 pass over the replica", "replication/checksum/cpu_s_per_gib", "CPU-s/GiB"),
    ("restore", "peer.fetch + load", "restore/peer/total", "ms"),
    ("", "  fetch, checksum verified", "restore/peer/read", "ms"),
    ("", "  load into the live state", "restore/peer/load", "ms"),
    ("", "durable.read_part + load, cold cache", "restore/durable_cold/total", "ms"),
    ("", "  read_part, checksum verified", "restore/durable_cold/read", "ms"),
    ("", "  load into the live state", "restore/durable_cold/load", "ms"),
    ("", "durable.read_part + load, warm cache", "restore/durable_warm/total", "ms"),
    ("", "  read_part, checksum verified", "restore/durable_warm/read", "ms"),
)


def _cells(stats: Mapping[str, Any], unit: str) -> tuple[str, str]:
    scale = {"ms": 1e3, "GiB/s": 1 / (1 << 30)}.get(unit, 1.0)
    lo, mid, hi = (scale * stats[k] for k in ("min", "median", "max"))
    digits = {"ms": 1, "GiB/s": 2}.get(unit, 3)
    return f"{mid:.{digits}f} {unit}", f"{lo:.{digits}f} – {hi:.{digits}f}"


def _at(res: Mapping[str, Any], path: str) -> Any:
    """The node at ``path``, or None where the run did not measure it."""
    node: Any = res
    for part in path.split("/"):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _ratio(name: str, value: float) -> tuple[str, str, str, str]:
    op, goal = TARGETS.get(name, ("", 0.0))
    speedup = name.startswith(("restore", "CPU"))
    digits = 2 if name.startswith("CPU") else 1
    shown = f"{value:.{digits}f} x" if speedup else f"{100 * value:.1f} %"
    target = (f"{op} {goal:g} x" if speedup else f"{op} {100 * goal:g} %") if op else ""
    met = value <= goal if op == "<=" else value >= goal
    return name, shown, target, ("yes" if met else "NO") if op else ""


def report(res: Mapping[str, Any]) -> None:
    """Print the measurements and the ratios as two tables, and what "cold" means."""
    from rich.console import Console
    from rich.table import Table

    m, c, rest = res["machine"], res["config"], res["restore"]
    title = (f"tierswap bench replication: {res['replication']['nbytes'] / 2**20:.0f} MiB "
             f"replica, {c['repeats']} repeats (+{c['warmup']} warm-up), {m['cpu_count']} "
             f"CPUs, loopback TCP, torch {m['torch']}")  # fmt: skip
    table = Table("section", "measure", "median", "min – max", title=title)
    for section, measure, path, unit in _ROWS:
        if (stats := _at(res, path)) is not None:  # (older runs measured less)
            table.add_row(section, measure, *_cells(stats, unit))
    ratios = Table("ratio", "median", "target", "met")
    for name, value in res["ratios"].items():
        ratios.add_row(*_ratio(name, value))
    left = rest["durable_cold"]["resident"]["max"]
    note = (f"Cold cache: before each cold read the part's pages were dropped from this "
            f"kernel's page cache (at most {100 * left:.0f} % still resident), as on a "
            f"replacement node; caches below the kernel (the disk's, a hypervisor's) were "
            f"not. Tier 2 on {c['filesystem']} in {c['disk_dir']}.")  # fmt: skip
    if c["filesystem"] == "tmpfs":
        note += " That is memory, not a disk: set TMPDIR to a disk to measure one."
    Console().print(table, ratios, note)


def main(args: argparse.Namespace) -> int:
    """``tierswap bench replication [--size-mib M] [--repeats N] [--json PATH]``."""
    return run_and_report(args, DEFAULT_SIZE_MIB, run, report)
