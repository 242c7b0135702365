"""What a parked spare host makes ahead: the shared memory a node of the job holds.

Agents report each ring they make (``Memory``, with its segments' sizes): a rank's tier-0
slots, and the tier-1 ring of each rank whose replicas the node keeps. A spare that took
a node would make the same segments in its first step, 3 GiB in 5 s on a loaded 2-core
machine at 384 MiB of state per rank, all of it on the recovery's critical path. So
spares are told the sizes (``Warm``) and make them while parked, on a thread of their own;
the rings then take them (``SegmentPool``).
"""

from __future__ import annotations


class SpareMemory:
    """The segment sizes each node's rings are made of, as its agent reported them."""

    def __init__(self) -> None:
        self.by_node: dict[int, dict[tuple[int, int], list[int]]] = {}
        """node -> (tier, rank) -> sizes of the segments of that ring."""
        self.sent: dict[int, list[int]] = {}
        """host -> the sizes it was last told to hold."""

    def noted(self, node: int, tier: int, rank: int, segments: list[int]) -> bool:
        """A ring was made; True if what a spare should hold changed."""
        before = self.sizes()
        self.by_node.setdefault(node, {})[(tier, rank)] = list(segments)
        return self.sizes() != before

    def resized(self, nodes: int) -> None:
        """The job now has ``nodes`` nodes: rings of nodes past them are gone."""
        for node in [n for n in self.by_node if n >= nodes]:
            del self.by_node[node]

    def sizes(self) -> list[int]:
        """What a spare holds: the segments of the node whose rings take the most memory
        (in a data-parallel job every node's are alike), largest first."""
        best: list[int] = []
        for rings in self.by_node.values():
            sizes = sorted((n for segs in rings.values() for n in segs), reverse=True)
            if sum(sizes) > sum(best):
                best = sizes
        return best

    def to_send(self, host: int) -> list[int] | None:
        """The sizes to tell ``host``, if they differ from what it was last told."""
        sizes = self.sizes()
        if self.sent.get(host, []) == sizes:
            return None
        self.sent[host] = sizes
        return sizes

    def forget(self, host: int) -> None:
        """``host`` is no longer a spare (it took a node, or it is gone)."""
        self.sent.pop(host, None)
