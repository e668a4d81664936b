"""Plain-torch reference ops for the paged KV cache: slow, per-request, obviously correct.

Every faster implementation (the CPU attention backend's batched path, Triton kernels) is
tested against these. KV cache layout, one layer: `(num_blocks, 2, block_size, kv_heads, d)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_MAX = 448.0  # fp8 e4m3's largest finite value


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values as a KV cache of `dtype` stores them: an fp8 (e4m3) cache saturates at +-448
    (torch's own conversion would make NaN past it) and rounds to nearest even below."""
    if dtype == torch.float8_e4m3fn:
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def write_kv_cache(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Stores token i's key/value ([T, kv_heads, d]) at slot `slot_mapping[i]`."""
    block_size = kv_cache.shape[2]
    for i, slot in enumerate(slot_mapping.tolist()):
        block, offset = divmod(slot, block_size)
        kv_cache[block, 0, offset] = to_cache(key[i], kv_cache.dtype)
        kv_cache[block, 1, offset] = to_cache(value[i], kv_cache.dtype)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: list[list[int]],
    seq_lens: list[int],
    query_lens: list[int],
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention for a flattened batch whose K/V already sit in the paged cache.

    query: [T, heads, d], the requests' new tokens back to back (query_lens of them each);
    request r's queries are the last query_lens[r] of its seq_lens[r] positions. `window`:
    a query at position p sees only keys p - window < k <= p (sliding-window attention).
    `softcap`: scores become softcap * tanh(scores / softcap) before the softmax (Gemma 2).
    Returns [T, heads, d].
    """
    num_heads, head_size = query.shape[1], query.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    start = 0
    for blocks, seq_len, q_len in zip(block_tables, seq_lens, query_lens):
        positions = torch.arange(seq_len)
        block_ids = torch.tensor(blocks, dtype=torch.long)[positions // block_size]
        keys = kv_cache[block_ids, 0, positions % block_size].float()  # [S, kvh, d]
        values = kv_cache[block_ids, 1, positions % block_size].float()
        q = query[start : start + q_len].float()  # [Q, h, d]
        for h in range(num_heads):
            kv_head = h // group
            scores = (q[:, h] @ keys[:, kv_head].T) * scale  # [Q, S]
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
            hidden = positions[None, :] > q_pos
            if window is not None:
                hidden |= positions[None, :] <= q_pos - window
            scores = scores.masked_fill(hidden, float("-inf"))
            out[start : start + q_len, h] = (scores.softmax(-1) @ values[:, kv_head]).to(out.dtype)
        start += q_len
    return out.reshape(-1, num_heads, head_size)


def fused_moe_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """A mixture-of-experts MLP (see kernels/fused_moe.py), grouped by expert: for each
    expert with tokens, one matmul over its tokens (gathered), SiLU-and-mul, one matmul,
    scaled by the routing weights and added into the tokens' rows (HF's order of
    operations). x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_* [T, top_k] -> [T, H]."""
    out = torch.zeros_like(x)
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    weights = topk_weights.reshape(-1)[order]
    tokens = order // top_k
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        rows = tokens[start : start + count]
        gate, up = F.linear(x[rows], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert]) * weights[start : start + count, None]
        out.index_add_(0, rows, y.to(x.dtype))
        start += count
    return out
