"""Triton matmuls on quantized weights (the CUDA counterparts of kernels/cpu/gguf.py and
kernels/cpu/int8.py): y = x @ W^T (+ bias).

`gguf_matmul`: W kept as the file's rows of blocks, [N, K / 32 * block bytes] uint8 (Q4_0, Q4_1,
Q8_0, the int4 checkpoints' Q4_Z, and Q4_F, Q8_F, Q8_S: Q4_K, Q5_K and Q6_K rewritten). A
program takes a tile of BLOCK_M rows x BLOCK_N output columns and walks K one block of 32 at
a time: the tile's blocks are read as bytes, their fp16 (or fp32) scales put together from
bytes, their 4- or 8-bit integers unpacked and
de-quantized in registers (GGUF's own arithmetic, in fp32), and multiplied there, in x's
16-bit type with fp32 sums (the de-quantized weights rounded to it, as a de-quantized
checkpoint would hold them) or, for fp32 x and in the interpreter, in IEEE fp32.

`int8_matmul`: W8A8 with the CPU kernel's arithmetic (int8.py): x quantized per row into
unsigned bytes with a zero point, here shifted by 128 into signed ones (tensor cores multiply
int8 by int8); int32 sums of the exact products; the zero point comes off through each
column's sum of q: y = s_x s_w (sum (xu - 128) q - (zp - 128) colsum). The weight is read in
the CPU layout ([N / 64, K / 4, 64, 4]), so one copy serves both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.cpu import gguf as G
from tokenmill.kernels.cpu import int8 as I
from tokenmill.kernels.launches import count_launch


class TritonGGUF:
    """A GGUF (or int4) weight kept on the device as the file's rows of blocks, for
    `gguf_matmul`."""

    def __init__(self, rows: torch.Tensor, qtype: int, perm: torch.Tensor | None = None) -> None:
        self.rows, self.qtype, self.perm = rows, qtype, perm
        self.shape = (rows.shape[0], rows.shape[1] // G.BLOCK_BYTES[qtype] * 32)

    @property
    def nbytes(self) -> int:
        return self.rows.numel()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return gguf_matmul(x, self.rows, self.qtype, bias, self.perm)


@triton.jit
def _fp16_at(ptr, mask):
    """The fp16 stored little-endian at byte pointers `ptr`, as fp32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _fp32_at(ptr, mask):
    """The fp32 stored little-endian at byte pointers `ptr`."""
    word = tl.load(ptr, mask=mask, other=0).to(tl.uint32)
    for i in tl.static_range(1, 4):
        word = word | (tl.load(ptr + i, mask=mask, other=0).to(tl.uint32) << (8 * i))
    return word.to(tl.float32, bitcast=True)


