"""glibc's settings a worker starts with (no torch here: the agent and launcher use it)."""

from __future__ import annotations

import platform

COPY_CHUNK = 1 << 20
"""Bytes the snapshot's copy moves per libc call (``memcopy.CHUNK``): the size from which
the workers' glibc writes copies around the cache."""

TUNABLES_ENV = "GLIBC_TUNABLES"
NT_TUNABLE = "glibc.cpu.x86_non_temporal_threshold"


def nt_tunables(env: dict[str, str]) -> dict[str, str]:
    """A copy of ``env`` with glibc's non-temporal threshold set to :data:`COPY_CHUNK`
    (x86-64 only; kept as it is where the user set that tunable). Other tunables the user
    set stay."""
    current = env.get(TUNABLES_ENV, "")
    if platform.machine().lower() not in ("x86_64", "amd64") or NT_TUNABLE in current:
        return dict(env)
    mine = f"{NT_TUNABLE}={COPY_CHUNK:#x}"
    return {**env, TUNABLES_ENV: f"{current}:{mine}" if current else mine}
