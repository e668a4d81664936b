"""KV cache sizing: from the workers' layer specs and free memory to a number of blocks.

Called once by EngineCore at start-up, after the executor has loaded the model. Every
attention layer reports a `KVCacheSpec`; one block holds `block_size` tokens in every layer,
so `num_blocks = available_bytes // sum(page_size_bytes over layers)`. With
`max_model_len == -1` the context length is fitted to what one request can hold.
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

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """How many requests of max_model_len tokens fit at once."""
        return self.capacity_tokens / self.max_model_len


def compute_kv_cache_sizing(
    specs: list[KVCacheSpec],
    available_bytes: int,
    cache_config: CacheConfig,
    max_model_len: int,
    max_fit_len: int,
) -> KVCacheSizing:
    """max_fit_len: the longest context `max_model_len=-1` may fit to (the model's position
    limit, and without chunked prefill also the step's token budget, which a prompt or a
    preempted request's recomputation must fit in)."""
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
    if max_model_len == -1:
        max_model_len = min(usable_tokens, max_fit_len)
        if max_model_len < 1:
            raise ValueError(_too_small_message(1, block_size, bytes_per_block, available_bytes))
        logger.info("max_model_len=-1: fitted to %d tokens", max_model_len)
    elif usable_tokens < max_model_len:
        if cache_config.num_gpu_blocks_override is not None:
            raise ValueError(
                f"num_gpu_blocks_override={num_blocks} blocks of {block_size} tokens hold "
                f"{usable_tokens} tokens per request (block 0 is reserved), fewer than "
                f"max_model_len={max_model_len}"
            )
        raise ValueError(
            _too_small_message(max_model_len, block_size, bytes_per_block, available_bytes)
        )
    sizing = KVCacheSizing(num_blocks, block_size, bytes_per_block, max_model_len)
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
    max_model_len: int, block_size: int, bytes_per_block: int, available_bytes: int
) -> str:
    blocks = cdiv(max_model_len, block_size) + 1  # + the null block
    needed = blocks * bytes_per_block
    return (
        f"The KV cache needs {needed} bytes ({needed / _GIB:.3f} GiB) to hold one request of "
        f"max_model_len={max_model_len} tokens, but only {available_bytes} bytes "
        f"({available_bytes / _GIB:.3f} GiB) are available ({needed - available_bytes} bytes "
        f"missing). Raise kv_cache_memory_bytes / gpu_memory_utilization or lower max_model_len."
    )
