"""``--rdzv-backend etcd``: a coordinator that survives its host.

Every host's launcher is a candidate. One holds the key ``/tierswap/JOB/leader`` under an
etcd lease of ``TTL`` seconds, renewed every quarter of it, and runs the coordinator; the
key's value says where it listens. The coordinator writes what it decides on (membership,
generation, each tier's commit, the settled step, spares, hosts fenced: ``state``) to
etcd before acting on it, in a transaction that holds only while the leader key is still
the one it created: a deposed leader's write fails, it raises ``Deposed`` and changes
nothing (no message sent, no COMMIT written). When the leader's lease ends, the first
candidate to create the key again leads, reads ``state`` back, and takes the job over;
agents find it through etcd and reconnect.

The client is etcd3gw (etcd's JSON gateway, maintained); nothing here is pickled: keys
and values are JSON.
"""

from __future__ import annotations

import base64
import contextlib
import json
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tierswap.errors import Deposed, UsageError

if TYPE_CHECKING:
    from etcd3gw.lease import Lease

TTL = 2
"""Seconds of the leader's etcd lease: the longest a dead leader holds the job."""
COMPACT_EVERY = 1000
"""The leader compacts etcd's history every this many writes (about two a step)."""
JOB_TTL = 10
"""Seconds of the job's lease, which every host's launcher renews: the job's keys
(``state``, ``done``) go with it once no host of the job runs, so that a job started
again under the same ``--rdzv-id`` starts afresh instead of taking a dead one over."""
POLL_S = 0.2
"""How often candidates and agents look at the leader key."""


