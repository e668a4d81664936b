"""Triton paged attention over a flattened varlen batch, and the cache write before it.

Layout (as everywhere in tokenmill): one layer's cache is `(num_blocks, 2, block_size,
kv_heads, d)`; queries are `[T, heads, d]`, request r's tokens at rows
`query_start[r]:query_start[r + 1]`, and they are the last of its `seq_lens[r]` positions.

One kernel serves prefills, chunked prefills and decodes. A program takes a tile of
`BLOCK_Q` consecutive query tokens of one request (a "tile": `tile_req`, `tile_q` say which)
and all the query heads that share one KV head, so that K and V are read once for the whole
group (GQA). Its rows are (token, head) pairs; it walks the request's context `BLOCK_N` keys
at a time through the block table, with an online softmax, and stops at the tile's causal
limit. With `num_splits > 1` (flash-decoding, meant for decodes) the context of every request
is cut into that many equal parts, one program each; they write partial outputs and their
log-sum-exp, and `_combine_splits` merges them, so that a few long requests still fill the GPU.

`FP32_DOT` (fp32 queries or caches, and the interpreter, where 16-bit arithmetic is not
exact) upcasts every operand after loading and multiplies in IEEE fp32 (no tensor cores: on a
GPU its tiles are kept to 32 x 32 so that they fit in shared memory without spilling);
otherwise the dots run in the queries' 16-bit type with fp32 accumulation, and scores are
scaled in fp32. An fp8 (e4m3) cache (kv_cache_dtype="fp8") is widened to the queries' type as
it is loaded; its values are rounded by torch as they are written (saturating at +-448,
reference.to_cache), and the write kernel copies their bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.launches import count_launch
from tokenmill.kernels.reference import to_cache


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    num_tokens,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_c_block,
    stride_c_kv,
    stride_c_tok,
    stride_c_head,
    BLOCK_SIZE: tl.constexpr,
    HEAD_D: tl.constexpr,
    ELEMS: tl.constexpr,  # kv_heads * d
    BLOCK_E: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slots = tl.load(slot_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    valid = (tokens < num_tokens) & (slots >= 0)  # slot -1: a padded token, written nowhere
    elems = tl.arange(0, BLOCK_E)
    head, dim = elems // HEAD_D, elems % HEAD_D
    mask = valid[:, None] & (elems < ELEMS)[None, :]
    t = tokens.to(tl.int64)[:, None]
    dst = (
        cache_ptr
        + (slots // BLOCK_SIZE)[:, None] * stride_c_block
        + (slots % BLOCK_SIZE)[:, None] * stride_c_tok
        + (head * stride_c_head + dim)[None, :]
    )
    k = tl.load(key_ptr + t * stride_k_t + (head * stride_k_h + dim)[None, :], mask=mask)
    tl.store(dst, k, mask=mask)
    v = tl.load(value_ptr + t * stride_v_t + (head * stride_v_h + dim)[None, :], mask=mask)
    tl.store(dst + stride_c_kv, v, mask=mask)


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Writes token i's key and value ([T, kv_heads, d], any row stride) into cache slot
    slot_mapping[i] (block slot // block_size, offset slot % block_size); slot -1 skips it."""
    num_tokens, kv_heads, head_size = key.shape
    if kv_cache.dtype == torch.float8_e4m3fn:  # torch rounds; the kernel copies bytes
        key = to_cache(key, kv_cache.dtype).view(torch.uint8)
        value = to_cache(value, kv_cache.dtype).view(torch.uint8)
        kv_cache = kv_cache.view(torch.uint8)
    assert key.stride(2) == 1 and value.stride(2) == 1 and kv_cache.is_contiguous()
    elems = triton.next_power_of_2(kv_heads * head_size)
    block_t = max(1, min(16, 2048 // elems))  # about 2K elements of K (and V) per program
    count_launch("reshape_and_cache")
    _reshape_and_cache_kernel[(triton.cdiv(num_tokens, block_t),)](
        key,
        value,
        kv_cache,
        slot_mapping,
        num_tokens,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        BLOCK_SIZE=kv_cache.shape[2],
        HEAD_D=head_size,
        ELEMS=kv_heads * head_size,
        BLOCK_E=elems,
        BLOCK_T=block_t,
    )


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, heads, d]; or partial outputs [T, heads, num_splits, d] when SPLIT
    lse_ptr,  # [T, heads, num_splits] fp32, SPLIT only
    q_ptr,
    cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_ptr,
    tile_req_ptr,
    tile_q_ptr,
    scale,
    window,  # HAS_WINDOW: a query at p sees keys p - window < k <= p
    softcap,  # HAS_SOFTCAP: scores -> softcap * tanh(scores / softcap)
    split_first,  # SPLIT: the first token row the partial buffers cover
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_l_t,
    stride_l_h,
    stride_c_block,
    stride_c_kv,
    stride_c_tok,
    stride_c_head,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    BLOCK_M: tl.constexpr,  # rows: >= BLOCK_Q * GROUP_PAD, and >= 16 for tl.dot
    BLOCK_N: tl.constexpr,  # keys per iteration
    HEAD_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    SPLIT: tl.constexpr,
    FP32_DOT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    req = tl.load(tile_req_ptr + tile)
    q_first = tl.load(tile_q_ptr + tile)
    q_begin = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + req)
    context = seq_len - q_len  # tokens computed before this step

    rows = tl.arange(0, BLOCK_M)
    tok = q_first + rows // GROUP_PAD  # query index within the request
    head_in_group = rows % GROUP_PAD
    row_ok = (rows < BLOCK_Q * GROUP_PAD) & (tok < q_len) & (head_in_group < GROUP)
    head = kv_head * GROUP + head_in_group
    q_pos = context + tok  # each row's position: it sees keys 0..q_pos
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_D
    t = (q_begin + tok).to(tl.int64)
    q = tl.load(
        q_ptr + t[:, None] * stride_q_t + (head * stride_q_h)[:, None] + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if FP32_DOT:
        q = q.to(tl.float32)

    # Keys this tile may see: up to its last token's position (causal), from its first
    # token's window (whole blocks of keys before it are skipped), then this split's part.
    kv_end = tl.minimum(seq_len, context + q_first + BLOCK_Q)
    kv_begin = 0
    if HAS_WINDOW:
        kv_begin = tl.maximum(context + q_first - window + 1, 0) // BLOCK_N * BLOCK_N
    if SPLIT:
        part = tl.cdiv(tl.cdiv(kv_end - kv_begin, num_splits), BLOCK_N) * BLOCK_N
        start = kv_begin + split * part
        stop = tl.minimum(kv_end, start + part)
    else:
        start = kv_begin
        stop = kv_end

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    head_off = kv_head * stride_c_head
    for n0 in range(start, stop, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        key_ok = keys < stop
        block = tl.load(block_table_ptr + req * stride_bt + keys // BLOCK_SIZE, mask=key_ok)
        offs = block.to(tl.int64) * stride_c_block + (keys % BLOCK_SIZE) * stride_c_tok + head_off
        k = tl.load(
            cache_ptr + offs[None, :] + dims[:, None],
            mask=key_ok[None, :] & dim_ok[:, None],
            other=0.0,
        )  # [D, N]
        if FP32_DOT:
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee") * scale
        else:
            s = tl.dot(q, k.to(q.dtype)) * scale  # (.to: an fp8 cache widened)
        if HAS_SOFTCAP:  # tanh(x) = 2 / (1 + exp(-2x)) - 1, finite at both ends
            s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * s / softcap)) - 1.0)
        visible = key_ok[None, :] & (keys[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (keys[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            cache_ptr + stride_c_kv + offs[:, None] + dims[None, :],
            mask=key_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )  # [N, D]
        if FP32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    if SPLIT:
        t = t - split_first
    o_rows = t[:, None] * stride_o_t + (head * stride_o_h)[:, None]
    if SPLIT:
        # Partial outputs [T, heads, num_splits, d]; a part with no keys has lse -inf.
        tl.store(
            out_ptr + o_rows + split * HEAD_D + dims[None, :],  # parts are contiguous
            out,
            mask=row_ok[:, None] & dim_ok[None, :],
        )
        lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + t * stride_l_t + head * stride_l_h + split, lse, mask=row_ok)
    else:
        tl.store(
            out_ptr + o_rows + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )


@triton.jit
def _combine_splits_kernel(
    out_ptr,
    part_ptr,  # [T, heads, num_splits, d] fp32
    lse_ptr,  # [T, heads, num_splits] fp32
    num_rows,  # T * heads
    num_heads,
    stride_o_t,
    stride_o_h,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (token, head) pairs
    row_ok = rows < num_rows
    splits = tl.arange(0, SPLITS_PAD)
    lse = tl.load(
        lse_ptr + rows[:, None] * NUM_SPLITS + splits[None, :],
        mask=row_ok[:, None] & (splits < NUM_SPLITS)[None, :],
        other=float("-inf"),
    )  # [R, S]
    m = tl.max(lse, 1)
    m = tl.where(m == float("-inf"), 0.0, m)  # a padded row: every part empty
    w = tl.exp(lse - m[:, None])
    total = tl.sum(w, 1)
    w = w / tl.where(total > 0.0, total, 1.0)[:, None]
    dims = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for s in range(NUM_SPLITS):
        part = tl.load(
            part_ptr + (rows[:, None] * NUM_SPLITS + s) * HEAD_D + dims[None, :],
            mask=row_ok[:, None] & (dims < HEAD_D)[None, :],
            other=0.0,
        )
        w_s = tl.sum(tl.where(splits[None, :] == s, w, 0.0), 1)
        acc += part * w_s[:, None]
    t = (rows // num_heads).to(tl.int64)
    head = rows % num_heads
    tl.store(
        out_ptr + t[:, None] * stride_o_t + (head * stride_o_h)[:, None] + dims[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (dims < HEAD_D)[None, :],
    )


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    tile_req: torch.Tensor,
    tile_q: torch.Tensor,
    block_q: int,
    scale: float,
    num_splits: int = 1,
    split_tokens: tuple[int, int] = (0, 0),
    split_scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
    block_n: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Attends the query tiles (request `tile_req[i]`'s tokens from its `tile_q[i]`-th new
    one, `block_q` of them) to their paged context; writes those tokens' rows of `out`
    ([T, heads, d]) and no others.

    num_splits > 1 cuts each request's context into that many parts (flash-decoding); the
    tiles' tokens must then be the rows `split_tokens = (first, count)` of the batch (the
    decodes); `split_scratch` = (partial outputs [count, heads, num_splits, d], their
    log-sum-exp [count, heads, num_splits]), fp32, may be given to be reused across layers.
    `block_n`: keys per iteration (default: 64; 32 for fp32 on a GPU, see FP32_DOT).
    `window`: sliding-window attention (a query at p sees keys p - window < k <= p; blocks of
    keys wholly before a tile's window are not read). `softcap`: scores become
    softcap * tanh(scores / softcap) (Gemma 2's attention logit soft-capping)."""
    num_tiles = tile_req.shape[0]
    if num_tiles == 0:
        return
    num_heads, head_size = query.shape[1], query.shape[2]
    kv_heads = kv_cache.shape[3]
    group = num_heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    assert query.stride(2) == 1 and out.stride(2) == 1 and kv_cache.is_contiguous()
    fp32_dot = (
        kv_cache.dtype == torch.float32
        or query.dtype == torch.float32
        or query.device.type == "cpu"
    )
    if block_n is None:
        block_n = 32 if fp32_dot and query.device.type == "cuda" else 64
    split = num_splits > 1
    first, count = split_tokens
    if split:
        assert count > 0, "a split launch names the rows it covers (split_tokens)"
        if split_scratch is None:
            split_scratch = split_scratch_for(count, num_heads, num_splits, head_size, out.device)
        target, lse = split_scratch
        assert target.shape == (count, num_heads, num_splits, head_size), target.shape
    else:
        lse = target = out
    count_launch("paged_attention")
    _paged_attention_kernel[(num_tiles, kv_heads, num_splits)](
        target,
        lse,
        query,
        kv_cache,
        block_table,
        seq_lens,
        query_start,
        tile_req,
        tile_q,
        scale,
        window or 0,
        softcap or 0.0,
        first,
        query.stride(0),
        query.stride(1),
        target.stride(0),
        target.stride(1),
        lse.stride(0),
        lse.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_table.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_M=max(16, block_q * group_pad),
        BLOCK_N=block_n,
        HEAD_D=head_size,
        BLOCK_D=max(16, triton.next_power_of_2(head_size)),
        BLOCK_SIZE=kv_cache.shape[2],
        SPLIT=split,
        FP32_DOT=fp32_dot,
        HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None,
    )
    if split:
        rows = count * num_heads
        block_r = 16
        count_launch("combine_splits")
        _combine_splits_kernel[(triton.cdiv(rows, block_r),)](
            out[first : first + count],
            target,
            lse,
            rows,
            num_heads,
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_D=head_size,
            BLOCK_D=max(16, triton.next_power_of_2(head_size)),
            BLOCK_R=block_r,
        )


def split_scratch_for(
    count: int, num_heads: int, num_splits: int, head_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Room for the partial outputs and log-sum-exps of `count` split tokens."""
    shape = (count, num_heads, num_splits)
    partial = torch.empty((*shape, head_size), dtype=torch.float32, device=device)
    return partial, torch.empty(shape, dtype=torch.float32, device=device)
