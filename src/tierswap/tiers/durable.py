"""Tier 2: durable checkpoints, one folder per step, on any fsspec URL.

::

    ROOT/step-000000100/rank-00003.safetensors   the tensors of rank 3 (plain safetensors)
    ROOT/step-000000110/rank-00003.delta         or: a delta against the same rank's part
                                                 of a base step (``--persist-deltas``)
    ROOT/step-000000100/rank-00003.json          its layout, JSON tree and data checksum
                                                 (and for a delta: its base step, checksum)
    ROOT/step-000000100/COMMIT                   written last: world size, every part's checksums
    ROOT/LATEST                                  newest committed step (a hint; COMMIT is the truth)

A delta part (:mod:`tierswap.delta`) encodes the safetensors data section of the rank's
part against the data section of its base's part, a full part of an older committed step;
deltas never chain. A step whose base is gone is committed but not *restorable*: listed
as such, never planned, and retention never deletes a base a kept step needs.

Every file is written to a temporary name, synced and renamed, so a crash leaves either
the old file or the new one. Readers trust a step only once its COMMIT is there, and never
unpickle anything: the format is safetensors and JSON.

The temporary-name writes and exact reads live in :mod:`tierswap.tiers.files`; what a
root holds as a whole (listing its steps, verifying, retention) in
:mod:`tierswap.tiers.catalog`; export to one plain safetensors file in
:mod:`tierswap.tiers.export`. Both build on this module, which knows nothing of them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import posixpath
import re
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tierswap import delta
from tierswap.checksum import checksum_bytes, checksum_chunks
from tierswap.errors import CorruptPartError
from tierswap.layout import Layout
from tierswap.shm import populated
from tierswap.tiers.files import (
    Reader,
    fsync_dir,
    is_folder,
    is_local,
    open_read,
    parse_json,
    read_exact,
    read_small,
    regular_file,
    stream,
    url_fs,
    write_atomic,
)

if TYPE_CHECKING:
    from tierswap.state import Flat

log = logging.getLogger(__name__)

FORMAT = 1
ST_FORMAT = "tierswap-1"
_MAX_HEADER = 100 << 20  # the safetensors library's own limit
MAX_JSON = 256 << 20
"""The largest part .json read (its tree is the state's non-tensor values)."""
MAX_COMMIT = 64 << 20
"""The largest COMMIT read (a few hundred bytes per rank)."""
STEP_RE = re.compile(r"step-(\d{9,})")
PART_RE = re.compile(r"rank-(\d{5,})\.(safetensors|delta)")


@dataclass(frozen=True, slots=True)
class PartInfo:
    """Checksums of one rank's part, as recorded in COMMIT."""

    rank: int
    data: str
    """Checksum of the tensor data (the safetensors data section)."""
    json: str
    """Checksum of the bytes of the rank's .json file."""
    nbytes: int
    """Bytes of tensor data."""
    base: int | None = None
    """For a delta part: the step whose full part of this rank it is made against."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"data": self.data, "json": self.json, "bytes": self.nbytes}
        return out if self.base is None else {**out, "base": self.base}

    @staticmethod
    def from_json(rank: int, d: Mapping[str, Any]) -> PartInfo:
        base = None if d.get("base") is None else int(d["base"])
        return PartInfo(rank, str(d["data"]), str(d["json"]), int(d["bytes"]), base)


# ---------------------------------------------------------------- paths


def step_dir(base: str, step: int) -> str:
    return f"{base}/step-{step:09d}"


def _new_step_dir(root: str, step: int) -> tuple[Any, str]:
    """The filesystem and folder of ``step`` under ``root``, created if missing. Raises
    OSError if the name is taken by anything but a folder of the root's own (a symbolic
    link above all: tier 2 writes nothing outside its root)."""
    fs, base = url_fs(root)
    folder = step_dir(base, step)
    if fs.exists(folder) or (is_local(fs) and os.path.islink(folder)):
        if not is_folder(fs, folder):
            raise OSError(
                f"{folder} is not a folder of {root} (a symbolic link, or a file): tier 2 "
                "writes only inside its root; remove it or use another --persist"
            )
    else:
        fs.makedirs(folder, exist_ok=True)
    return fs, folder


def _part(rank: int, ext: str) -> str:
    return f"rank-{rank:05d}.{ext}"


# ---------------------------------------------------------------- one rank's part


def tensor_names(layout: Layout) -> list[str]:
    """Safetensors names of the layout's tensors: their keys, made unique if they clash."""
    names: list[str] = []
    seen = {"__metadata__"}
    for i, e in enumerate(layout.entries):
        name = e.key if e.key not in seen else f"{e.key}#{i}"
        seen.add(name)
        names.append(name)
    return names


