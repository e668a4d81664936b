"""The CPU mixture-of-experts path (batched over experts' padded token groups where that
pays) against the per-expert reference, at every step size it switches between, and the
routing against HF's definition."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.reference import fused_moe_reference
from tokenmill.worker.layers.fused_moe import (
    BATCHED_MAX_ASSIGNMENTS,
    DENSE_MAX_TOKENS,
    OWN_BLOCK_ROWS,
    WEIGHTS_FIRST_MAX_ROWS,
    FusedMoE,
    batched_capacity,
    gemm_rows,
    moe_on_cpu,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 12, 40, 300, 1100, BATCHED_MAX_ASSIGNMENTS // 2 + 7])
def test_cpu_moe_matches_the_per_expert_reference(tokens: int, dtype: torch.dtype) -> None:
    """Every path: per expert, weights first (1 token: 2 of 8 experts in use); every expert
    on every token (3 and 12 tokens); sorted into padded blocks, batched, weights first (40,
    300); batched, weights second (1100: blocks past WEIGHTS_FIRST_MAX_ROWS); per expert,
    weights second (more than BATCHED_MAX_ASSIGNMENTS)."""
    g = torch.Generator().manual_seed(tokens)
    experts, hidden, inter, top_k = 8, 32, 24, 2
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g).to(dtype)
    w2 = torch.randn(experts, hidden, inter, generator=g).to(dtype)
    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    weights = weights.to(dtype)
    per_expert = torch.bincount(ids.reshape(-1), minlength=experts)
    most_in_use = 3 * int(torch.count_nonzero(per_expert)) >= experts
    assert (most_in_use and tokens <= DENSE_MAX_TOKENS) == (tokens in (3, 12))
    assert (gemm_rows(int(per_expert.max())) <= WEIGHTS_FIRST_MAX_ROWS) == (tokens <= 300)
    got = moe_on_cpu(x, w13, w2, weights, ids)
    assert got.shape == (tokens, hidden) and got.dtype == dtype
    # Against the per-expert arithmetic in fp32, on the same (rounded) inputs.
    inputs = [t.float() if t.is_floating_point() else t for t in (x, w13, w2, weights, ids)]
    expected = fused_moe_reference(*inputs)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
        return
    # bf16 rounds each expert's weighted output (or its pieces) to 8 bits before the sum: an
    # error of a few units in the last place of the largest of them (2^-8 relative).
    largest = max(
        (fused_moe_reference(*inputs[:3], (ids == e).float() * inputs[3], ids).abs().max())
        for e in range(experts)
    )
    torch.testing.assert_close(got.float(), expected, rtol=0, atol=float(largest) * 2**-6)


def _assert_matches_reference(x, w13, w2, weights, ids) -> None:
    got = moe_on_cpu(x, w13, w2, weights, ids)
    inputs = [t.float() if t.is_floating_point() else t for t in (x, w13, w2, weights, ids)]
    expected = fused_moe_reference(*inputs)
    largest = max(
        (fused_moe_reference(*inputs[:3], (ids == e).float() * inputs[3], ids).abs().max())
        for e in range(w13.shape[0])
    )
    torch.testing.assert_close(got.float(), expected, rtol=0, atol=float(largest) * 2**-6)


@pytest.mark.parametrize("tokens, busy", [(1500, 1500), (1000, 450)])
def test_skewed_routing_splits_the_busiest_expert_off(tokens: int, busy: int) -> None:
    """One expert takes far more tokens than the rest: the batched blocks hold what the others
    need and the busy expert multiplies the rest in a block of its own (weights second for
    1276 rows, weights first for about 230)."""
    g = torch.Generator().manual_seed(busy)
    experts, hidden, inter = 8, 32, 24
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g).bfloat16()
    w2 = torch.randn(experts, hidden, inter, generator=g).bfloat16()
    # Expert 0 is the first pick of `busy` tokens; every other pick is among experts 1-7.
    first = torch.randint(1, experts, (tokens,), generator=g)
    first[:busy] = 0
    second = (first + torch.randint(1, experts - 1, (tokens,), generator=g)) % experts
    second = torch.where(second == 0, 1 + first % (experts - 1), second)
    ids = torch.stack((first, second), dim=1)
    assert bool((ids[:, 0] != ids[:, 1]).all())
    weights = torch.rand(tokens, 2, generator=g).softmax(-1).bfloat16()
    per_expert = torch.bincount(ids.reshape(-1), minlength=experts).numpy()
    capacity = batched_capacity(per_expert, ids.numel())
    assert 0 < capacity < per_expert[0] and gemm_rows(int(per_expert.max())) > capacity
    own = gemm_rows(int(per_expert[0]) - capacity)
    assert (own > WEIGHTS_FIRST_MAX_ROWS) == (busy == tokens)
    rows = experts * capacity + sum(
        gemm_rows(int(n) - capacity) + OWN_BLOCK_ROWS for n in per_expert if n > capacity
    )
    assert rows < experts * gemm_rows(int(per_expert.max()))
    _assert_matches_reference(x, w13, w2, weights, ids)


def test_routing_is_hf_s() -> None:
    """fp32 softmax, top-k, renormalized only where asked, cast to the activations' dtype."""
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]], dtype=torch.bfloat16)
    for renormalize in (True, False):
        moe = FusedMoE(4, 2, 8, 4, renormalize)
        weights, ids = moe.route(logits, torch.bfloat16)
        probs = logits.float().softmax(-1)
        want = probs[0, [1, 2]]
        if renormalize:
            want = want / want.sum()
        assert ids.tolist() == [[1, 2]] and weights.dtype == torch.bfloat16
        torch.testing.assert_close(weights[0].float(), want.to(torch.bfloat16).float())


def test_gemm_rows_rounds_up_to_a_few_shapes() -> None:
    """Every row count up to 8192 rounds up by at most 1/8 (16 at least) to one of 73
    shapes, and a rounded count stays as it is."""
    rounded = [gemm_rows(n) for n in range(1, 8193)]
    assert all(n <= r <= max(16, n + n // 8) for n, r in zip(range(1, 8193), rounded))
    assert all(gemm_rows(r) == r for r in rounded)
    assert len(set(rounded)) == 1 + 9 * 8  # 16, then 8 steps in each of [16, 32) ... [4096, 8192)
    assert [gemm_rows(n) for n in (1, 16, 17, 33, 100, 1500, 2048)] == [
        16,
        16,
        18,
        36,
        104,
        1536,
        2048,
    ]
