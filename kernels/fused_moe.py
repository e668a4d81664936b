"""Mixture-of-experts MLPs as grouped GEMMs (as vLLM's `fused_moe_kernel` with
`moe_align_block_size`), and their torch reference.

Routing gives every token `top_k` (expert, weight) pairs, flattened to T x top_k
"assignments" (row a = token a // top_k). `align_by_expert` sorts the assignments by expert
and pads each expert's run to a multiple of BLOCK_M with an out-of-range index, so that every
block of BLOCK_M sorted assignments belongs to one expert. One Triton launch then multiplies
each block's rows by that expert's weight matrix (`_grouped_gemm_kernel`: rows gathered from
the input, written to their assignment row, optionally times the assignment's routing
weight): first the fused gate/up projection of the tokens, then, after SiLU-and-mul, the
down projection with the routing weights applied; the top_k rows of a token are summed.
Weights are stacked per expert: w13 [E, 2 * I, H] (gate rows, then up rows), w2 [E, H, I].

`fused_moe_reference` (kernels/reference.py) computes the same with one torch matmul per
expert that has tokens (grouped by expert, never a loop over tokens): the CPU path and this
kernel's reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tokenmill.kernels.launches import count_launch


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted assignment indices, each expert's run padded to a multiple of block_m with
    T * top_k; the expert of each block of block_m). topk_ids: [T, top_k]. The sizes are
    the most the padding can take (every expert one block short of full), whatever the
    routing, and nothing waits for the device, so a CUDA graph can capture it: blocks past
    the last expert's get expert `num_experts`, which the kernel skips."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    num, device = flat.numel(), flat.device
    num_blocks = (num + num_experts * (block_m - 1) + block_m - 1) // block_m
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    # Each sorted assignment's slot: its expert's padded start plus its rank in the expert.
    experts = flat[order]
    ranks = torch.arange(num, device=device) - (torch.cumsum(counts, 0) - counts)[experts]
    sorted_ids = torch.full((num_blocks * block_m,), num, dtype=torch.int64, device=device)
    sorted_ids[(ends - padded)[experts] + ranks] = order
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_experts = torch.searchsorted(ends, block_starts, right=True)
    return sorted_ids, block_experts


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [rows of A, K]
    b_ptr,  # [E, N, K]
    c_ptr,  # [num_assignments, N]
    weights_ptr,  # [num_assignments] routing weights (MUL_WEIGHT)
    sorted_ids_ptr,
    block_experts_ptr,
    num_assignments,
    num_experts,
    N,
    K,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    A_ROWS_PER_TOKEN: tl.constexpr,  # top_k: A's row of assignment a is a // top_k; 1: a
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    if expert >= num_experts:  # a block past the last expert's: padding only
        return
    rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < num_assignments
    a_rows = (rows // A_ROWS_PER_TOKEN).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + expert * stride_be + cols[None, :].to(tl.int64) * stride_bn + ks[:, None],
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )  # [K, N]
        if FP32_DOT:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    tl.store(
        c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def _grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    sorted_ids: torch.Tensor,
    block_experts: torch.Tensor,
    rows_per_token: int,
    weights: torch.Tensor | None,
    block_m: int,
) -> None:
    num_assignments, n = out.shape
    k = a.shape[1]
    assert a.stride(1) == 1 and b.is_contiguous() and out.is_contiguous()
    fp32_dot = a.dtype == torch.float32 or a.device.type == "cpu"
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64 if not fp32_dot else 32, max(16, triton.next_power_of_2(k)))
    count_launch("fused_moe")
    grid = (block_experts.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, b, out, weights if weights is not None else out, sorted_ids, block_experts,
        num_assignments, b.shape[0], n, k, a.stride(0), b.stride(0), b.stride(1), out.stride(0),
        A_ROWS_PER_TOKEN=rows_per_token, MUL_WEIGHT=weights is not None, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, FP32_DOT=fp32_dot,
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    block_m: int = 16,
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_* [T, top_k] -> [T, H] (this rank's
    partial sum when the experts' intermediate dimension is split across ranks)."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i = w13.shape[0], w13.shape[1]
    sorted_ids, block_experts = align_by_expert(topk_ids, num_experts, block_m)
    gate_up = torch.empty(num_tokens * top_k, two_i, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, sorted_ids, block_experts, top_k, None, block_m)
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = (F.silu(gate) * up).contiguous()
    down = torch.empty(num_tokens * top_k, w2.shape[1], dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _grouped_gemm(hidden, w2, down, sorted_ids, block_experts, 1, weights, block_m)
    return down.view(num_tokens, top_k, -1).sum(dim=1)
