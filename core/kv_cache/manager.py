"""Per-request block tables on top of the BlockPool.

The Scheduler asks `allocate_slots(request, n)` before scheduling `n` more tokens of a
request and `free(request)` when it finishes or is preempted. The block ids it hands out are
what the workers write K/V into (sent to them in the SchedulerOutput diff).
"""

from __future__ import annotations

from tokenmill.core.kv_cache.block_pool import BlockPool, KVCacheBlock
from tokenmill.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def usage(self) -> float:
        return self.block_pool.usage()

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Makes room for `num_new_tokens` more tokens; returns the new block ids, or None
        (allocating nothing) when the pool is short."""
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - len(blocks)
        if needed <= 0:
            return []
        if needed > self.block_pool.num_free_blocks:
            return None
        new_blocks = self.block_pool.get_new_blocks(needed)
        blocks.extend(new_blocks)
        return [b.block_id for b in new_blocks]

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        # Tail blocks first: they are the least likely to be shared, so evict them first.
        self.block_pool.free_blocks(reversed(blocks))
