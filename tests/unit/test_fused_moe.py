"""The CPU mixture-of-experts path (batched over experts' padded token groups where that
pays) against the per-expert reference, at every step size it switches between, and the
routing against HF's definition."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.reference import fused_moe_reference
from tokenmill.worker.layers.fused_moe import (
    BATCHED_MAX_ASSIGNMENTS,
    WEIGHTS_FIRST_MAX_ROWS,
    FusedMoE,
    gemm_rows,
    moe_on_cpu,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 40, 300, 1100, BATCHED_MAX_ASSIGNMENTS // 2 + 7])
def test_cpu_moe_matches_the_per_expert_reference(tokens: int, dtype: torch.dtype) -> None:
    """Every path, each expert's rows padded: per expert, weights first (1 and 3 tokens:
    fewer assignments than experts); batched, weights first (40, 300); batched, weights
    second (1100: blocks past WEIGHTS_FIRST_MAX_ROWS); per expert, weights second (more than
    BATCHED_MAX_ASSIGNMENTS)."""
    g = torch.Generator().manual_seed(tokens)
    experts, hidden, inter, top_k = 8, 32, 24, 2
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g).to(dtype)
    w2 = torch.randn(experts, hidden, inter, generator=g).to(dtype)
    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    weights = weights.to(dtype)
    expected = fused_moe_reference(x, w13, w2, weights, ids)
    per_expert = torch.bincount(ids.reshape(-1), minlength=experts)
    assert (gemm_rows(int(per_expert.max())) <= WEIGHTS_FIRST_MAX_ROWS) == (tokens <= 300)
    got = moe_on_cpu(x, w13, w2, weights, ids)
    assert got.shape == expected.shape and got.dtype == dtype
    # bf16: the same products, rounded to 8 bits where the two paths round differently.
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=0.25)
    torch.testing.assert_close(got, expected, **tol)


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