def _clock() -> float:
    """Seconds on a clock that also runs while the machine is suspended: a leader waking
    from a suspend must not trust a lease that ran out meanwhile."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class Rendezvous:
    """One job's keys in etcd, as one candidate sees them."""

    def __init__(self, endpoint: tuple[str, int], job: str | None, ttl: int = TTL) -> None:
        try:
            from etcd3gw.client import Etcd3Client
        except ImportError:
            raise UsageError(
                "--rdzv-backend etcd needs etcd3gw: pip install 'tierswap[etcd]'"
            ) from None
        # a request may take at most half a lease: a leader retries within its lease
        self.client = Etcd3Client(host=endpoint[0], port=endpoint[1], timeout=ttl / 2)
        self.prefix = f"/tierswap/{job or 'default'}/"
        self.ttl = ttl
        self.id = uuid.uuid4().hex
        """This candidate, in the leader key's value."""
        self.lease: Lease | None = None
        self.revision: int | None = None
        """The leader key's create revision while this candidate leads."""
        self.lost = threading.Event()
        """Set once this candidate's leadership lapsed (its lease could not be renewed)."""
        self.job_lease: int | None = None
        """The job's lease (``JOB_TTL``), which this candidate renews while it runs."""
        self._renewing = False
        self._closed = threading.Event()
        self.renewed = 0.0
        """When (monotonic) the leader's lease was last renewed (asked for)."""
        self._writes = 0

    def key(self, name: str) -> str:
        return self.prefix + name

    # ---------------------------------------------------------------- reading

    def _get(self, name: str) -> tuple[dict[str, Any], int] | None:
        found = self.client.get(self.key(name), metadata=True)
        if not found:
            return None
        value, meta = found[0]
        return json.loads(value), int(meta["create_revision"])

    def leader(self) -> dict[str, Any] | None:
        """Who leads now (its ``id``, ``address``, ``pid``), or None between leaders."""
        got = self._get("leader")
        return None if got is None else got[0]

    def state(self) -> dict[str, Any] | None:
        got = self._get("state")
        return None if got is None else got[0]

    def done(self) -> dict[str, Any] | None:
        """The job's end (its ``code``), once a leader wrote it."""
        got = self._get("done")
        return None if got is None else got[0]

    def renew_job(self) -> None:
        """Keep the job's lease alive while this launcher runs (on a thread, once the
        first leader made one)."""
        if self._renewing:
            return
        got = self._get("lease")
        if got is None:
            return
        self.job_lease = int(got[0]["id"])
        self._renewing = True
        threading.Thread(target=self._renew_job, name="tierswap-etcd-job", daemon=True).start()

    def _renew_job(self) -> None:
        from etcd3gw.lease import Lease

        assert self.job_lease is not None
        lease = Lease(self.job_lease, self.client)
        while not self._closed.is_set():
            try:
                lease.refresh()
            except Exception:
                pass  # etcd unreachable for now; other hosts renew it too
            self._closed.wait(JOB_TTL / 5)

    def close(self) -> None:
        """Stop renewing anything (this process is done with the job)."""
        self._closed.set()
        self.lost.set()

    # ---------------------------------------------------------------- leading

    def campaign(self, info: dict[str, Any]) -> bool:
        """Try to become the leader, publishing ``info`` (where the coordinator listens).
        True when this candidate leads now; its lease is then kept alive on a thread."""
        asked = _clock()
        self.id = uuid.uuid4().hex  # each leadership its own: agents tell one from the next
        lease = self.client.lease(self.ttl)
        value = json.dumps(dict(info, id=self.id))
        reply = self.client.transaction(
            {
                "compare": [{"key": _b64(self.key("leader")), "result": "EQUAL",
                             "target": "CREATE", "create_revision": 0},
                            {"key": _b64(self.key("done")), "result": "EQUAL",
                             "target": "CREATE", "create_revision": 0}],
                "success": [{"request_put": {"key": _b64(self.key("leader")),
                                             "value": _b64(value), "lease": lease.id}}],
                "failure": [],
            }
        )  # fmt: skip
        if not reply.get("succeeded"):
            lease.revoke()
            return False
        self.lease = lease
        self.revision = int(reply["header"]["revision"])
        self.renewed = asked
        self.lost.clear()
        threading.Thread(
            target=self._keep_alive, args=(lease,), name="tierswap-etcd-lease", daemon=True
        ).start()
        self.renew_job()
        if self.job_lease is None:  # the job's first leader: the job's lease is made now
            self.job_lease = self.client.lease(JOB_TTL).id
            self._guarded({"lease": {"id": self.job_lease}})
            self.renew_job()
        return True

    def _keep_alive(self, lease: Lease) -> None:
        """Renew ``lease`` while it is this candidate's (a later campaign's is not)."""
        while self.lease is lease and not self.lost.is_set():
            if self._closed.wait(self.ttl / 4):
                return
            asked = _clock()  # etcd counts the TTL from no earlier than this
            try:
                alive = lease.refresh() > 0  # the TTL left: 0 or less once it lapsed
            except Exception:  # etcd unreachable for now: the lease may still hold
                alive = _clock() - self.renewed < self.ttl
            else:
                if alive and self.lease is lease:
                    self.renewed = asked
            if not alive and self.lease is lease:
                self.lost.set()

    def check(self) -> None:
        """Before this leader acts: ``Deposed`` unless it surely leads. Within three
        quarters of a TTL of its last renewal its key surely lives; later (a pause, a
        slow etcd) that is asked of etcd."""
        if self.revision is None or self.lost.is_set():
            raise self._depose("this coordinator's leadership lapsed")
        if _clock() - self.renewed < 0.75 * self.ttl:
            return
        self._guarded({})

    def _guarded(self, puts: dict[str, Any], drop: tuple[str, ...] = ()) -> None:
        """Put ``puts`` (name -> JSON value, under the job's lease) only while this
        candidate still leads; ``Deposed`` otherwise (nothing is written then)."""
        if self.revision is None or self.lost.is_set():
            raise self._depose("this coordinator's leadership lapsed")
        success = []
        for name, value in puts.items():
            put: dict[str, Any] = {"key": _b64(self.key(name)), "value": _b64(json.dumps(value))}
            if self.job_lease is not None:
                put["lease"] = self.job_lease
            success.append({"request_put": put})
        success += [{"request_delete_range": {"key": _b64(self.key(n))}} for n in drop]
        compare = [{"key": _b64(self.key("leader")), "result": "EQUAL", "target": "CREATE",
                    "create_revision": self.revision}]  # fmt: skip
        txn = {"compare": compare, "success": success, "failure": []}
        # retried while the lease surely holds as of now (not as renewals move it on: a
        # transaction etcd keeps refusing must not hold the coordinator forever)
        give_up = min(self.renewed + 0.75 * self.ttl, _clock() + self.ttl)
        while True:
            try:
                reply = self.client.transaction(txn)
                break
            except Exception as e:  # etcd busy or unreachable (electing its own leader?)
                if self.lost.is_set() or _clock() >= give_up:
                    raise self._depose(
                        f"etcd could not record a decision in time: {type(e).__name__}: {e}"
                    ) from None
                time.sleep(0.1)  # the lease surely holds still: try again
        if not reply.get("succeeded"):
            raise self._depose("another coordinator leads now (the leader key is not this one's)")
        self._writes += 1
        if self._writes % COMPACT_EVERY == 0:  # etcd keeps every revision until compacted
            older = int(reply["header"]["revision"]) - COMPACT_EVERY  # keep the newest ones
            with contextlib.suppress(Exception):
                self.client.post(self.client.get_url("/kv/compaction"), json={"revision": older})

    def _depose(self, why: str) -> Deposed:
        """This candidate leads no more: it stops renewing, lets its key go, and says why."""
        self.lost.set()
        lease, self.lease = self.lease, None
        if lease is not None:
            with contextlib.suppress(Exception):
                lease.revoke()
        return Deposed(why)

    def write_state(self, state: dict[str, Any]) -> None:
        self._guarded({"state": state})

    def confirm(self, what: str, value: Any) -> None:
        """Record ``what`` (a durable COMMIT about to be written, say) as this leader;
        ``Deposed`` if it leads no more."""
        self._guarded({what: value})

    def finish(self, code: int) -> None:
        """The job ended with ``code``: said to every candidate (until the job's lease
        goes), and its state dropped, so that nothing is ever taken over from it."""
        self._guarded({"done": {"code": code}}, drop=("state",))

    def resign(self) -> None:
        """Let the leader key go at once (the job ended), rather than at the lease's end."""
        self.lost.set()
        if self.lease is not None:
            try:
                self.lease.revoke()
            except Exception:
                pass  # it lapses by itself within TTL


