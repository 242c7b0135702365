"""One host's ``tierswap run --rdzv-backend etcd``: its agent, and a coordinator candidate.

The launcher starts this host's agent at once (it finds the leading coordinator in etcd)
and then watches the leader key: while no coordinator leads, it campaigns, and the one
that wins runs the coordinator in this process, listening on the address this host
reaches etcd from. A first leader starts the job; a later one takes it over from the
state its predecessor wrote (``election.py``). The launcher exits with its agent's code:
the job's, as every host's does.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tierswap.cluster.election import POLL_S, Rendezvous, wait_for_stale_keys
from tierswap.cluster.multihost import HostLaunch, agent_env, retried
from tierswap.config import Config
from tierswap.control.commands import TakeOver
from tierswap.errors import Deposed, UsageError
from tierswap.wire import Listener


def address_towards(endpoint: tuple[str, int], wait: float = 0.0) -> str:
    """The address of this host that its connections to etcd at ``endpoint`` leave from;
    tried again for up to ``wait`` seconds, since hosts may start before etcd does."""
    where = "{}:{}".format(*endpoint)

    def leaving() -> str:
        with socket.create_connection(endpoint, timeout=10) as s:
            return str(s.getsockname()[0])

    def refused(e: Exception) -> Exception:
        why = e.strerror if isinstance(e, OSError) and e.strerror else e
        return UsageError(
            f"--rdzv-endpoint {where}: etcd does not answer there ({why}) after {wait:g} s "
            "(--startup-timeout): start etcd first, or give its address"
        )

    return retried(leaving, wait, f"etcd at {where} (--rdzv-endpoint)", refused)


OWN_OPTIONS = ("bind", "console", "run_dir", "agent_cpus", "worker_cpus")
"""Options that are the launching host's own, kept by a leader that takes a job over:
where it listens, its terminal, its directory, its CPU lists (every host pins by its own:
``cluster.agent.own_cpus``)."""


def job_config(own: Config, record: Mapping[str, Any] | None) -> tuple[Config, list[str]]:
    """The options a winning candidate leads the job with, and the names of this launch's
    options that it does not use.

    A first leader (no ``record``) starts the job with its own launch's options. One that
    takes a job over runs it with the options its first leader started it with, as
    recorded (``takeover.record``): every host serves the job with those (its agent got
    them when it joined), and a later leader must not change the job's ring sizes,
    redo bound, persist path or restart budget because its host was launched with other
    ones. Only :data:`OWN_OPTIONS` come from this launch."""
    if record is None or "config" not in record:  # (a record written before it was kept)
        return own, []
    job = dataclasses.replace(  # (an unset one of this launch's own stays unset)
        Config.from_env(record["config"]), **{k: getattr(own, k) for k in OWN_OPTIONS}
    )
    mine = _as_recorded(own)
    ignored = [
        f.name
        for f in dataclasses.fields(Config)
        if f.name not in OWN_OPTIONS and getattr(mine, f.name) != getattr(job, f.name)
    ]
    return job, ignored


def _as_recorded(cfg: Config) -> Config:
    """``cfg`` as a first leader records it: a local ``--init-from`` made absolute
    (``launch.check_init_from``), so that the same relative path is not told apart."""
    if cfg.init_from is None or "://" in cfg.init_from:
        return cfg
    return dataclasses.replace(cfg, init_from=os.path.abspath(cfg.init_from))


def _old_host(record: dict[str, Any]) -> int | None:
    """The host that ran on the old leader's own machine (by its agent's tag)."""
    own = set(record.get("own", ()))
    return next((int(h) for h, tag in record["tags"].items() if tag in own), None)


def run(
    cfg: Config,
    launch: HostLaunch,
    key: bytes,
    script: list[str],
    run_dir: Path,
    etcd: tuple[str, int],
) -> int:
    from tierswap.cluster.coordinator import SIGNAL_CODES, Coordinator

    rdzv = Rendezvous(etcd, launch.job)
    here = address_towards(etcd, wait=cfg.startup_timeout)
    wait_for_stale_keys(rdzv, lambda text: print(f"tierswap run: {text}", flush=True))
    run_dir.mkdir(parents=True, exist_ok=True)
    env = agent_env(os.environ, etcd, key, launch, run_dir, etcd=True)
    env["TIERSWAP_STARTUP_TIMEOUT"] = str(cfg.startup_timeout)
    tag = env["TIERSWAP_AGENT_TAG"] = secrets.token_hex(8)
    agent = subprocess.Popen(
        [sys.executable, "-m", "tierswap.cluster.agent", *script], env=env, start_new_session=True
    )
    led = False
    try:
        while True:
            code = agent.poll()
            if code is not None:
                return code
            try:
                rdzv.renew_job()  # once the job's first leader made its lease
                done, leader = rdzv.done(), rdzv.leader()
            except Exception:  # etcd unreachable for now: nothing to decide on
                time.sleep(POLL_S)
                continue
            if done is not None:  # over: the agent exits with the job's code
                return agent.wait(60)
            if leader is None:
                listener = Listener((here, 0), key)
                info = {"address": list(listener.tcp_address), "pid": os.getpid()}
                try:
                    won = rdzv.campaign(info)
                    record = rdzv.state() if won else None
                except (Exception, Deposed):  # etcd unreachable, or lost at once: try later
                    rdzv.resign()
                    won = False
                if won:
                    led = True
                    job, ignored = job_config(
                        dataclasses.replace(cfg, bind=here, job_name=cfg.job_name or launch.job),
                        record,
                    )
                    takeover = (
                        None
                        if record is None
                        else TakeOver(record, _old_host(record), tuple(ignored))
                    )
                    coordinator = Coordinator(
                        job,
                        script,
                        run_dir,
                        hosts=launch,
                        key=key,
                        listener=listener,
                        leader=rdzv,
                        takeover=takeover,
                        own_agent=(agent, tag),
                    )
                    try:
                        code = coordinator.run()
                    finally:  # (a SIGTERM of a deposed leader stops this host's agent too)
                        led = not coordinator.deposed
                    if led or code in SIGNAL_CODES.values():  # ended, or a signal stopped it
                        return code
                    continue  # another leads: this host's agent serves it, this waits
                listener.close()
            time.sleep(POLL_S)
    finally:
        if not led and agent.poll() is None:  # Ctrl-C, SIGTERM: this host stops
            os.killpg(agent.pid, signal.SIGTERM)
            try:
                agent.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
