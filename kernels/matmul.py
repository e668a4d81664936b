"""The batch-invariant matmul: y = x @ W^T (+ bias) with tiles fixed by the weight alone.

worker/layers/linear.py's `matmul` calls `matmul` here in the batch-invariant mode
(kernels/batch_invariant.py) on the Triton path: on CUDA, and on the CPU where the model runs
Triton's layers (the interpreter; the platform then leaves the weights plain [N, K]).

cuBLAS, MKL and oneDNN pick their kernel, tiles and split-K from the row count, so a row's
sums run in another order as the batch grows. Here a program computes one BLOCK_M x BLOCK_N
tile of y, walking K upwards BLOCK_K at a time into an fp32 accumulator, with no split-K; the
tiles depend on N, K, the dtype and the device, never on M. Every row of y is then the same
sequence of operations whatever rows sit beside it: a partial tile's missing rows are zeros,
and a dot's output row reads only its own input row. Data-parallel tiles, as in Thinking
Machines' batch_invariant_ops, without their persistent schedule (which changes speed, not
the order of a row's sums).

`FP32_DOT` (fp32 operands, and the interpreter, whose 16-bit dots are not exact) upcasts the
tiles after loading and multiplies in IEEE fp32 (bf16 x bf16 products are exact in fp32, so
this is still a bf16 GEMM with fp32 accumulation); otherwise the dots run on the tensor cores
in the operands' 16-bit type, accumulating in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.kernels.launches import count_launch


@dataclass(frozen=True)
class MatmulTiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2


def matmul_tiles(n: int, k: int, dtype: torch.dtype, device: torch.device) -> MatmulTiles:
    """The tiles for a weight [n, k] (M is deliberately not an argument: see above). tl.dot
    needs every side >= 16; a small layer gets a tile no wider than itself."""
    n_pad = max(16, triton.next_power_of_2(n))
    k_pad = max(16, triton.next_power_of_2(k))
    if device.type != "cuda":
        # The interpreter pays per program and per op, not per element: few, large tiles.
        return MatmulTiles(64, min(256, n_pad), min(128, k_pad))
    if dtype == torch.float32:
        # IEEE fp32 dots have no tensor cores; small tiles keep their operands in shared
        # memory without spilling (as the attention kernel's FP32_DOT tiles).
        return MatmulTiles(32, min(64, n_pad), min(32, k_pad), num_warps=4, num_stages=2)
    return MatmulTiles(64, min(128, n_pad), min(64, k_pad), num_warps=4, num_stages=3)


# M is not specialized on (Triton would compile M == 1 apart): one kernel for every row count.
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    bias_ptr,  # [N], HAS_BIAS only
    y_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None]  # W^T's tile [K, N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + ks < K
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if FP32_DOT:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight.T (+ bias) -> [..., N] in x's dtype; weight a plain [N, K] tensor of
    x's dtype. Each row of the result has the same bits whatever the number of rows."""
    n, k = weight.shape
    if weight.dtype != x.dtype or x.shape[-1] != k:
        raise ValueError(
            f"matmul of x {tuple(x.shape)} {x.dtype} with weight {tuple(weight.shape)} "
            f"{weight.dtype}: the weight must be [N, K] with x's last dimension K and dtype"
        )
    shape = x.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*shape[:-1], n)
    tiles = matmul_tiles(n, k, weight.dtype, weight.device)
    fp32_dot = x.dtype == torch.float32 or x.device.type != "cuda"
    count_launch("matmul")
    _matmul_kernel[(triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n))](
        x2, weight, bias if bias is not None else y, y, m, n, k, x2.stride(0), weight.stride(0),
        y.stride(0), HAS_BIAS=bias is not None, FP32_DOT=fp32_dot, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )  # fmt: skip
    return y.view(*shape[:-1], n)


def matmul_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """What `matmul` computes, in torch: the product and bias in fp32, rounded to x's dtype."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
