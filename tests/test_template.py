"""The worker template: a worker forked from it runs its script as a process of its own
would (argv, environment, folder, exit code), in the asking agent's process group, and
never outlives that agent; without a template, workers start alone."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierswap.cluster import template as tpl
from tierswap.cluster.multihost import KEY_ENV
from tierswap.cluster.workers import Templates
from tierswap.control import protocol as p
from tierswap.wire import Channel

SCRIPT = """
import json, os, sys, time
out, code = sys.argv[1], int(sys.argv[2])
with open(out, "w") as f:
    json.dump({"argv": sys.argv[1:], "cwd": os.getcwd(), "pgid": os.getpgid(0),
               "env": os.environ.get("ONLY_HERE"), "main": __name__,
               "torch": "torch" in sys.modules, "stdin": os.readlink("/proc/self/fd/0"),
               "name": open("/proc/self/comm").read().strip(),
               "cmdline": open("/proc/self/cmdline").read().rstrip("\\0")}, f)
class Kept:
    pass
if code == 0:  # what the interpreter ends at its exit, a fork ends too
    import concurrent.futures, pickle
    pool = concurrent.futures.ThreadPoolExecutor(1)
    pool.submit(time.sleep, 0.1)
    def late():  # runs as the interpreter ends: __main__ is still the script
        time.sleep(0.2)
        with open(out + ".late", "wb") as f:
            f.write(pickle.dumps(Kept()))
    import threading
    threading.Thread(target=late).start()
    left_open = open(out + ".tail", "w")
    left_open.write("flushed at exit")
if code == 99:
    raise RuntimeError("the script failed")
if code == 97:
    raise KeyboardInterrupt
if code == 98:
    time.sleep(60)
sys.exit(code)
"""


@contextlib.contextmanager
def _template(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, bytes, subprocess.Popen[bytes]]]:
    """A template process as a launcher starts one: (socket, secret, process)."""
    folder = tmp_path_factory.mktemp("tpl")
    secret = secrets.token_bytes(16)
    path = str(folder / "t.sock")
    env = dict(os.environ, **{tpl.TEMPLATE_ENV: path, KEY_ENV: secret.hex()})
    # its stdin a pipe, not /dev/null: the forks' is /dev/null all the same
    proc = subprocess.Popen([sys.executable, "-m", "tierswap.cluster.template"], env=env,
                            stdin=subprocess.PIPE)  # fmt: skip
    try:
        yield path, secret, proc
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdin is not None
        proc.stdin.close()


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, bytes, int]]:
    with _template(tmp_path_factory) as (path, secret, proc):
        yield path, secret, proc.pid


class Asked:
    """One worker asked of a template: its exit code, or the fallback it took."""

    def __init__(self) -> None:
        self.code: int | None = None
        self.alone = False
        self.done = threading.Event()

    def exited(self, code: int) -> None:
        self.code = code
        self.done.set()

    def start_alone(self) -> subprocess.Popen[bytes]:
        self.alone = True
        self.done.set()
        return subprocess.Popen([sys.executable, "-c", "pass"])


def _fork(client: Templates, script: Path, out: Path, code: int, cwd: Path) -> tuple[Asked, object]:
    asked = Asked()
    msg = p.Fork(key=-1, argv=[str(script), str(out), str(code)], env={"ONLY_HERE": "yes"},
                 cwd=str(cwd), pgid=os.getpgid(0))  # fmt: skip
    return asked, client.fork(msg, asked.exited, asked.start_alone)


def _connect(path: str, secret: bytes) -> Channel:
    """An agent's channel to the template, by hand, once it listens (after its imports)."""
    deadline = time.monotonic() + 120
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return Channel.connect(path, secret, p.TemplateToAgent)