def _file_layout(layout: Layout) -> Layout:
    """The layout with offsets of a safetensors data section: contiguous, no padding."""
    entries, offset = [], 0
    for e in layout.entries:
        entries.append(dataclasses.replace(e, offset=offset))
        offset += e.nbytes
    return Layout(entries=tuple(entries), nbytes=offset)


def _header(flayout: Layout, step: int, rank: int) -> dict[str, Any]:
    header: dict[str, Any] = {
        "__metadata__": {"format": ST_FORMAT, "step": str(step), "rank": str(rank)}
    }
    for name, e in zip(tensor_names(flayout), flayout.entries, strict=True):
        header[name] = {
            "dtype": e.dtype,
            "shape": list(e.shape),
            "data_offsets": [e.offset, e.offset + e.nbytes],
        }
    return header


def _header_bytes(header: Mapping[str, Any]) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # pad like the safetensors writer does
    return struct.pack("<Q", len(raw)) + raw


def write_part(
    root: str,
    step: int,
    rank: int,
    world_size: int,
    layout: Layout,
    tree: dict[str, Any],
    buf: memoryview,
    data_checksum: str,
) -> PartInfo:
    """Write one rank's tensors (from ``buf``, laid out by ``layout``) and its JSON file.

    ``data_checksum`` is ``checksum_chunks(layout.chunks(buf))``, known from the slot.
    """
    fs, folder = _new_step_dir(root, step)
    mv = memoryview(buf).cast("B")
    if len(mv) < layout.nbytes:
        raise ValueError(f"buffer of {len(mv)} bytes is smaller than its layout ({layout.nbytes})")
    flayout = _file_layout(layout)
    head = _header_bytes(_header(flayout, step, rank))
    write_atomic(fs, f"{folder}/{_part(rank, 'safetensors')}", [head, *layout.chunks(mv)])
    return _write_meta(fs, folder, step, rank, world_size, flayout, tree, data_checksum, {})


def write_flat(root: str, step: int, rank: int, world_size: int, flat: Flat) -> PartInfo:
    """Write a flattened state as rank ``rank``'s part (laid out, copied and checksummed
    here, not in a tier-0 slot): for tools, benchmarks and tests."""
    from tierswap.state import make_layout, tensor_view  # torch: not in the agent

    layout = make_layout(flat)
    buf = memoryview(bytearray(layout.nbytes))
    for e, t in zip(layout.entries, flat.tensors, strict=True):
        tensor_view(buf, e).copy_(t)
    checksum = checksum_chunks(layout.chunks(buf))
    return write_part(root, step, rank, world_size, layout, flat.tree, buf, checksum)


def write_delta_part(
    root: str,
    step: int,
    rank: int,
    world_size: int,
    layout: Layout,
    tree: dict[str, Any],
    data_checksum: str,
    base_step: int,
    delta_bytes: bytes,
    base_checksum: str,
) -> PartInfo:
    """Write one rank's part as ``delta_bytes``: the delta of its data section (``layout``'s
    tensors, contiguous) against the data section of its full part of ``base_step``, whose
    data checksum is ``base_checksum``."""
    if base_step >= step:
        raise ValueError(f"step {step}: a delta's base must be an older step, not {base_step}")
    fs, folder = _new_step_dir(root, step)
    write_atomic(fs, f"{folder}/{_part(rank, 'delta')}", [delta_bytes])
    extra = {
        "base": base_step,
        "base_checksum": base_checksum,
        "delta_checksum": checksum_bytes(delta_bytes),
    }
    flayout = _file_layout(layout)
    return _write_meta(fs, folder, step, rank, world_size, flayout, tree, data_checksum, extra)


