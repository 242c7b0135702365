"""``tierswap run --nnodes N --rdzv-endpoint HOST:PORT``: one launcher per host, as with
torchrun.

Every host runs the same line. The launcher on the host that holds the endpoint's address
(as torchrun's c10d store does) runs the coordinator there, listening on the endpoint, and
also serves a node like any other host; every other launcher becomes its host's agent and
connects to the endpoint, waiting for it to come up. Hosts become nodes 0..N-1 in the order
they join (``--node-rank`` pins one); hosts beyond N, or started with ``--spare``, park as
spares. Every host needs the job's secret (``--secret-file`` or ``TIERSWAP_SECRET``): it
keys the handshake of every connection, and a host without it is refused.
"""

from __future__ import annotations

import errno
import hashlib
import json
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

from tierswap.cluster.address import interface_of
from tierswap.cluster.template import TEMPLATE_ENV, TEMPLATE_PID_ENV
from tierswap.errors import UsageError
from tierswap.wire import Listener

DEFAULT_PORT = 29400
"""torchrun's default rendezvous port."""
MIN_SECRET = 16
"""Characters a job secret needs at least."""
LAUNCH_ENV = "TIERSWAP_LAUNCH"
"""How a launcher tells its agent what it was asked (``HostLaunch``, as JSON)."""
JOIN_CPUS_ENV = "TIERSWAP_JOIN_CPUS"
"""A host that joins (``--join``): its own ``--agent-cpus`` and ``--worker-cpus`` (JSON,
null where not given), which its agent pins by instead of the job's."""
KEY_ENV = "TIERSWAP_KEY"
"""The job's key (hex) as the launcher hands it to its agent and the agent to workers."""
MAKE_ONE = "python -c 'import secrets; print(secrets.token_hex(32))' > job.secret"


def job_key(secret: str) -> bytes:
    """The 32-byte key every connection of the job is authenticated with, from the job's
    secret text (the same on every host)."""
    return hashlib.sha256(b"tierswap job secret\x00" + secret.encode()).digest()


def read_secret(secret_file: str | None, environ: Mapping[str, str], what: str) -> str:
    """The job's secret: the contents of ``secret_file`` (stripped), else
    ``TIERSWAP_SECRET``. Never taken from a command line, where ``ps`` would show it."""
    if secret_file is not None:
        try:
            text = Path(secret_file).read_text().strip()
        except (OSError, UnicodeError) as e:
            raise UsageError(f"{what} --secret-file {secret_file}: cannot read it ({e})") from None
        source = f"--secret-file {secret_file}"
    elif environ.get("TIERSWAP_SECRET"):
        text, source = environ["TIERSWAP_SECRET"].strip(), "TIERSWAP_SECRET"
    else:
        raise UsageError(
            f"{what}: the job's secret is needed, the same on every host: give "
            f"--secret-file PATH or set TIERSWAP_SECRET (make one with: {MAKE_ONE})"
        )
    if len(text) < MIN_SECRET:
        raise UsageError(
            f"{what}: the secret in {source} has {len(text)} characters; it needs at least "
            f"{MIN_SECRET} (make one with: {MAKE_ONE})"
        )
    return text


def parse_endpoint(text: str, what: str = "--rdzv-endpoint", wait: float = 0.0) -> tuple[str, int]:
    """``HOST[:PORT]`` as (IPv4 address, port); the port defaults to torchrun's 29400. A
    name that does not resolve yet is looked up again for up to ``wait`` seconds (a
    cluster's DNS may learn the coordinator's name after this host starts)."""
    host, sep, port_text = text.rpartition(":")
    if not sep:
        host, port_text = text, str(DEFAULT_PORT)
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not host or not 0 < port < 65536:
        raise UsageError(f"{what} {text!r}: expected HOST:PORT (a port of 1-65535)")
    unknown = UsageError(
        f"{what} {text!r}: no IPv4 address is known for {host!r}; give the coordinator "
        "host's address or a name every host resolves"
    )
    address = retried(
        lambda: socket.gethostbyname(host), wait, f"{host!r} to resolve ({what})",
        lambda _: unknown, (OSError, UnicodeError),
    )  # fmt: skip
    return address, port


T = TypeVar("T")