def _gone(pid: int, within: float) -> bool:
    """Whether ``pid`` ends within ``within`` s (a zombie not reaped yet has ended)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def _started(marker: Path) -> None:
    """Wait until the forked script has written ``marker``: it runs."""
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert marker.exists(), "the forked script never ran"


def test_a_fork_runs_its_script_as_main_and_reports_its_exit(template, tmp_path: Path) -> None:
    path, secret, pid = template
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    client = Templates(path, secret, pid)
    asks = {code: _fork(client, script, tmp_path / f"{code}.json", code, tmp_path)
            for code in (0, 3, 99, 97)}  # fmt: skip
    expected = {0: 0, 3: 3, 99: 1, 97: -signal.SIGINT}  # as `python SCRIPT` exits
    for code, (asked, _) in asks.items():
        assert asked.done.wait(60), f"worker exiting {code} was never reported"
        assert not asked.alone, "the template refused a fork"
        assert asked.code == expected[code], (code, asked.code)
        seen = json.loads((tmp_path / f"{code}.json").read_text())
        assert seen == {"argv": [str(tmp_path / f"{code}.json"), str(code)], "cwd": str(tmp_path),
                        "pgid": os.getpgid(0), "env": "yes", "main": "__main__",
                        "torch": True, "stdin": os.devnull, "name": "tierswap-worker",
                        # what ps shows of a worker started alone, not the template's
                        "cmdline": f"{sys.executable} {script} {tmp_path / f'{code}.json'} {code}",
                        }, seen  # fmt: skip
    assert (tmp_path / "0.json.tail").read_text() == "flushed at exit"
    assert (tmp_path / "0.json.late").exists(), "a thread at exit did not see the script's __main__"
    asked, handle = _fork(client, script, tmp_path / "slow.json", 98, tmp_path)
    deadline = time.monotonic() + 30
    while not (tmp_path / "slow.json").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    handle.kill()  # type: ignore[attr-defined]
    assert asked.done.wait(30) and asked.code == -signal.SIGKILL
    client.close()


def test_a_command_line_the_fork_cannot_take_leaves_its_script_running(
    template, tmp_path: Path
) -> None:
    """Its command line is cosmetic: one setproctitle refuses (a NUL in an argument) is
    left as it was, and the script runs and exits as it would anyway."""
    path, secret, pid = template
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    asked, out = Asked(), tmp_path / "nul.json"
    msg = p.Fork(key=-1, argv=[str(script), str(out), "0", "a\x00b"], env={"ONLY_HERE": "yes"},
                 cwd=str(tmp_path), pgid=os.getpgid(0))  # fmt: skip
    client = Templates(path, secret, pid)
    try:
        client.fork(msg, asked.exited, asked.start_alone)
        assert asked.done.wait(60) and not asked.alone and asked.code == 0, asked.code
    finally:
        client.close()
    seen = json.loads(out.read_text())
    assert seen["argv"][-1] == "a\x00b" and seen["name"] == "tierswap-worker", seen


@pytest.mark.parametrize("pidfds", [True, False], ids=["pidfd", "no-pidfds"])
def test_a_kill_reaches_the_fork_named_never_a_process_that_took_its_pid(
    pidfds: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent is not its forks' parent: once the template reaps one, its pid may be
    another process's before the agent hears of it. The kill is bound to the process the
    template named (its pid and start time), so a stranger holding that pid lives on;
    where the kernel has no pidfds, the start time is checked before the kill."""
    import psutil

    from tierswap.cluster import workers
    from tierswap.cluster.workers import Forked

    if not pidfds:

        def no_pidfds(pid: int) -> int:
            raise OSError(38, "Function not implemented")

        monkeypatch.setattr(workers.os, "pidfd_open", no_pidfds)

    def handle() -> Forked:
        return Forked(lambda code: None, lambda: pytest.fail("started alone"))

    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = tpl.start_time(stranger.pid)
        assert start is not None
        born = psutil.boot_time() + start / os.sysconf("SC_CLK_TCK")
        assert born == pytest.approx(psutil.Process(stranger.pid).create_time(), abs=0.02)
        reused = handle()
        reused.forked(stranger.pid, start - 1)  # the pid the template named, another process
        reused.kill()
        assert stranger.poll() is None and not _gone(stranger.pid, 0.5), "killed a stranger"
        named = handle()
        named.forked(stranger.pid, start)
        named.kill()
        assert _gone(stranger.pid, 10), "the worker named was not killed"
        named.reaped(-signal.SIGKILL)
        named.kill()  # reaped: its pidfd is closed, nothing is sent
    finally:
        stranger.kill()
        stranger.wait()


def test_a_fork_never_outlives_its_agents_channel(template, tmp_path: Path) -> None:
    path, secret, _ = template
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    chan = _connect(path, secret)  # an agent, by hand
    chan.send(p.Fork(key=7, argv=[str(script), str(tmp_path / "slow.json"), "98"], env={},
                     cwd=str(tmp_path), pgid=os.getpgid(0)))  # fmt: skip
    reply = chan.recv(60)
    assert reply is not None and isinstance(reply.msg, p.Forked) and reply.msg.key == 7
    _started(tmp_path / "slow.json")
    chan.close()  # the agent is gone, as a killed agent's socket closes
    assert _gone(reply.msg.pid, 10), "a worker outlived its agent's channel to the template"


