"""Block pool and free queue invariants, and KV cache sizing arithmetic (worked example)."""

from __future__ import annotations

import pytest

from tokenmill.core.kv_cache.block_pool import BlockPool
from tokenmill.core.kv_cache.sizing import compute_kv_cache_sizing
from tokenmill.protocol.config import CacheConfig
from tokenmill.protocol.scheduler_output import KVCacheSpec


def test_free_queue_is_lru_and_removes_from_the_middle() -> None:
    pool = BlockPool(6)  # block 0 is the null block
    assert pool.num_free_blocks == 5
    a = pool.get_new_blocks(3)
    assert [b.block_id for b in a] == [1, 2, 3]
    for block in a:  # full blocks: freed, they queue by age (unhashed ones would go first)
        pool.cache_full_block(block, bytes([block.block_id]))
    pool.free_blocks(reversed(a))  # freed tail first: 3, 2, 1 join the queue's end
    assert [b.block_id for b in pool.free_queue] == [4, 5, 3, 2, 1]
    pool.touch([pool.blocks[2]])  # a hit on a free block pulls it out of the middle
    assert [b.block_id for b in pool.free_queue] == [4, 5, 3, 1]
    assert pool.blocks[2].ref_cnt == 1
    assert [b.block_id for b in pool.get_new_blocks(2)] == [4, 5]
    with pytest.raises(ValueError, match="only 2 are free"):
        pool.get_new_blocks(3)


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(4)
    ids = [b.block_id for b in pool.get_new_blocks(3)]
    assert 0 not in ids and pool.num_free_blocks == 0 and pool.usage() == 1.0


def test_double_free_is_caught() -> None:
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError):
        pool.free_blocks([block])


def _specs(layers: int, kv_heads: int, head_size: int, dtype_bytes: int, block_size: int):
    return [KVCacheSpec(block_size, kv_heads, head_size, dtype_bytes) for _ in range(layers)]


def test_worked_sizing_example() -> None:
    # 8 layers, 8 KV heads, head size 128, fp16, block size 16, 4 GiB available.
    specs = _specs(8, 8, 128, 2, 16)
    assert specs[0].page_size_bytes == 2 * 16 * 8 * 128 * 2  # 64 KiB per layer
    sizing = compute_kv_cache_sizing(specs, 4 << 30, CacheConfig(block_size=16), 4096, 8192)
    assert sizing.bytes_per_block == 512 * 1024
    assert sizing.num_blocks == 8192
    assert sizing.capacity_tokens == 131072
    assert sizing.max_concurrency == 32


def test_override_wins_and_auto_fit() -> None:
    specs = _specs(2, 2, 8, 4, 16)
    cache = CacheConfig(block_size=16, num_gpu_blocks_override=11)
    sizing = compute_kv_cache_sizing(specs, 10**12, cache, -1, 100_000)
    # 10 usable blocks (block 0 is the null block) of 16 tokens.
    assert sizing.num_blocks == 11 and sizing.max_model_len == 160
    capped = compute_kv_cache_sizing(specs, 10**12, cache, -1, 100)
    assert capped.max_model_len == 100


def test_too_little_memory_names_bytes_needed_and_available() -> None:
    specs = _specs(2, 2, 8, 4, 16)  # 4 KiB per block over both layers
    # 512 tokens = 32 blocks, plus the null block: 33 * 4096 bytes.
    with pytest.raises(ValueError, match=r"needs 135168 bytes .* only 10000 bytes"):
        compute_kv_cache_sizing(specs, 10_000, CacheConfig(block_size=16), 512, 1024)