def wait_for_stale_keys(rdzv: Rendezvous, say: Callable[[str], None]) -> None:
    """Before a host starts: an earlier run under the same ``--rdzv-id`` may have left
    its keys (its end, or the state of a run whose every host died): they go with the
    job's lease, within ``JOB_TTL`` of its last host. Wait for that, so that this run
    neither exits with the old one's code nor takes the dead one over. A run that is
    alive (a leader leads it) is joined at once."""
    deadline = time.monotonic() + JOB_TTL + 5
    said = False
    while time.monotonic() < deadline:
        try:
            done, state, leader = rdzv.done(), rdzv.state(), rdzv.leader()
        except Exception:
            done = state = leader = None  # etcd unreachable: the agent says so
        if done is None and (state is None or leader is not None):
            return
        if not said:
            what = "ended" if done is not None else "lost every host"
            say(
                f"an earlier run of job {rdzv.prefix.split('/')[2]} in etcd {what}; waiting "
                f"up to {JOB_TTL} s for its keys to go"
            )
            said = True
        time.sleep(POLL_S)


def wait_for_leader(
    rdzv: Rendezvous,
    deadline: float,
    unlike: str | None = None,
    stop: Callable[[], bool] = lambda: False,
) -> dict[str, Any] | None:
    """The leader's value once there is one (other than the leader ``unlike``), or None
    once ``deadline`` (monotonic) passes, the job is done, or ``stop()``."""
    while time.monotonic() < deadline and not stop():
        try:
            if rdzv.done() is not None:
                return None
            leader = rdzv.leader()
        except Exception:
            leader = None  # etcd unreachable for now
        if leader is not None and leader.get("id") != unlike:
            return leader
        time.sleep(POLL_S)
    return None
