"""Every Triton kernel against its pure-torch reference: on CUDA when there is a GPU, else in
Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set in conftest). Outputs are
poisoned with NaN before each run, so an element a kernel fails to write fails the test.

Error measure: max|out - ref| / max|ref|; fp32 dots run in IEEE precision."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import require_triton

from tokenmill.kernels.reference import paged_attention as reference_attention
from tokenmill.kernels.reference import to_cache, write_kv_cache
from tokenmill.protocol.utils import cdiv
from tokenmill.worker.layers.activation import SiluAndMul
from tokenmill.worker.layers.layernorm import RMSNorm
from tokenmill.worker.layers.rotary import RotaryEmbedding, apply_rotary

require_triton()
from tokenmill.kernels import attention as triton_attention  # noqa: E402
from tokenmill.kernels import layers as triton_layers  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# The interpreter computes 16-bit types wrongly; there the kernels run in fp32 and fp16.
DTYPES = (
    [torch.float32, torch.bfloat16] if DEVICE.type == "cuda" else [torch.float32, torch.float16]
)
TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float().cpu(), ref.float().cpu()
    assert not out.isnan().any(), "the kernel left elements unwritten (NaN)"
    return ((out - ref).abs().max() / ref.abs().max()).item()


def poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float("nan"), device=DEVICE)


def paged_batch(query_lens, seq_lens, block_size, kv_heads, head_size, dtype, seed=0,
                cache_dtype=None):  # fmt: skip
    """Requests with disjoint random blocks (never block 0), their earlier context already in
    the cache, this step's K/V not yet written; the table rows padded with block 0."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(cdiv(s, block_size) for s in seq_lens) + 3
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = [[perm.pop() for _ in range(cdiv(s, block_size))] for s in seq_lens]
    cache = torch.randn(num_blocks, 2, block_size, kv_heads, head_size, generator=g)
    cache = to_cache(cache, cache_dtype or dtype)
    slots = torch.tensor(
        [
            t[p // block_size] * block_size + p % block_size
            for t, s, q in zip(tables, seq_lens, query_lens)
            for p in range(s - q, s)
        ]
    )
    max_blocks = max(len(t) for t in tables)
    block_table = torch.zeros(len(tables), max_blocks + 1, dtype=torch.int32)
    for r, t in enumerate(tables):
        block_table[r, : len(t)] = torch.tensor(t)
    return tables, cache, slots, block_table, g


def tiles(query_lens, block_q, first_req=0):
    req, q = [], []
    for r, n in enumerate(query_lens[first_req:], start=first_req):
        for start in range(0, n, block_q):
            req.append(r)
            q.append(start)
    return torch.tensor(req, dtype=torch.int32), torch.tensor(q, dtype=torch.int32)


@pytest.mark.parametrize("fp8", [False, True], ids=["cache-same", "cache-fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads, kv_heads, head_size, block_size",
    [(4, 2, 32, 16), (6, 1, 16, 16), (4, 4, 24, 32)],  # GQA 2, GQA 6 (padded), MHA, d=24
)
def test_cache_write_and_attention_match_reference(
    heads, kv_heads, head_size, block_size, dtype, fp8
):
    # Two decodes (ragged, the first with a partly filled last block), then a chunked prefill
    # continuing 20 tokens of context, then a fresh prompt. fp8: the cache in e4m3
    # (kv_cache_dtype="fp8"), written bit for bit as torch rounds.
    query_lens = [1, 1, 13, 21]
    seq_lens = [37, 9, 33, 21]
    tables, cache, slots, block_table, g = paged_batch(
        query_lens, seq_lens, block_size, kv_heads, head_size, dtype,
        cache_dtype=torch.float8_e4m3fn if fp8 else None,
    )  # fmt: skip
    total = sum(query_lens)
    query = torch.randn(total, heads, head_size, generator=g).to(dtype)
    # Keys/values as strided views of a fused qkv tensor, as the model passes them.
    qkv = torch.randn(total, heads + 2 * kv_heads, head_size, generator=g).to(dtype)
    key, value = qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    expected_cache = cache.clone()
    write_kv_cache(expected_cache, key, value, slots)
    expected = reference_attention(
        query, expected_cache, tables, seq_lens, query_lens, head_size**-0.5
    )

    cache = cache.to(DEVICE)
    slot_mapping = torch.cat((slots, torch.tensor([-1]))).to(DEVICE)  # plus a padded token
    pad = torch.zeros(1, kv_heads, head_size, dtype=dtype)
    triton_attention.reshape_and_cache(
        torch.cat((key, pad)).to(DEVICE), torch.cat((value, pad)).to(DEVICE), cache, slot_mapping
    )
    assert torch.equal(cache.cpu().view(torch.uint8), expected_cache.view(torch.uint8)), (
        "cache write differs (or wrote slot -1)"
    )

    query_start = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    args = [x.to(DEVICE) for x in (block_table, seq, query_start)]
    for num_splits in (1, 3):  # decodes whole, then cut into 3 parts of their context
        out = poisoned(query)
        dec_req, dec_q = tiles(query_lens[:2], 1)
        triton_attention.paged_attention(
            out, query.to(DEVICE), cache, *args, dec_req.to(DEVICE), dec_q.to(DEVICE),
            block_q=1, scale=head_size**-0.5, num_splits=num_splits, split_tokens=(0, 2),
            block_n=16,
        )  # fmt: skip
        pre_req, pre_q = tiles(query_lens, 8, first_req=2)
        triton_attention.paged_attention(
            out, query.to(DEVICE), cache, *args, pre_req.to(DEVICE), pre_q.to(DEVICE),
            block_q=8, scale=head_size**-0.5, block_n=16,
        )  # fmt: skip
        assert rel_error(out, expected) < TOLERANCE[dtype], num_splits


@pytest.mark.parametrize(
    "window, softcap, block_size",
    [(5, None, 16), (16, None, 16), (40, None, 8), (None, 3.0, 16), (24, 2.0, 16)],
)
def test_sliding_window_and_softcap_match_reference(window, softcap, block_size) -> None:
    """Decodes (whole and split), a chunked prefill and a fresh prompt, with windows shorter
    than, equal to and longer than one block of keys, and Gemma 2's logit soft-capping; the
    kernel skips blocks before a tile's window."""
    heads, kv_heads, head_size = 4, 2, 32
    query_lens, seq_lens = [1, 1, 13, 29], [150, 9, 90, 29]
    tables, cache, slots, block_table, g = paged_batch(
        query_lens, seq_lens, block_size, kv_heads, head_size, torch.float32, seed=3
    )
    total = sum(query_lens)
    query = torch.randn(total, heads, head_size, generator=g) * 2
    key = torch.randn(total, kv_heads, head_size, generator=g)
    value = torch.randn(total, kv_heads, head_size, generator=g)
    write_kv_cache(cache, key, value, slots)
    expected = reference_attention(query, cache, tables, seq_lens, query_lens, 0.25,
                                   window=window, softcap=softcap)  # fmt: skip
    query_start = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    args = [x.to(DEVICE) for x in (cache, block_table, torch.tensor(seq_lens, dtype=torch.int32),
                                   query_start)]  # fmt: skip
    for num_splits in (1, 3):
        out = poisoned(query)
        dec_req, dec_q = tiles(query_lens[:2], 1)
        triton_attention.paged_attention(
            out, query.to(DEVICE), *args, dec_req.to(DEVICE), dec_q.to(DEVICE), block_q=1,
            scale=0.25, num_splits=num_splits, split_tokens=(0, 2), block_n=16,
            window=window, softcap=softcap,
        )  # fmt: skip
        pre_req, pre_q = tiles(query_lens, 8, first_req=2)
        triton_attention.paged_attention(
            out, query.to(DEVICE), *args, pre_req.to(DEVICE), pre_q.to(DEVICE), block_q=8,
            scale=0.25, block_n=16, window=window, softcap=softcap,
        )  # fmt: skip
        assert rel_error(out, expected) < TOLERANCE[torch.float32], num_splits
    if window is not None:  # the window changes the result (it was applied)
        full = reference_attention(query, cache, tables, seq_lens, query_lens, 0.25,
                                   softcap=softcap)  # fmt: skip
        assert rel_error(full, expected) > 0.01


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_decodes_split_across_programs(dtype) -> None:
    # Contexts of 100-300 tokens cut into 2..8 parts; a padded row (seq_len 0) stays finite.
    heads, kv_heads, head_size, block_size = 8, 2, 32, 16
    query_lens, seq_lens = [1, 1, 1], [300, 100, 177]
    tables, cache, slots, block_table, g = paged_batch(
        query_lens, seq_lens, block_size, kv_heads, head_size, dtype, seed=1
    )
    query = torch.randn(3, heads, head_size, generator=g).to(dtype)
    expected = reference_attention(query, cache, tables, seq_lens, query_lens, 0.125)
    q_start = torch.arange(5, dtype=torch.int32)
    seq = torch.tensor([*seq_lens, 0], dtype=torch.int32)
    table = torch.cat((block_table, torch.zeros_like(block_table[:1])))
    padded_query = torch.cat((query, torch.zeros_like(query[:1])))
    for num_splits in (2, 5, 8):
        out = poisoned(padded_query)
        req = torch.arange(4, dtype=torch.int32, device=DEVICE)
        triton_attention.paged_attention(
            out, padded_query.to(DEVICE), cache.to(DEVICE), table.to(DEVICE), seq.to(DEVICE),
            q_start.to(DEVICE), req, torch.zeros_like(req), block_q=1, scale=0.125,
            num_splits=num_splits, split_tokens=(0, 4), block_n=16,
        )  # fmt: skip
        assert rel_error(out[:3], expected) < TOLERANCE[dtype], num_splits
        assert torch.isfinite(out[3].float()).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_torch(dtype, with_residual) -> None:
    g = torch.Generator().manual_seed(0)
    hidden = 96  # not a power of two: the tile's tail is masked
    norm = RMSNorm(hidden, eps=1e-5)
    norm.weight.data = torch.randn(hidden, generator=g)
    norm = norm.to(dtype)
    x = torch.randn(19, hidden, generator=g).to(dtype)
    residual = torch.randn(19, hidden, generator=g).to(dtype)
    if with_residual:
        expected, expected_residual = norm(x.clone(), residual.clone())
        r = residual.to(DEVICE)
        out = triton_layers.rms_norm(x.to(DEVICE), norm.weight.to(DEVICE), 1e-5, r, poisoned(x))
        assert rel_error(r, expected_residual) < TOLERANCE[dtype]
    else:
        expected = norm(x)
        out = triton_layers.rms_norm(x.to(DEVICE), norm.weight.to(DEVICE), 1e-5, out=poisoned(x))
    assert rel_error(out, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemma_rms_norm_matches_torch(dtype, with_residual) -> None:
    """plus_one: Gemma's x / rms(x) * (1 + w) in fp32, rounded once (GemmaRMSNorm), as
    [T, hidden] rows and as per-head [T, heads, d] rows; each row's bits are its own."""
    from tokenmill.worker.models.gemma import GemmaRMSNorm

    g = torch.Generator().manual_seed(1)
    for shape in [(19, 96), (7, 3, 40)]:
        norm = GemmaRMSNorm(shape[-1], eps=1e-6)
        norm.weight.data = torch.randn(shape[-1], generator=g) * 0.5
        norm = norm.to(dtype)
        x = torch.randn(*shape, generator=g).to(dtype)
        residual = torch.randn(*shape, generator=g).to(dtype)
        rows = x.reshape(-1, shape[-1])
        weight = norm.weight.to(DEVICE)
        if with_residual:
            expected, expected_residual = norm.forward_native(x.clone(), residual.clone())
            r = residual.reshape(-1, shape[-1]).to(DEVICE)
            out = triton_layers.rms_norm(rows.to(DEVICE), weight, 1e-6, r, poisoned(rows),
                                         plus_one=True)  # fmt: skip
            assert rel_error(r, expected_residual.reshape(r.shape)) < TOLERANCE[dtype]
        else:
            expected = norm.forward_native(x)
            out = triton_layers.rms_norm(rows.to(DEVICE), weight, 1e-6, out=poisoned(rows),
                                         plus_one=True)  # fmt: skip
        assert rel_error(out, expected.reshape(out.shape)) < TOLERANCE[dtype], shape
        if not with_residual:  # one row alone: the same bits as within the batch
            alone = triton_layers.rms_norm(rows[2:3].to(DEVICE), weight, 1e-6, plus_one=True)
            assert torch.equal(alone.cpu(), out[2:3].cpu())


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_matches_torch(dtype) -> None:
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, head_size = 6, 2, 32
    rope = RotaryEmbedding(head_size, 256, {"rope_theta": 10000.0})
    positions = torch.randint(0, 256, (21,), generator=g)
    qkv = torch.randn(21, heads + 2 * kv_heads, head_size, generator=g).to(dtype)
    qk = qkv[:, : heads + kv_heads]  # a strided view, rotated in place
    expected = apply_rotary(qk, rope.cos_sin(positions, dtype))
    untouched = qkv[:, heads + kv_heads :].clone()
    qkv = qkv.to(DEVICE)
    view = qkv[:, : heads + kv_heads]
    triton_layers.rotary_embedding_(
        view, positions.to(DEVICE), rope.cos.to(DEVICE), rope.sin.to(DEVICE)
    )
    assert rel_error(view, expected) < TOLERANCE[dtype]
    assert torch.equal(qkv[:, heads + kv_heads :].cpu(), untouched), "v was written"


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(13, 2 * 80, generator=g).to(dtype)
    expected = SiluAndMul()(x.clone())
    out = triton_layers.silu_and_mul(x.to(DEVICE), out=poisoned(expected))
    assert rel_error(out, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul_matches_torch(dtype) -> None:
    from tokenmill.worker.models.gemma import GeluTanhAndMul

    g = torch.Generator().manual_seed(2)
    x = (torch.randn(13, 2 * 80, generator=g) * 3).to(dtype)  # tanh's tails too
    expected = GeluTanhAndMul().forward_native(x.clone())
    out = triton_layers.gelu_tanh_and_mul(x.to(DEVICE), out=poisoned(expected))
    assert rel_error(out, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("with_q", [False, True], ids=["one-hot-q", "draft-q"])
def test_rejection_accept_and_recover_matches_torch(with_q) -> None:
    """Requests with 0 to 4 proposals, greedy and sampled, vocabularies with zeros (top-k),
    proposals drawn near the target (many accepted) and from the draft: the kernel's accepted
    counts and tokens equal the torch path's on the same draws."""
    import numpy as np

    from tokenmill.kernels import rejection
    from tokenmill.worker.spec_decode import accept_and_recover_reference

    g = torch.Generator().manual_seed(0)
    vocab, counts = 300, np.array([0, 1, 3, 4, 2, 4, 1, 0, 3])
    rows = int((counts + 1).sum())
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[:, 250:] = float("-inf")  # a top-k cut: zeros in p
    probs = logits.softmax(-1)
    greedy_tokens = probs.argmax(-1)
    greedy = torch.tensor([i % 3 == 0 for i in range(len(counts))])
    starts = np.concatenate(([0], np.cumsum(counts + 1)[:-1]))
    draft_rows = np.concatenate([np.arange(s, s + c) for s, c in zip(starts, counts)])
    q = None
    if with_q:
        noise = torch.randn(len(draft_rows), vocab, generator=g)
        q = (logits[draft_rows] + noise).softmax(-1)  # a draft near the target
        draft = torch.multinomial(q, 1, generator=g)[:, 0]
    else:  # half the proposals the target's argmax, half its samples
        draft = torch.multinomial(probs[draft_rows], 1, generator=g)[:, 0]
        draft[::2] = greedy_tokens[draft_rows][::2]
    u = torch.rand(len(draft_rows), generator=g)
    log_u = torch.rand(rows, vocab, generator=g).clamp_(min=1e-30).log_()
    cu = torch.from_numpy(np.concatenate(([0], np.cumsum(counts))))
    args = (probs, log_u, greedy_tokens, greedy, draft, cu, q, u)
    expected = accept_and_recover_reference(*args)
    on = [a.to(DEVICE) if a is not None else None for a in args]
    accepted, tokens = rejection.accept_and_recover(*on)
    assert accepted.cpu().tolist() == expected[0].tolist()
    assert tokens.cpu().tolist() == expected[1].tolist()
    # Both outcomes occur: the comparison covers acceptance, rejection and the bonus.
    assert 0 < expected[0].sum() < counts.sum() and (expected[0] == torch.from_numpy(counts)).any()


@pytest.mark.parametrize("num_experts, top_k, block_m", [(4, 2, 16), (8, 1, 16), (6, 3, 32)])
def test_fused_moe_matches_reference(num_experts, top_k, block_m) -> None:
    """Tokens sorted by expert and padded per expert to the block size; the grouped GEMMs
    (gate/up, then down with the routing weights) against the per-expert torch path, with
    an expert that gets no token and sizes that are no powers of two."""
    from tokenmill.kernels.fused_moe import align_by_expert, fused_moe
    from tokenmill.kernels.reference import fused_moe_reference

    g = torch.Generator().manual_seed(num_experts)
    tokens, hidden, inter = 13, 48, 40
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    logits = torch.randn(tokens, num_experts, generator=g)
    logits[:, num_experts - 1] = -100.0  # the last expert is never chosen
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    sorted_ids, block_experts = align_by_expert(ids, num_experts, block_m)
    assert sorted_ids.numel() == block_m * block_experts.numel()
    blocks = sorted_ids.view(-1, block_m)
    flat = ids.reshape(-1)
    for block, expert in zip(blocks.tolist(), block_experts.tolist()):
        real = [a for a in block if a < flat.numel()]
        if expert == num_experts:  # past the last expert's blocks: padding only
            assert not real
        else:  # one expert's assignments, padding last
            assert real and all(flat[a] == expert for a in real)
    assert sorted(a for a in sorted_ids.tolist() if a < flat.numel()) == list(range(flat.numel()))
    expected = fused_moe_reference(x, w13, w2, weights, ids)
    # The reference against the definition, token by token.
    for t in range(tokens):
        dense = sum(
            weights[t, j] * (w2[e] @ (F.silu(w13[e, :inter] @ x[t]) * (w13[e, inter:] @ x[t])))
            for j, e in enumerate(ids[t].tolist())
        )
        torch.testing.assert_close(expected[t], dense, rtol=1e-4, atol=1e-5)
    out = fused_moe(x.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), weights.to(DEVICE),
                    ids.to(DEVICE), block_m=block_m)  # fmt: skip
    assert rel_error(out.cpu(), expected) < TOLERANCE[torch.float32]
