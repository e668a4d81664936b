"""The attention layer: owns one layer's KV cache tensor and calls the attention backend.

The model runner binds `kv_cache` after the core has sized the cache, and publishes each
step's metadata through the forward context.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.protocol.scheduler_output import KVCacheSpec
from tokenmill.worker.attention.base import AttentionBackend
from tokenmill.worker.forward_context import get_forward_context


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        num_kv_heads: int,
        scale: float,
        backend: AttentionBackend,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        """sliding_window: this layer's window (None: full attention); logit_softcap:
        Gemma 2's attention-score soft-capping."""
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.backend = backend
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        self.kv_cache = torch.empty(0)

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return KVCacheSpec(
            block_size=block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype_bytes=torch.empty(0, dtype=dtype).element_size(),
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, heads, d], k/v [T, kv_heads, d] -> [T, heads * d]."""
        metadata = get_forward_context().attn_metadata
        out = self.backend.forward(
            q, k, v, self.kv_cache, metadata, self.scale, self.sliding_window, self.logit_softcap
        )
        return out.reshape(out.shape[0], -1)