@triton.jit
def _gguf_matmul_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    QTYPE: tl.constexpr,  # GGML's id (2 Q4_0, 3 Q4_1, 8 Q8_0) or tokenmill's (kernels/cpu/gguf.py)
    BLOCK_BYTES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    j = tl.arange(0, 32)  # a weight's place in its block
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    for b in range(0, K // 32):
        x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + (b * 32 + j)[None, :],
                    mask=m_ok[:, None], other=0.0)  # fmt: skip
        block = rows + b * BLOCK_BYTES
        if QTYPE >= 1001:  # fp32 fields
            d = _fp32_at(block, n_ok[:, None])  # [BLOCK_N, 1]
        else:
            d = _fp16_at(block, n_ok[:, None])
        if QTYPE == 8:
            q = tl.load(block + 2 + j[None, :], mask=n_ok[:, None], other=0)
            w = d * q.to(tl.int8, bitcast=True).to(tl.float32)
        elif QTYPE == 1002 or QTYPE == 1003:  # Q8_F: d * q + m; Q8_S: d, then e, per 16
            q = tl.load(block + 8 + j[None, :], mask=n_ok[:, None], other=0)
            q = q.to(tl.int8, bitcast=True).to(tl.float32)
            second = _fp32_at(block + 4, n_ok[:, None])
            if QTYPE == 1002:
                w = d * q + second
            else:
                w = tl.where((j < 16)[None, :], d, second) * q
        else:
            first = 8 if QTYPE == 1001 else 4 if (QTYPE == 3 or QTYPE == 1000) else 2
            byte = tl.load(block + first + (j % 16)[None, :], mask=n_ok[:, None], other=0)
            q = ((byte >> ((j // 16) * 4)[None, :].to(tl.uint8)) & 0xF).to(tl.float32)
            if QTYPE == 2:
                w = d * (q - 8.0)
            elif QTYPE == 3:
                w = d * q + _fp16_at(block + 2, n_ok[:, None])
            elif QTYPE == 1001:
                w = d * q + _fp32_at(block + 4, n_ok[:, None])
            else:
                w = d * (q - _fp16_at(block + 2, n_ok[:, None]))
        w = tl.where(n_ok[:, None], w, 0.0)
        if FP32_DOT:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])  # fmt: skip


def _block_m(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


def gguf_matmul(
    x: torch.Tensor,
    rows: torch.Tensor,
    qtype: int,
    bias: torch.Tensor | None = None,
    perm: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype; W as rows of blocks [N, K / 32 *
    block bytes] of a type of kernels/cpu/gguf.py; `perm`: the input features in the weight's
    column order (act-order int4)."""
    if perm is not None:
        x = x.index_select(-1, perm)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n = rows.shape[0]
    assert k % 32 == 0 and rows.shape[1] == k // 32 * G.BLOCK_BYTES[qtype], (rows.shape, k)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    fp32_dot = x.dtype == torch.float32 or x.device.type == "cpu"
    block_m, block_n = _block_m(m), 32 if fp32_dot and x.device.type == "cuda" else 64
    count_launch("gguf_matmul")
    _gguf_matmul_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x2, rows, bias if bias is not None else y, y, m, n, k, x2.stride(0), rows.stride(0),
        y.stride(0), QTYPE=qtype, BLOCK_BYTES=G.BLOCK_BYTES[qtype], HAS_BIAS=bias is not None,
        FP32_DOT=fp32_dot, BLOCK_M=block_m, BLOCK_N=block_n,
    )  # fmt: skip
    return y.view(*shape[:-1], n)


@triton.jit
def _int8_matmul_kernel(
    xs_ptr,  # int8 [M, K]: x's unsigned bytes minus 128
    zero_ptr,  # int32 [M]: the zero points minus 128
    sx_ptr,  # fp32 [M]
    w_ptr,  # int8 [N / 64, K / 4, 64, 4]
    sw_ptr,  # fp32 [N]
    colsum_ptr,  # int32 [N]
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(xs_ptr + rm.to(tl.int64)[:, None] * K + rk[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0)  # fmt: skip
        # element (n, k) of the CPU layout
        at = ((rn // 64).to(tl.int64)[None, :] * (K // 4) + (rk // 4)[:, None]) * 256 + (
            (rn % 64) * 4
        )[None, :] + (rk % 4)[:, None]
        w = tl.load(w_ptr + at, mask=k_ok[:, None] & n_ok[None, :], other=0)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(x, w, out_dtype=tl.int32)
    zero = tl.load(zero_ptr + rm, mask=m_ok, other=0)
    colsum = tl.load(colsum_ptr + rn, mask=n_ok, other=0)
    acc = acc - zero[:, None] * colsum[None, :]
    sx = tl.load(sx_ptr + rm, mask=m_ok, other=0.0)
    sw = tl.load(sw_ptr + rn, mask=n_ok, other=0.0)
    y = acc.to(tl.float32) * (sx[:, None] * sw[None, :])
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :],
             y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])  # fmt: skip


def int8_matmul(
    x: torch.Tensor, weight: I.PackedInt8, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype, W8A8 as kernels/cpu/int8.py."""
    shape = x.shape
    xu, zero, sx = I.quantize_activations(x.reshape(-1, shape[-1]))
    xs = (xu - 128).to(torch.int8).contiguous()
    m, k = xs.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = _block_m(m)
    count_launch("int8_matmul")
    _int8_matmul_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, 64))](
        xs, (zero - 128).to(torch.int32), sx, weight.qweight, weight.scales, weight.colsum,
        bias if bias is not None else y, y, m, n, k, y.stride(0), HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64,
    )  # fmt: skip
    return y.view(*shape[:-1], n)