def test_without_a_template_workers_start_alone(tmp_path: Path) -> None:
    """A template that is not running (exited at its imports, killed): the agent starts
    its workers as processes of their own, at once."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])  # a zombie until reaped
    deadline = time.monotonic() + 30
    while not tpl_exited(dead.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    client = Templates(str(tmp_path / "none.sock"), b"k" * 16, dead.pid)
    asked, handle = _fork(client, tmp_path / "w.py", tmp_path / "x.json", 0, tmp_path)
    assert asked.done.wait(10) and asked.alone, "an exited template was waited for"
    assert handle.wait(30) == 0  # type: ignore[attr-defined]
    client.close()
    dead.wait()


def tpl_exited(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z"


def test_the_template_does_not_fork_beside_a_running_thread() -> None:
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="busy")
    t.start()
    old = tpl.JOIN_THREADS_S
    tpl.JOIN_THREADS_S = 0.05
    try:
        why = tpl._cannot_fork()
    finally:
        tpl.JOIN_THREADS_S = old
        stop.set()
        t.join()
    assert "threads running" in why and "busy" in why, why


def test_a_fork_dies_with_its_template_and_its_agent_starts_the_next_alone(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    with _template(tmp_path_factory) as (path, secret, proc):
        chan = _connect(path, secret)  # kept open: only the
        chan.send(p.Fork(key=1, argv=[str(script), str(tmp_path / "slow.json"), "98"],
                         env={}, cwd=str(tmp_path), pgid=os.getpgid(0)))  # fmt: skip
        reply = chan.recv(60)  # template's death can end the fork
        assert reply is not None and isinstance(reply.msg, p.Forked)
        _started(tmp_path / "slow.json")
        client = Templates(path, secret, proc.pid)
        proc.kill()
        proc.wait()
        assert _gone(reply.msg.pid, 10), "a fork outlived its template"
        later, _ = _fork(client, script, tmp_path / "later.json", 0, tmp_path)
        assert later.done.wait(10) and later.alone, "a fork was asked of a dead template"
        client.close()
        chan.close()


def test_a_template_whose_starter_is_gone_before_it_looks_ends_at_once(tmp_path: Path) -> None:
    """A template reads its parent after its own imports: one whose starter died before
    (its parent then another process) must not take the new one for its starter and
    serve for good."""
    path = tmp_path / "t.sock"
    env = dict(os.environ, **{tpl.TEMPLATE_ENV: str(path), KEY_ENV: secrets.token_hex(16),
                              tpl.TEMPLATE_PARENT_ENV: str(os.getpid() + 1)})  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "tierswap.cluster.template"], env=env)
    try:
        assert proc.wait(30) == 0, "it served a process that did not start it"
    finally:
        proc.kill()
        proc.wait()
    assert not path.exists(), "it listened"


def test_an_agent_no_launcher_started_starts_a_template_of_its_own_and_ends_it(
    tmp_path: Path,
) -> None:
    """An agent started alone (as `--join` and the hosts of a multi-host launch start it)
    starts a template of its own before it greets the coordinator; a SIGTERM while it
    still waits for one ends it with 143, its template and its temporary folder gone."""
    import psutil

    from tierswap.cluster.multihost import LAUNCH_ENV, HostLaunch

    port = socket_free_port()  # nobody listens: a host of a launch waits for its coordinator
    launch = HostLaunch(nnodes=2, nproc_per_node=1).to_env()
    env = dict(os.environ, TMPDIR=str(tmp_path), TIERSWAP_COORD=f"127.0.0.1:{port}")
    env.update({KEY_ENV: secrets.token_hex(16), LAUNCH_ENV: launch})
    for name in (tpl.TEMPLATE_ENV, tpl.TEMPLATE_PID_ENV, "TIERSWAP_RUN_DIR"):
        env.pop(name, None)
    agent = subprocess.Popen([sys.executable, "-m", "tierswap.cluster.agent", "x.py"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("tierswap-agent-*/template-*.sock")):
            assert time.monotonic() < deadline and agent.poll() is None, "no template listened"
            time.sleep(0.05)
        (template,) = psutil.Process(agent.pid).children()
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(30) == 143
    finally:
        agent.kill()
        agent.wait()
    assert _gone(template.pid, 5), "the agent's template outlived it"
    assert not list(tmp_path.iterdir()), "the agent's folder is left"


def socket_free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
