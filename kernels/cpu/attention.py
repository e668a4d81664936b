"""Decode and prefill attention reading the paged KV cache in place, and the cache write
(csrc/attention.cpp, prefill_attention.cpp); their references are kernels/reference.py's
`write_kv_cache` and `paged_attention`, and the torch backend's SDPA calls. Cache layout, one
layer: [blocks, 2, block_size, kv_heads, d]."""

from __future__ import annotations

import torch


def kv_cache_write(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
) -> None:
    """Stores token i's key and value ([T, kv_heads, d]) at cache slot slots[i]."""
    torch.ops.tokenmill.kv_cache_write(kv_cache, key, value, slots)


def decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """query [B, heads, d], one token per request at position seq_lens[b] - 1, attending to
    the request's cached keys (block_table [>= B, blocks]) -> [B, heads, d]."""
    return torch.ops.tokenmill.decode_attention(
        query, kv_cache, block_table, seq_lens, scale, window or 0, softcap or 0.0
    )


def prefill_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Request p's queries query[query_start[p]:query_start[p + 1]] ([T, heads, d]), the last
    tokens of its seq_lens[p], attend causally to its cached keys (block_table [>= P, blocks],
    this step's keys already written); the result goes into the same rows of out."""
    torch.ops.tokenmill.prefill_attention(
        out, query, kv_cache, block_table, query_start, seq_lens, scale, window or 0,
        softcap or 0.0,
    )  # fmt: skip
