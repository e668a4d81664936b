"""Per-request block tables on top of the BlockPool, with prefix caching.

The Scheduler asks `get_computed_blocks(request)` when it first considers a waiting request
(the longest cached prefix, in whole blocks), then `allocate_slots(request, n, hits)` before
scheduling `n` more tokens, and `free(request)` when it finishes or is preempted. Full blocks
are registered under their prefix hash as soon as the step that fills them is scheduled, so a
request scheduled later in the same step can share them: each layer writes the step's K/V
before it attends.
"""

from __future__ import annotations

from tokenmill.core.kv_cache.block_pool import BlockPool, KVCacheBlock
from tokenmill.core.request import Request
from tokenmill.protocol.hashing import extend_block_hashes
from tokenmill.protocol.utils import cdiv


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Prompt tokens looked up in / found in the prefix cache (first scheduling only).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def usage(self) -> float:
        return self.block_pool.usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The cached blocks that start this request's tokens, and how many tokens they
        cover. The last token is always left to compute, so that it yields logits."""
        if not self.enable_caching:
            return [], 0
        extend_block_hashes(
            request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt
        )
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_lookup(self, request: Request, num_hit_tokens: int) -> None:
        if not self.enable_caching:
            return  # nothing was looked up
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Makes room for `num_new_tokens` more tokens after `request.num_computed_tokens`
        (which already counts `computed_blocks`, the prefix hits of a newly admitted request),
        and `num_lookahead_tokens` slots beyond them (a draft model's proposal writes its K/V
        there; they are never registered in the prefix cache). Returns the ids of the blocks
        it added, or None, changing nothing, when the pool is short."""
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is None:
            blocks = self.req_to_blocks[request.request_id] = []
        total_tokens = request.num_computed_tokens + num_new_tokens
        num_needed = cdiv(total_tokens + num_lookahead_tokens, self.block_size) - len(blocks)
        added: list[KVCacheBlock] = []
        if computed_blocks:
            num_needed -= len(computed_blocks)
            # Hits on free blocks take them out of the free queue too.
            num_revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
            if max(num_needed, 0) + num_revived > self.block_pool.num_free_blocks:
                return None
            self.block_pool.touch(computed_blocks)
            added.extend(computed_blocks)
        if num_needed > 0:
            if num_needed > self.block_pool.num_free_blocks:
                return None
            added.extend(self.block_pool.get_new_blocks(num_needed))
        blocks.extend(added)
        # A block is registered in the prefix cache once the step that fills it is scheduled.
        if self.enable_caching and total_tokens // self.block_size > request.num_cached_blocks:
            self._cache_full_blocks(request, blocks, total_tokens)
        return [b.block_id for b in added]

    def _cache_full_blocks(
        self, request: Request, blocks: list[KVCacheBlock], num_tokens: int
    ) -> None:
        # Tokens past num_tokens (a later chunk) have no K/V yet, so their blocks wait.
        extend_block_hashes(
            request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt
        )
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        for i in range(request.num_cached_blocks, num_full):
            self.block_pool.cache_full_block(blocks[i], request.block_hashes[i])
        request.num_cached_blocks = max(request.num_cached_blocks, num_full)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        request.num_cached_blocks = 0
        # Tail blocks first: they are the least likely to be shared, so evict them first.
        self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        """False (nothing cleared) while any request holds blocks."""
        return self.block_pool.reset_prefix_cache()