def retried(
    attempt: Callable[[], T],
    wait: float,
    waiting_for: str,
    refused: Callable[[Exception], Exception],
    errors: tuple[type[Exception], ...] = (OSError,),
) -> T:
    """``attempt()`` until it gives an answer, tried again for up to ``wait`` seconds (said
    once: a host may start before what it needs, as pods do); past that, the error
    ``refused`` makes of the last failure."""
    deadline, said = time.monotonic() + wait, False
    while True:
        try:
            return attempt()
        except errors as e:
            if time.monotonic() >= deadline:
                raise refused(e) from None
        if not said:
            print(f"tierswap run: waiting for {waiting_for}", flush=True)
            said = True
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


@dataclass(frozen=True, slots=True)
class HostLaunch:
    """What one host's ``tierswap run`` was asked: what its agent says in its hello."""

    nnodes: int
    nproc_per_node: int
    node_rank: int | None = None
    spare: bool = False
    job: str | None = None
    """``--rdzv-id``: hosts of another job are refused."""
    agent_cpus: str | None = None
    worker_cpus: str | None = None
    """This host's own ``--agent-cpus`` and ``--worker-cpus``. CPU numbers are a machine's
    own, like ``--nproc-per-node`` in torchrun: a host pins its agent and workers by its
    own launch's lists (none: not pinned), not by the leader's."""

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> HostLaunch | None:
        raw = environ.get(LAUNCH_ENV)
        return None if raw is None else cls(**json.loads(raw))

    def check(self) -> None:
        if self.nnodes < 1:
            raise UsageError(f"--nnodes must be >= 1, got {self.nnodes}")
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise UsageError(
                f"--node-rank {self.node_rank}: nodes are numbered 0..{self.nnodes - 1} "
                f"(--nnodes {self.nnodes})"
            )
        if self.node_rank is not None and self.spare:
            raise UsageError("--node-rank and --spare: a spare serves no node until one fails")


def listen_here(ip: str, port: int, key: bytes) -> Listener | None:
    """The coordinator's listener when this host holds the endpoint's address and nobody
    on it listens there yet (another launcher on this machine may run the coordinator,
    as several hosts simulated on one machine do); None where this host is not it."""
    if interface_of(ip) is None:
        return None
    try:
        return Listener((ip, port), key)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return None
        raise UsageError(f"--rdzv-endpoint {ip}:{port}: cannot listen there ({e})") from None


ETCD_ENV = "TIERSWAP_ETCD"
"""``--rdzv-backend etcd``: where the agent finds the coordinator (``HOST:PORT JOB``)."""


HOST_ENV = (
    "TIERSWAP_SECRET",
    "TIERSWAP_HOST",
    "TIERSWAP_HOST_ADDRESS",
    "TIERSWAP_SIMULATED",
    "TIERSWAP_SPARE",
    "TIERSWAP_AGENT_TAG",
    LAUNCH_ENV,
    JOIN_CPUS_ENV,
    ETCD_ENV,
    TEMPLATE_ENV,  # this machine's worker template: its starter's to say
    TEMPLATE_PID_ENV,
)
"""Variables that say which host an agent is: set by whoever starts it, never inherited
(a stale one would be another host's), and the secret, which agents do not need."""


def inherited(environ: Mapping[str, str]) -> dict[str, str]:
    """What an agent takes from the environment of the process that starts it."""
    return {k: v for k, v in environ.items() if k not in HOST_ENV}


def agent_env(
    environ: Mapping[str, str],
    endpoint: tuple[str, int],
    key: bytes,
    launch: HostLaunch,
    run_dir: Path,
    etcd: bool = False,
) -> dict[str, str]:
    """The environment of this host's agent process: it connects to the coordinator at
    ``endpoint``, or, with ``etcd``, looks the leading coordinator up in the etcd server
    at ``endpoint`` (and again whenever it goes)."""
    env = inherited(environ)  # (workers see no secret)
    where = f"{endpoint[0]}:{endpoint[1]}"
    env.update(
        TIERSWAP_COORD=where,
        TIERSWAP_RUN_DIR=str(run_dir),
        **{KEY_ENV: key.hex(), LAUNCH_ENV: launch.to_env()},
    )
    if etcd:
        env[ETCD_ENV] = f"{where} {launch.job or ''}"
    if launch.node_rank is not None:
        env["TIERSWAP_HOST"] = str(launch.node_rank)
    return env


def connect_timeout(environ: Mapping[str, str]) -> float:
    """How long an agent of a multi-host launch waits for the coordinator to come up."""
    return float(environ.get("TIERSWAP_STARTUP_TIMEOUT", "120"))
