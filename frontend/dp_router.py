"""Which data-parallel rank gets a request: by load, and by the prefixes each rank holds.

Load is vLLM's score, waiting x 4 + running, from the rank's latest scheduler stats, with the
requests this client sent that the stats do not show yet counted as waiting. The prefix side
is tokenmill's own: the client keeps, per rank, a record of the prompt (and finished output)
blocks it sent there, as chained block hashes (protocol/hashing.py) in LRU order and at most
as many as the rank's KV cache has blocks, since its prefix cache cannot hold more. A request
goes to the rank whose record holds most of its prompt's leading blocks, unless that rank's
load exceeds the least loaded rank's by more than the margin; otherwise (no rank holds any
of it, or "load" routing) to the least loaded rank. Owned by the data-parallel client
(frontend/dp_client.py), which calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tokenmill.protocol.hashing import BlockHash, extend_block_hashes
from tokenmill.protocol.messages import SchedulerStats

WAITING_WEIGHT = 4  # vLLM's: a waiting request costs a rank more than a running one


class PrefixRecord:
    """The blocks one rank was sent, least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(capacity, 1)
        self.blocks: OrderedDict[BlockHash, None] = OrderedDict()

    def matched(self, hashes: Sequence[BlockHash]) -> int:
        """How many of the leading blocks the record holds (a chained hash names its whole
        prefix, so the first miss ends the match)."""
        for i, block in enumerate(hashes):
            if block not in self.blocks:
                return i
        return len(hashes)

    def add(self, hashes: Sequence[BlockHash]) -> None:
        for block in hashes:
            self.blocks[block] = None
            self.blocks.move_to_end(block)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)

    def clear(self) -> None:
        self.blocks.clear()


class RankLoad:
    """What the router knows of one rank."""

    def __init__(self, index: int, num_blocks: int) -> None:
        self.index = index
        self.stats = SchedulerStats()  # as of the rank's latest message
        self.unfinished = 0  # requests this client sent there that have not finished
        self.record = PrefixRecord(num_blocks)

    def score(self) -> int:
        running = self.stats.num_running
        waiting = max(self.stats.num_waiting, self.unfinished - running)
        return WAITING_WEIGHT * waiting + running


class Router:
    def __init__(self, routing: str, margin: int, block_size: int) -> None:
        self.by_prefix = routing == "prefix"
        self.margin = margin
        self.block_size = block_size

    def block_hashes(
        self, token_ids: list[int], hashes: list[BlockHash] | None = None, salt: bytes = b""
    ) -> list[BlockHash]:
        """The chained hashes of the full blocks of `token_ids` (none with "load" routing),
        extending `hashes` (those of a prefix of the same tokens) where given. `salt` is the
        request's LoRA adapter's (a rank's blocks of one adapter are no prefix for another)."""
        hashes = [] if hashes is None else hashes
        if self.by_prefix:
            extend_block_hashes(hashes, token_ids, self.block_size, salt)
        return hashes

    def choose(self, ranks: Sequence[RankLoad], hashes: Sequence[BlockHash]) -> RankLoad:
        """The rank for a prompt with these block hashes, among `ranks` (the live ones)."""
        assert ranks, "no rank to route to"
        matched = {r.index: r.record.matched(hashes) for r in ranks} if hashes else {}
        # Least loaded; among equals, the one holding more of the prompt, then the first.
        least = min(ranks, key=lambda r: (r.score(), -matched.get(r.index, 0), r.index))
        if not matched:
            return least
        best = max(ranks, key=lambda r: (matched[r.index], -r.score(), -r.index))
        if matched[best.index] and best.score() - least.score() <= self.margin:
            return best
        return least