def remove_part(root: str, step: int, rank: int) -> None:
    """Delete one rank's files of ``step`` (and the step's folder once empty)."""
    fs, base = url_fs(root)
    folder = step_dir(base, step)
    for ext in ("json", "safetensors", "delta"):  # the json first: no half part is listed
        path = f"{folder}/{_part(rank, ext)}"
        if fs.exists(path):
            fs.rm(path)
    if fs.exists(folder) and not fs.ls(folder, detail=False):
        fs.rmdir(folder)


def _write_meta(
    fs: Any,
    folder: str,
    step: int,
    rank: int,
    world_size: int,
    flayout: Layout,
    tree: dict[str, Any],
    data_checksum: str,
    extra: Mapping[str, Any],
) -> PartInfo:
    meta = {
        "format": FORMAT,
        "step": step,
        "rank": rank,
        "world_size": world_size,
        "layout": flayout.to_json(),
        "tree": tree,
        "data_checksum": data_checksum,
        "nbytes": flayout.nbytes,
        **extra,
    }
    raw = json.dumps(meta, allow_nan=False).encode()
    write_atomic(fs, f"{folder}/{_part(rank, 'json')}", [raw])
    return PartInfo(rank, data_checksum, checksum_bytes(raw), flayout.nbytes, extra.get("base"))


def _read_meta(
    fs: Any, path: str, step: int, rank: int, expected: PartInfo | None
) -> tuple[Layout, dict[str, Any], str, dict[str, Any]]:
    """The layout, tree and data checksum in a rank's .json file, and the whole file."""
    raw = read_small(fs, path, MAX_JSON)
    if expected is not None and checksum_bytes(raw) != expected.json:
        raise CorruptPartError(path, "checksum differs from the one in COMMIT")
    meta = parse_json(path, raw)
    try:
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"not a tierswap part (format {FORMAT} expected)")
        if meta.get("step") != step or meta.get("rank") != rank:
            raise ValueError(f"written for step {meta.get('step')} rank {meta.get('rank')}")
        layout = Layout.from_json(meta["layout"])
        tree = meta["tree"]
        if not isinstance(tree, dict):
            raise ValueError("tree is not a JSON object")
        if "base" in meta and not isinstance(meta["base"], int):
            raise ValueError("base is not a step number")
        return layout, tree, str(meta["data_checksum"]), meta
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptPartError(path, f"bad part json: {e}") from e


def _check_header(path: str, f: Reader, size: int, layout: Layout) -> None:
    """Read the safetensors header at ``f`` and check it describes ``layout``."""
    head = bytearray(8)
    read_exact(f, memoryview(head))
    (n,) = struct.unpack("<Q", head)
    if n > min(_MAX_HEADER, size - 8):
        raise CorruptPartError(path, f"header length {n} does not fit the file ({size} bytes)")
    raw = bytearray(n)
    read_exact(f, memoryview(raw))
    header = parse_json(path, bytes(raw))
    if not isinstance(header, dict):
        raise CorruptPartError(path, "header is not a JSON object")
    header.pop("__metadata__", None)
    want = _header(layout, 0, 0)
    del want["__metadata__"]
    if header != want:
        raise CorruptPartError(path, "header does not match the layout in the part's json")
    if size != 8 + n + layout.nbytes:
        raise CorruptPartError(
            path,
            f"file is {size} bytes, header and layout say {8 + n + layout.nbytes} (truncated?)",
        )


