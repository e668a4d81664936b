"""KV cache sizing: from the workers' layer specs and free memory to a number of blocks.

Called once by EngineCore at start-up, after the executor has loaded the model. Every
attention layer reports a `KVCacheSpec`; one block holds `block_size` tokens in every layer,
so `num_blocks = available_bytes // sum(page_size_bytes over layers)`. With
`max_model_len == -1` the context length is fitted to what one request can hold.

Where every layer slides (Mistral), a request holds at most the blocks that cover its
window and one step's new tokens, plus one where the window starts inside a block (vLLM's
`SlidingWindowSpec.max_memory_usage_bytes`): a request of any length fits when that does,
and the concurrency counts requests of that size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tokenmill.protocol.config import CacheConfig
from tokenmill.protocol.scheduler_output import KVCacheSpec
from tokenmill.protocol.utils import cdiv

logger = logging.getLogger(__name__)

_GIB = 1 << 30


@dataclass(frozen=True)
class KVCacheSizing:
    num_blocks: int
    block_size: int
    bytes_per_block: int  # one block across all layers
    max_model_len: int
    # The most tokens' worth of blocks one request holds at once (max_model_len's, or less
    # where blocks behind a sliding window are freed).
    max_request_tokens: int

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """How many requests of max_model_len tokens fit at once."""
        return self.capacity_tokens / self.max_request_tokens


def compute_kv_cache_sizing(
    specs: list[KVCacheSpec],
    available_bytes: int,
    cache_config: CacheConfig,
    max_model_len: int,
    max_fit_len: int,
    window_tokens: int | None = None,
) -> KVCacheSizing:
    """max_fit_len: the longest context `max_model_len=-1` may fit to (the model's position
    limit, and without chunked prefill also the step's token budget, which a prompt or a
    preempted request's recomputation must fit in). window_tokens: where blocks behind a
    window are freed, the most tokens a request keeps (its window plus one step's tokens)."""
    if not specs:
        raise ValueError("the model reported no attention layers, so there is no KV cache to size")
    block_sizes = {s.block_size for s in specs}
    if len(block_sizes) != 1:
        raise ValueError(f"all layers must share one block size, got {sorted(block_sizes)}")
    block_size = block_sizes.pop()
    bytes_per_block = sum(s.page_size_bytes for s in specs)
    if cache_config.num_gpu_blocks_override is not None:
        num_blocks = cache_config.num_gpu_blocks_override
    else:
        num_blocks = max(available_bytes, 0) // bytes_per_block
    # Block 0 is the null block, so a request can use at most num_blocks - 1 blocks.
    usable_tokens = max(num_blocks - 1, 0) * block_size
    # A window starting inside a block keeps that block: one more than the window covers.
    windowed = None if window_tokens is None else (cdiv(window_tokens, block_size) + 1) * block_size
    if max_model_len == -1:
        # A window that fits lets a request grow to any length.
        fits_any = windowed is not None and windowed <= usable_tokens
        max_model_len = max_fit_len if fits_any else min(usable_tokens, max_fit_len)
        if max_model_len < 1:
            raise ValueError(_too_small_message(1, block_size, bytes_per_block, available_bytes))
        logger.info("max_model_len=-1: fitted to %d tokens", max_model_len)
    max_request_tokens = max_model_len if windowed is None else min(windowed, max_model_len)
    if usable_tokens < max_request_tokens:
        if cache_config.num_gpu_blocks_override is not None:
            raise ValueError(
                f"num_gpu_blocks_override={num_blocks} blocks of {block_size} tokens hold "
                f"{usable_tokens} tokens per request (block 0 is reserved), fewer than "
                f"the {max_request_tokens} one request of max_model_len={max_model_len} holds"
            )
        raise ValueError(
            _too_small_message(
                max_request_tokens, block_size, bytes_per_block, available_bytes, max_model_len
            )
        )
    sizing = KVCacheSizing(
        num_blocks, block_size, bytes_per_block, max_model_len, max_request_tokens
    )
    logger.info(
        "KV cache: %d blocks of %d tokens (%.2f GiB), capacity %d tokens, "
        "max concurrency %.2fx at max_model_len=%d",
        sizing.num_blocks,
        block_size,
        sizing.num_blocks * bytes_per_block / _GIB,
        sizing.capacity_tokens,
        sizing.max_concurrency,
        max_model_len,
    )
    return sizing


def _too_small_message(
    tokens: int,
    block_size: int,
    bytes_per_block: int,
    available_bytes: int,
    max_model_len: int | None = None,
) -> str:
    """max_model_len: where it is not `tokens` (a sliding window's share of it)."""
    blocks = cdiv(tokens, block_size) + 1  # + the null block
    needed = blocks * bytes_per_block
    what = f"max_model_len={tokens} tokens"
    if max_model_len is not None and max_model_len != tokens:
        what = (
            f"{tokens} tokens (the sliding window and one step's tokens; "
            f"max_model_len={max_model_len})"
        )
    return (
        f"The KV cache needs {needed} bytes ({needed / _GIB:.3f} GiB) to hold one request of "
        f"{what}, but only {available_bytes} bytes "
        f"({available_bytes / _GIB:.3f} GiB) are available ({needed - available_bytes} bytes "
        f"missing). Raise kv_cache_memory_bytes / gpu_memory_utilization or lower max_model_len."
    )
