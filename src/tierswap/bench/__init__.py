"""``tierswap bench snapshot``: what a snapshot every step costs, against what users have.

One run, one state (Linear layers and an AdamW that has taken a step, ``--size-mib`` MiB):
1. blocking time per checkpoint of tierswap (``take`` + the wait at the next step's fence,
   after a stand-in forward and backward), ``torch.save`` + fsync, ``dcp.save`` and
   ``dcp.async_save`` (until it returns), interleaved per round (A B C D A B C D ...);
2. the snapshot's copy throughput against a plain ``copy_`` into a touched buffer;
3. ``durable.write_part`` of a held slot against a sequential write + fsync, same disk;
4. the step time of a small MLP with a snapshot every step and without, A B / B A blocks,
   on one torch thread (a core left to the copy and the agent) and on all.

The agent side is real: a ``RankRing`` in a process of its own serves ``alloc``, ``slot``
and ``held`` over an authenticated unix socket and checksums each held slot. The first
round of each measurement is warm-up (slot allocation, page touching, imports), left out.
Before each timed call the copy and the agent's checksums are waited for, untimed; within
section 4's blocks they overlap the steps, as in a real job.

Modules: ``agent`` (the agent process), ``rig`` (a Snapshotter driving it), ``common``
(rounds and their stats), ``measure`` (sections 1 to 3 and the run), ``steps``
(section 4), ``report`` (the tables and the command).
"""

from tierswap.bench.measure import make_state, run
from tierswap.bench.report import TARGETS, main, report

__all__ = ["TARGETS", "main", "make_state", "report", "run"]
