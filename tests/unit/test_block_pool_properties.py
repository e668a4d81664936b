"""Property-based tests of the KV cache manager and block pool (hypothesis).

Random sequences of admissions (with prefix-cache lookups), growth, frees and cache resets
over a small token alphabet, so that prefixes collide often. After every step: reference
counts match the requests holding each block, a block is never both free and referenced,
the free queue holds exactly the unreferenced blocks, and every cache entry points at a block
whose (modelled) contents are exactly the prefix its hash stands for. The same machine with a
sliding window on every layer also checks that a request never loses a block its next query
attends to, and that the blocks wholly behind that window are back in the pool.
"""

from __future__ import annotations

import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tokenmill.core.kv_cache.manager import KVCacheManager
from tokenmill.core.request import Request
from tokenmill.protocol.messages import EngineCoreRequest, SamplingParams

BLOCK_SIZE = 2
NUM_BLOCKS = 12
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=9)


class KVCacheMachine(RuleBasedStateMachine):
    LOOKBACK: int | None = None  # every layer's sliding window, in tokens

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(
            NUM_BLOCKS, BLOCK_SIZE, enable_caching=True, lookback=self.LOOKBACK
        )
        self.live: dict[str, Request] = {}
        # What each block holds: the whole token prefix up to the end of that block.
        self.contents: dict[int, tuple[int, ...]] = {}
        self.ids = itertools.count()

    def _written(self, request: Request) -> None:
        """The model wrote K/V for every computed token: record full blocks' contents."""
        blocks = self.kv.req_to_blocks[request.request_id]
        tokens = request.all_token_ids
        for i in range(request.num_computed_tokens // BLOCK_SIZE):
            if blocks[i] is not self.kv.block_pool.null_block:  # (behind the window)
                self.contents[blocks[i].block_id] = tuple(tokens[: (i + 1) * BLOCK_SIZE])

    @rule(tokens=tokens_st)
    def admit(self, tokens: list[int]) -> None:
        request = Request(
            EngineCoreRequest(str(next(self.ids)), tokens, SamplingParams(), [], 0.0), 10**6
        )
        hits, num_hit = self.kv.get_computed_blocks(request)
        assert num_hit < len(tokens)
        null = self.kv.block_pool.null_block
        for i, block in enumerate(hits):
            if block is not null:
                assert self.contents[block.block_id] == tuple(tokens[: (i + 1) * BLOCK_SIZE])
        if self.LOOKBACK is not None:
            # Only blocks wholly behind the first query's window may be missing.
            oldest_key = max(num_hit - self.LOOKBACK + 1, 0)
            assert all(b is not null for b in hits[oldest_key // BLOCK_SIZE :])
        else:
            assert null not in hits
        request.num_computed_tokens = num_hit
        if self.kv.allocate_slots(request, len(tokens) - num_hit, hits) is None:
            self.kv.req_to_blocks.pop(request.request_id, None)
            return
        request.num_computed_tokens = len(tokens)
        self.live[request.request_id] = request
        self._written(request)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), extra=tokens_st)
    def grow(self, data: st.DataObject, extra: list[int]) -> None:
        request = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        for t in extra:
            request.append_output_token(t)
        if self.kv.allocate_slots(request, len(extra)) is None:
            del request.all_token_ids[-len(extra) :]
            del request.output_token_ids[-len(extra) :]
            return
        if self.LOOKBACK is not None:
            # Everything wholly behind the first new query's window went back to the pool.
            oldest_key = request.num_computed_tokens - self.LOOKBACK + 1
            blocks = self.kv.req_to_blocks[request.request_id]
            behind = blocks[: max(oldest_key, 0) // BLOCK_SIZE]
            assert all(b is self.kv.block_pool.null_block for b in behind)
        request.num_computed_tokens += len(extra)
        self._written(request)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        request = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.kv.free(request)

    @rule()
    def reset(self) -> None:
        self.kv.reset_prefix_cache()

    @invariant()
    def pool_is_consistent(self) -> None:
        pool = self.kv.block_pool
        held: dict[int, int] = {}
        for request_id in self.live:
            for block in self.kv.req_to_blocks[request_id]:
                held[block.block_id] = held.get(block.block_id, 0) + 1
        free_ids = [b.block_id for b in pool.free_queue]
        assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks
        for block in pool.blocks[1:]:
            assert block.ref_cnt == held.get(block.block_id, 0)
            assert (block.ref_cnt == 0) == (block.block_id in free_ids)
        assert pool.null_block.ref_cnt == 1 and 0 not in free_ids

    @invariant()
    def hashes_point_at_matching_contents(self) -> None:
        pool = self.kv.block_pool
        seen: dict[bytes, tuple[int, ...]] = {}
        for block_hash, copies in pool.cached_blocks.items():
            assert copies, "an empty entry should have been removed"
            for block_id, block in copies.items():
                assert block.block_hash == block_hash and block.block_id == block_id
                contents = self.contents[block.block_id]
                assert seen.setdefault(block_hash, contents) == contents  # copies agree
        for request in self.live.values():
            for i, block_hash in enumerate(request.block_hashes):
                if block_hash in seen:
                    assert seen[block_hash] == tuple(request.all_token_ids[: (i + 1) * BLOCK_SIZE])

    @invariant()
    def the_window_keeps_its_blocks(self) -> None:
        """The next query (at num_computed_tokens) attends back LOOKBACK tokens: every block
        it reads is a real one."""
        null = self.kv.block_pool.null_block
        for request in self.live.values():
            blocks = self.kv.req_to_blocks[request.request_id]
            oldest_key = max(request.num_computed_tokens - (self.LOOKBACK or 10**9) + 1, 0)
            assert all(b is not null for b in blocks[oldest_key // BLOCK_SIZE :])


class SlidingKVCacheMachine(KVCacheMachine):
    LOOKBACK = 3


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestSlidingKVCacheMachine = SlidingKVCacheMachine.TestCase
TestSlidingKVCacheMachine.settings = TestKVCacheMachine.settings