def _read(
    fs: Any, base: str, step: int, rank: int, expected: PartInfo | None, keep: bool
) -> tuple[Layout, dict[str, Any], memoryview]:
    """Read and check one part; without ``keep`` only check it (the data is streamed)."""
    folder = step_dir(base, step)
    meta_path = f"{folder}/{_part(rank, 'json')}"
    layout, tree, want, meta = _read_meta(fs, meta_path, step, rank, expected)
    if layout != _file_layout(layout):
        raise CorruptPartError(meta_path, "layout is not contiguous")
    if "base" in meta or (expected is not None and expected.base is not None):
        data = _read_delta(fs, base, step, rank, layout, meta, expected)
        got = checksum_bytes(data)
        path = f"{folder}/{_part(rank, 'delta')}"
    else:
        path = f"{folder}/{_part(rank, 'safetensors')}"
        # the file's size bounds what its json may claim: checked before any allocation
        size = regular_file(fs, path, 8 + _MAX_HEADER + layout.nbytes)
        if size < 8 + layout.nbytes:
            raise CorruptPartError(
                path, f"is {size:,} bytes, less than the {layout.nbytes:,} its json claims"
            )
        try:
            data = populated(layout.nbytes if keep else 0)
            with open_read(fs, path) as f:
                _check_header(path, f, size, layout)
                if keep:
                    read_exact(f, data)
                    got = checksum_bytes(data)
                else:
                    got = checksum_chunks(stream(f, layout.nbytes))
        except FileNotFoundError:
            raise CorruptPartError(path, "missing") from None
        except EOFError:
            raise CorruptPartError(path, "ends early (truncated?)") from None
        except (OSError, MemoryError) as e:
            raise CorruptPartError(path, f"cannot read: {type(e).__name__}: {e}") from e
    if got != want:
        raise CorruptPartError(path, "data checksum mismatch (corrupt or truncated?)")
    if expected is not None and got != expected.data:
        raise CorruptPartError(path, "data checksum differs from the one in COMMIT")
    return layout, tree, data


def _read_delta(
    fs: Any,
    root: str,
    step: int,
    rank: int,
    layout: Layout,
    meta: Mapping[str, Any],
    expected: PartInfo | None,
) -> memoryview:
    """A delta part's data section, rebuilt from its base's full part (checked on the way)."""
    path = f"{step_dir(root, step)}/{_part(rank, 'delta')}"
    base_step = meta.get("base")
    if expected is not None and expected.base != base_step:
        raise CorruptPartError(path, f"base {base_step} differs from COMMIT's {expected.base}")
    if not isinstance(base_step, int):
        raise CorruptPartError(path, "a delta part without a base step")
    try:
        _, base_parts = _read_commit(fs, root, base_step)
    except CorruptPartError as e:
        raise CorruptPartError(path, f"its base, step {base_step}, is gone: {e.why}") from e
    bpart = base_parts.get(rank)
    if bpart is None or bpart.base is not None:
        raise CorruptPartError(path, f"step {base_step} holds no full part of rank {rank}")
    if bpart.data != meta.get("base_checksum"):
        raise CorruptPartError(path, f"step {base_step} was rewritten: not the base it was made on")
    blayout, _, bdata = _read(fs, root, base_step, rank, bpart, keep=True)
    if blayout != layout:
        raise CorruptPartError(path, f"the layout differs from its base's (step {base_step})")
    # the base's file bounds the layout, and the layout what a delta of it may take
    raw = read_small(fs, path, 2 * layout.nbytes + (1 << 20))
    if checksum_bytes(raw) != meta.get("delta_checksum"):
        raise CorruptPartError(path, "delta checksum mismatch (corrupt or truncated?)")
    out = populated(layout.nbytes)
    delta.decode_into(bdata, delta.Delta.from_bytes(raw, where=path), out, where=path)
    return out


def read_part(
    root: str, step: int, rank: int, expected: PartInfo | None = None
) -> tuple[Layout, dict[str, Any], memoryview]:
    """One rank's layout (offsets into the returned buffer), tree and tensor bytes.

    Raises CorruptPartError if the part is missing, truncated, corrupt or does not match
    ``expected`` (its entry in COMMIT).
    """
    fs, base = url_fs(root)
    return _read(fs, base, step, rank, expected, keep=True)


