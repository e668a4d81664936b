"""The attention backend contract.

Once per step the model runner describes the flattened batch in a `StepAttentionInputs`
(decode requests first, one query token each, then the requests still prefilling); the
backend turns it into its own metadata, which every attention layer then reads from the
forward context. `forward` writes the step's K/V into the layer's paged cache, then attends.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch


@dataclass
class StepAttentionInputs:
    num_decodes: int  # the first num_decodes requests have exactly one query token
    query_lens: np.ndarray  # [R] new tokens per request
    seq_lens: np.ndarray  # [R] tokens in context after this step (computed + new)
    block_table: np.ndarray  # [R, max_blocks] block ids, 0 (the null block) past the end
    slot_mapping: np.ndarray  # [T] cache slot of each new token
    block_size: int
    device: torch.device
    dtype: torch.dtype  # the model's activations


def cache_torch_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for kv_cache_dtype: the model's ("auto"), or fp8 e4m3
    ("fp8", "fp8_e4m3"): values saturate at +-448 and round to nearest even; scales are 1.0,
    as vLLM's where the checkpoint has no calibrated ones."""
    return model_dtype if cache_dtype == "auto" else torch.float8_e4m3fn


class AttentionBackend(ABC):
    """A backend is registered by name (registry.py) and says what it supports; the model
    runner and the draft model allocate each layer's cache in its `kv_cache_shape`."""

    name: ClassVar[str]
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16, torch.float16)
    captures_steps: ClassVar[bool] = False  # its steps replay from CUDA graphs
    # Every backend takes sliding windows and soft-capped scores (forward's `window`,
    # `softcap`).

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """One layer's cache. Every backend so far reads [blocks, 2 (K, V), block_size,
        kv_heads, head_size]: a block's keys, then its values, each position's heads side
        by side (the CPU kernels read a position's heads in one pass, the Triton ones a
        block's rows of one head at a stride)."""
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    def set_block_bytes(self, block_bytes: int) -> None:
        """The KV cache's page size (K+V of one block in one layer), told once the cache is
        sized; backends that size their scratch by it override this."""

    @abstractmethod
    def build_metadata(self, inputs: StepAttentionInputs) -> Any:
        """Turns the step description into what `forward` reads; called once per step."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: Any,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """query [T, heads, d], key/value [T, kv_heads, d] -> output [T, heads, d].
        A layer's own settings: `window` (sliding-window attention: a query at position p
        sees keys p - window < k <= p) and `softcap` (scores -> softcap * tanh(scores /
        softcap) before the softmax)."""