def test_a_sliding_window_bounds_what_a_request_holds() -> None:
    """Where every layer slides, a request holds at most the blocks of its window plus one
    step's tokens, and one more where the window starts inside a block (vLLM's
    SlidingWindowSpec): a max_model_len the cache could not hold whole fits, and the
    concurrency counts requests of that size."""
    specs = _specs(2, 2, 8, 4, 16)
    cache = CacheConfig(block_size=16, num_gpu_blocks_override=21)  # 20 usable: 320 tokens
    # window_tokens 100 (say a 64-token window and 36 tokens a step): cdiv(100, 16) + 1 = 8 blocks.
    sizing = compute_kv_cache_sizing(specs, 10**12, cache, 4096, 8192, window_tokens=100)
    assert sizing.max_model_len == 4096 and sizing.max_request_tokens == 128
    assert sizing.max_concurrency == 21 * 16 / 128
    with pytest.raises(ValueError, match="max_model_len=4096"):  # whole, it does not fit
        compute_kv_cache_sizing(specs, 10**12, cache, 4096, 8192)
    # Fitted: the model's whole context, since the window fits.
    fitted = compute_kv_cache_sizing(specs, 10**12, cache, -1, 8192, window_tokens=100)
    assert fitted.max_model_len == 8192
    short = compute_kv_cache_sizing(specs, 10**12, cache, 64, 8192, window_tokens=100)
    assert short.max_request_tokens == 64  # a request shorter than its window
    # A window the cache cannot hold: cdiv(400, 16) + 1 = 26 blocks, 416 tokens.
    with pytest.raises(ValueError, match="fewer than the 416 one request"):
        compute_kv_cache_sizing(specs, 10**12, cache, 4096, 8192, window_tokens=400)
    free = CacheConfig(block_size=16)  # 4 KiB a block, 100 KiB: 24 usable blocks, 384 tokens
    with pytest.raises(ValueError, match=r"needs 110592 bytes .* 416 tokens \(the sliding"):
        compute_kv_cache_sizing(specs, 100 * 1024, free, 4096, 8192, window_tokens=400)
    # With too little room for the window, max_model_len=-1 fits a whole request instead.
    assert (
        compute_kv_cache_sizing(specs, 10**12, cache, -1, 8192, window_tokens=400).max_model_len
        == 320
    )


# ------------------------------------------------------- vLLM V1's block-pool behaviours
def test_freed_blocks_without_a_hash_are_reused_first() -> None:
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)  # 1, 2 full and hashed; 3 partial
    pool.cache_full_block(a[0], b"h1")
    pool.cache_full_block(a[1], b"h2")
    pool.free_blocks(reversed(a))
    # The partial block goes to the head; the hashed ones queue at the tail (LRU).
    assert [b.block_id for b in pool.free_queue] == [3, 4, 5, 2, 1]
    (first,) = pool.get_new_blocks(1)
    assert first.block_id == 3
    assert pool.get_cached_block(b"h1") is a[0] and pool.get_cached_block(b"h2") is a[1]


def test_two_copies_of_a_block_stay_reachable_under_their_hash() -> None:
    pool = BlockPool(6)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_block(first, b"same")
    pool.cache_full_block(second, b"same")  # another request computed the same tokens
    assert second.block_hash == b"same"
    assert set(pool.cached_blocks[b"same"]) == {first.block_id, second.block_id}
    pool.free_blocks([first, second])  # queue: 3, 4, 5, first, second
    # Evicting one copy (its block is handed out again) leaves the other as a hit.
    assert [b.block_id for b in pool.get_new_blocks(4)][-1] == first.block_id
    assert first.block_hash is None and pool.get_cached_block(b"same") is second
    assert set(pool.cached_blocks[b"same"]) == {second.block_id}


def test_reset_prefix_cache_refuses_while_blocks_are_in_use() -> None:
    pool = BlockPool(5)
    held = pool.get_new_blocks(2)
    pool.cache_full_block(held[0], b"h")
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(b"h") is held[0] and held[0].block_hash == b"h"
    pool.free_blocks(held)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(b"h") is None and held[0].block_hash is None


def test_reset_prefix_cache_hands_out_blocks_from_the_lowest_ids_again() -> None:
    """After a reset nothing cached is at stake: the blocks used before (lowest ids, whose
    memory is touched already) are handed out first, not the never-used ones behind them."""
    pool = BlockPool(10)
    first = pool.get_new_blocks(3)
    assert [b.block_id for b in first] == [1, 2, 3]
    for i, block in enumerate(first):
        pool.cache_full_block(block, bytes([i]))
    pool.free_blocks(first)  # hashed: to the tail, behind the never-used blocks 4..9
    assert [b.block_id for b in pool.get_new_blocks(1)] == [4]
    pool.free_blocks([pool.blocks[4]])
    assert pool.reset_prefix_cache() is True
    assert [b.block_id for b in pool.get_new_blocks(4)] == [1, 2, 3, 4]
    assert pool.num_free_blocks == 5