def check_part(fs: Any, base: str, step: int, rank: int, expected: PartInfo) -> None:
    """Read one rank's part of ``step`` under ``base`` and check it against ``expected``
    without keeping its bytes (CorruptPartError naming the file and what is wrong)."""
    _read(fs, base, step, rank, expected, keep=False)


def read_meta(
    root: str, step: int, rank: int, expected: PartInfo | None = None
) -> tuple[Layout, dict[str, Any]]:
    """One rank's layout and tree, without its tensor bytes (checked against ``expected``,
    its entry in COMMIT, as :func:`read_part` does)."""
    fs, base = url_fs(root)
    layout, tree, _, _ = _read_meta(fs, f"{step_dir(base, step)}/{_part(rank, 'json')}", step,
                                    rank, expected)  # fmt: skip
    return layout, tree


# ---------------------------------------------------------------- commits and steps


def write_commit(
    root: str,
    step: int,
    world_size: int,
    parts: Mapping[int, PartInfo],
    job: str | None = None,
) -> None:
    """Mark ``step`` complete: write COMMIT (all parts' checksums, and the name of the job
    that wrote it), then LATEST."""
    ranks = set(range(world_size))
    if set(parts) != ranks or any(p.rank != r for r, p in parts.items()):
        raise ValueError(
            f"COMMIT of step {step} needs parts of ranks 0..{world_size - 1}; missing "
            f"{sorted(ranks - set(parts))}, unexpected {sorted(set(parts) - ranks)}"
        )
    body = {
        "format": FORMAT,
        "step": step,
        "world_size": world_size,
        "time": time.time(),
        "parts": {str(r): parts[r].to_json() for r in sorted(parts)},
        **({"job": job} if job is not None else {}),
    }
    fs, folder = _new_step_dir(root, step)  # refuses a folder that is not the root's own
    base = posixpath.dirname(folder)
    write_atomic(fs, f"{folder}/COMMIT", [json.dumps(body).encode()])
    if is_local(fs):
        fsync_dir(base)  # the step folder's own entry
    latest = _read_latest(fs, base)
    if latest is None or latest < step:
        write_atomic(fs, f"{base}/LATEST", [f"{step}\n".encode()])


def _read_latest(fs: Any, base: str) -> int | None:
    path = f"{base}/LATEST"
    try:
        return int(read_small(fs, path, 64).decode().strip())
    except CorruptPartError as e:
        if e.why != "missing":
            log.warning("ignoring %s: %s; COMMIT files are the truth", path, e.why)
        return None
    except ValueError as e:
        log.warning("ignoring unreadable %s (%s); COMMIT files are the truth", path, e)
        return None


def _read_commit(fs: Any, base: str, step: int) -> tuple[int, dict[int, PartInfo]]:
    world_size, parts, _ = read_commit_job(fs, base, step)
    return world_size, parts


def read_commit_job(fs: Any, base: str, step: int) -> tuple[int, dict[int, PartInfo], str | None]:
    """World size, parts, and the job that wrote it (None for a COMMIT that names none)."""
    path = f"{step_dir(base, step)}/COMMIT"
    raw = read_small(fs, path, MAX_COMMIT)
    body = parse_json(path, raw)
    try:
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise ValueError(f"not a tierswap COMMIT (format {FORMAT} expected)")
        if body["step"] != step:
            raise ValueError(f"written for step {body['step']}")
        world_size = int(body["world_size"])
        parts = {int(r): PartInfo.from_json(int(r), p) for r, p in body["parts"].items()}
        if world_size < 1 or set(parts) != set(range(world_size)):
            raise ValueError(f"parts {sorted(parts)} do not cover world size {world_size}")
        job = body.get("job")
        if job is not None and not isinstance(job, str):
            raise ValueError("job is not a name")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptPartError(path, f"bad COMMIT: {e}") from e
    return world_size, parts, job


def read_commit(root: str, step: int) -> tuple[int, dict[int, PartInfo]]:
    """The world size and parts recorded in ``step``'s COMMIT (CorruptPartError if none)."""
    fs, base = url_fs(root)
    return _read_commit(fs, base, step)
