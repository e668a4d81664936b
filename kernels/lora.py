"""The batched LoRA matmuls as Triton kernels (as vLLM's punica `lora_shrink` /
`lora_expand`; S-LoRA's SGMV): each row of a batch by its own adapter, on the rows grouped by
slot (kernels/punica.py's `LoRAMapping`: slot s's rows are sorted_rows[starts[s] :
starts[s + 1]]). The arguments and results are punica.py's, which is their reference.

A program takes BLOCK_M rows of one slot (grid: row blocks x slots, and output column blocks
in the expand): the rows of a prefill chunk with one adapter run as one tiled matmul. The grid
is sized by T and S alone and programs past their slot's rows return at once, so nothing waits
for the device and a CUDA graph can capture a launch. The rank (R: a packed layer's slices
stacked, up to 3 x max_lora_rank) is cut into tiles of up to 64: a grid axis of the shrink, a
loop of the expand (in the same order for every row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.launches import count_launch
from tokenmill.kernels.punica import LoRAMapping, slot_scales

BLOCK_M = 16
MAX_BLOCK_R = 64


@triton.jit
def _shrink_kernel(
    x_ptr,  # [T, K]
    a_ptr,  # [S, R, K]
    y_ptr,  # [T, R] fp32
    scale_ptr,  # [S] fp32
    sorted_rows_ptr,
    starts_ptr,
    K,
    R,
    stride_xm,
    stride_as,
    stride_ar,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    slot = tl.program_id(1).to(tl.int64)
    pid_r = tl.program_id(2)
    first = tl.load(starts_ptr + slot) + pid_m * BLOCK_M
    end = tl.load(starts_ptr + slot + 1)
    if first >= end:  # past this slot's rows
        return
    positions = first + tl.arange(0, BLOCK_M)
    row_ok = positions < end
    rows = tl.load(sorted_rows_ptr + positions, mask=row_ok, other=0)
    ranks = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rank_ok = ranks < R
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        a = tl.load(
            a_ptr + slot * stride_as + ranks[None, :] * stride_ar + ks[:, None],
            mask=k_ok[:, None] & rank_ok[None, :],
            other=0.0,
        )  # [K, R]
        if FP32_DOT:
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, a)
    scale = tl.load(scale_ptr + slot)
    tl.store(
        y_ptr + rows[:, None] * stride_ym + ranks[None, :],
        acc * scale,
        mask=row_ok[:, None] & rank_ok[None, :],
    )


@triton.jit
def _expand_kernel(
    y_ptr,  # [T, R] fp32
    b_ptr,  # [S, N, R]
    out_ptr,  # [T, N_total]
    sorted_rows_ptr,
    starts_ptr,
    N,
    R,
    offset,
    stride_ym,
    stride_bs,
    stride_bn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.program_id(2).to(tl.int64)
    first = tl.load(starts_ptr + slot) + pid_m * BLOCK_M
    end = tl.load(starts_ptr + slot + 1)
    if first >= end:
        return
    positions = first + tl.arange(0, BLOCK_M)
    row_ok = positions < end
    rows = tl.load(sorted_rows_ptr + positions, mask=row_ok, other=0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        ranks = r0 + tl.arange(0, BLOCK_R)
        rank_ok = ranks < R
        y = tl.load(
            y_ptr + rows[:, None] * stride_ym + ranks[None, :],
            mask=row_ok[:, None] & rank_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + slot * stride_bs + cols[None, :] * stride_bn + ranks[:, None],
            mask=rank_ok[:, None] & col_ok[None, :],
            other=0.0,
        )  # [R, N]
        acc += tl.dot(y, b.to(tl.float32), input_precision="ieee")
    out_ptrs = out_ptr + rows[:, None] * stride_om + offset + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    old = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (old + acc).to(out_ptr.dtype.element_ty), mask=mask)


def _block_r(rank: int) -> int:
    return min(MAX_BLOCK_R, max(16, triton.next_power_of_2(rank)))


def lora_shrink(
    x: torch.Tensor, a_stacked: torch.Tensor, mapping: LoRAMapping, scale: float | torch.Tensor
) -> torch.Tensor:
    """y [T, R] fp32: scale[s] * x[t] @ a_stacked[s]^T for row t's slot s, zeros for rows of no
    adapter (`punica.lora_shrink`)."""
    slots, rank, k = a_stacked.shape
    assert x.stride(1) == 1 and a_stacked.is_contiguous()
    y = torch.zeros(x.shape[0], rank, dtype=torch.float32, device=x.device)
    fp32_dot = x.dtype == torch.float32 or x.device.type == "cpu"
    count_launch("lora_shrink")
    block_r = _block_r(rank)
    grid = (triton.cdiv(x.shape[0], BLOCK_M), slots, triton.cdiv(rank, block_r))
    _shrink_kernel[grid](
        x, a_stacked, y, slot_scales(scale, slots, x.device), mapping.sorted_rows,
        mapping.starts, k, rank, x.stride(0), a_stacked.stride(0), a_stacked.stride(1),
        y.stride(0), BLOCK_M=BLOCK_M, BLOCK_R=block_r,
        BLOCK_K=min(64, max(16, triton.next_power_of_2(k))), FP32_DOT=fp32_dot,
    )  # fmt: skip
    return y


def lora_expand(
    y: torch.Tensor,
    b_stacked: torch.Tensor,
    mapping: LoRAMapping,
    out: torch.Tensor,
    offset: int = 0,
) -> None:
    """out[t, offset:offset + N] += y[t] @ b_stacked[s]^T in place, rounded once; rows of no
    adapter untouched (`punica.lora_expand`)."""
    slots, n, rank = b_stacked.shape
    if offset < 0 or offset + n > out.shape[1]:
        raise ValueError(
            f"columns {offset}..{offset + n} do not fit in an output of {out.shape[1]} columns"
        )
    assert y.dtype == torch.float32 and y.stride(1) == 1 and out.stride(1) == 1
    assert b_stacked.is_contiguous()
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    count_launch("lora_expand")
    grid = (triton.cdiv(out.shape[0], BLOCK_M), triton.cdiv(n, block_n), slots)
    _expand_kernel[grid](
        y, b_stacked, out, mapping.sorted_rows, mapping.starts, n, rank, offset, y.stride(0),
        b_stacked.stride(0), b_stacked.stride(1), out.stride(0), BLOCK_M=BLOCK_M,
        BLOCK_N=block_n, BLOCK_R=_block_r(rank),
    )  # fmt: skip
