"""What the peers' launcher wrappers share: a free loopback port, waiting for a server to
listen, and stopping a launcher so that its ranks go with it."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time


def exit_on_sigterm() -> None:
    """A SIGTERM to the wrapper ends it through its ``finally`` blocks (which stop what it
    started), as an exception would; by default it would die at once, leaving them."""

    def leave(*_: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the stop
        sys.exit(143)

    signal.signal(signal.SIGTERM, leave)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_listening(
    port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 30.0
) -> None:
    """Until ``what`` (``proc``) accepts connections on ``port``; an error if it exits or
    does not within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{what} did not listen on 127.0.0.1:{port} in {timeout} s")


def stop(proc: subprocess.Popen[bytes], grace: float = 45.0) -> None:
    """End a launcher still running: SIGTERM first, which torchrun (and dlrover-run, built
    on it) passes to its ranks before it exits, SIGKILLing them itself after its own 30 s
    (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``); SIGKILL past ``grace``, longer than that. A
    SIGKILL alone would leave the ranks, each in a session of its own, running."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
