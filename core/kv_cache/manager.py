"""Per-request block tables on top of the BlockPool, with prefix caching.

The Scheduler asks `get_computed_blocks(request)` when it first considers a waiting request
(the longest cached prefix, in whole blocks), then `allocate_slots(request, n, hits)` before
scheduling `n` more tokens, and `free(request)` when it finishes or is preempted. Full blocks
are registered under their prefix hash as soon as the step that fills them is scheduled, so a
request scheduled later in the same step can share them: each layer writes the step's K/V
before it attends.

Where every layer attends within a sliding window (`lookback` tokens, Mistral), the blocks
wholly before the window of a request's next query are never read again: `allocate_slots`
returns them to the pool first and puts the null block in their place (vLLM's
SlidingWindowManager). They stay registered in the prefix cache until the pool hands them out
again, so a later request with the same prefix can still hit them. The workers keep the old
ids in their block tables: both attention backends mask (or skip) every key outside the window,
so whatever a reused block holds there is never weighed.
"""

from __future__ import annotations

from tokenmill.core.kv_cache.block_pool import BlockPool, KVCacheBlock
from tokenmill.core.request import Request
from tokenmill.protocol.hashing import extend_block_hashes
from tokenmill.protocol.utils import cdiv


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        lookback: int | None = None,
        rollback: int = 0,
    ) -> None:
        """lookback: the sliding window every layer attends within (None: the whole
        context); rollback: how many of a request's computed tokens a step may still take
        back (rejected speculative tokens), whose queries then need older keys."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.lookback = lookback
        self.rollback = rollback
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
        if self.lookback is not None:
            return self._sliding_window_hits(request.block_hashes[:max_blocks])
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def _sliding_window_hits(self, hashes: list[bytes]) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix whose last window is cached (vLLM's sliding-window
        lookup): the first query after it attends only to the cdiv(lookback - 1, block_size)
        blocks before it, so the blocks further back may have been freed and reused; they
        come back as the null block. A hash names its whole prefix, so each cached block
        found holds exactly this request's tokens."""
        assert self.lookback is not None
        needed = max(cdiv(self.lookback - 1, self.block_size), 1)
        run: list[KVCacheBlock] = []  # cached blocks in a row, back from the last looked at
        for i in range(len(hashes) - 1, -1, -1):
            block = self.block_pool.get_cached_block(hashes[i])
            if block is None:
                run = []
                continue
            run.append(block)
            if len(run) == needed or i == 0:  # blocks [i, i + len(run)) cover the window
                hits = [self.block_pool.null_block] * i + run[::-1]
                return hits, len(hits) * self.block_size
        return [], 0

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
        if self.lookback is not None:
            self._free_skipped_blocks(request, blocks)
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

    def _free_skipped_blocks(self, request: Request, blocks: list[KVCacheBlock]) -> None:
        """Frees the blocks wholly before the window of the request's next query (position
        num_computed_tokens - rollback, the earliest a step may start from), keeping their
        places as the null block."""
        assert self.lookback is not None
        first_query = request.num_computed_tokens - self.rollback
        first_key = first_query - self.lookback + 1  # the oldest key that query attends to
        num_skipped = min(max(first_key, 0) // self.block_size, len(blocks))
        null = self.block_pool.null_block
        skipped = []
        # From the window back: past the first null block every earlier one was freed before.
        for i in range(num_skipped - 1, -1, -1):
            if blocks[i] is null:
                break
            skipped.append(blocks[i])
            blocks[i] = null
        # The newest first, to be evicted first, as `free` does: a prefix-cache hit needs
        # every block from the first on.
        self.block_pool.free_blocks(skipped)

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
