"""Triton kernels for the elementwise layers around attention: fused residual-add + RMSNorm
(Llama's and Gemma's), rotary embedding applied in place, SiLU-and-mul and GeGLU. Each
computes in fp32 and rounds where its torch counterpart (worker/layers/, worker/models/gemma.py)
rounds, so that fp32 results agree to rounding and 16-bit ones to one ulp. Each row is reduced
alone, in an order fixed by the row's width (batch-invariant). A program takes a tile of
`BLOCK_T` tokens: few programs for a small batch (the interpreter pays per program), enough of
them for a large one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.launches import count_launch


def _tokens_per_program(row_elems: int) -> int:
    """A tile of about 8K elements, at least one token."""
    return max(1, min(16, 8192 // triton.next_power_of_2(row_elems)))


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    num_tokens,
    hidden,
    eps,
    stride_x,
    stride_r,
    stride_o,
    HAS_RESIDUAL: tl.constexpr,
    PLUS_ONE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_H)
    mask = (tokens < num_tokens)[:, None] & (cols < hidden)[None, :]
    t = tokens.to(tl.int64)[:, None]
    x = tl.load(x_ptr + t * stride_x + cols[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + t * stride_r + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)  # rounded like residual.add_(x)
        tl.store(residual_ptr + t * stride_r + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    # Correctly rounded, as torch's fp32 rsqrt (the fast approximations differ in the last bits).
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(xf * xf, 1) / hidden + eps))
    w = tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    if PLUS_ONE:  # Gemma: x / rms(x) * (1 + w) all in fp32, rounded once
        y = (xf * rstd[:, None]) * (1.0 + w[None, :])
    else:  # Llama: x / rms(x) rounded to x's dtype, then times w
        y = (xf * rstd[:, None]).to(dtype).to(tl.float32) * w[None, :]
    tl.store(out_ptr + t * stride_o + cols[None, :], y.to(dtype), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    plus_one: bool = False,
) -> torch.Tensor:
    """RMSNorm of x [T, hidden] into `out` (default: a new tensor); with `residual`, first
    adds x into it in place and normalizes the sum (vLLM's fused_add_rms_norm). `plus_one`:
    Gemma's norm, which scales by 1 + weight in fp32 (GemmaRMSNorm's arithmetic)."""
    num_tokens, hidden = x.shape
    assert x.stride(1) == 1 and (residual is None or residual.stride(1) == 1)
    out = torch.empty_like(x) if out is None else out
    block_t = _tokens_per_program(hidden)
    count_launch("rms_norm")
    _rms_norm_kernel[(triton.cdiv(num_tokens, block_t),)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        num_tokens,
        hidden,
        eps,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        HAS_RESIDUAL=residual is not None,
        PLUS_ONE=plus_one,
        BLOCK_T=block_t,
        BLOCK_H=triton.next_power_of_2(hidden),
    )
    return out


@triton.jit
def _rotary_kernel(
    x_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    num_tokens,
    num_heads,
    stride_x_t,
    stride_x_h,
    stride_cos,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    heads = tl.arange(0, BLOCK_HEADS)
    cols = tl.arange(0, BLOCK_HALF)
    token_ok = tokens < num_tokens
    pos = tl.load(positions_ptr + tokens, mask=token_ok, other=0).to(tl.int64)
    table = pos[:, None] * stride_cos + cols[None, :]
    table_ok = token_ok[:, None] & (cols < HALF)[None, :]
    cos = tl.load(cos_ptr + table, mask=table_ok, other=0.0)[:, None, :]  # [T, 1, half]
    sin = tl.load(sin_ptr + table, mask=table_ok, other=0.0)[:, None, :]
    t = tokens.to(tl.int64)[:, None, None]
    x1_ptr = x_ptr + t * stride_x_t + heads[None, :, None] * stride_x_h + cols[None, None, :]
    mask = table_ok[:, None, :] & (heads < num_heads)[None, :, None]
    x1 = tl.load(x1_ptr, mask=mask, other=0.0)
    x2 = tl.load(x1_ptr + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    # The torch path multiplies by cos/sin already rounded to the activations' type.
    cos = cos.to(dtype).to(tl.float32)
    sin = sin.to(dtype).to(tl.float32)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(x1_ptr, (x1f * cos - x2f * sin).to(dtype), mask=mask)
    tl.store(x1_ptr + HALF, (x2f * cos + x1f * sin).to(dtype), mask=mask)


def rotary_embedding_(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Rotates x [T, heads, d] in place (rotate-half / NeoX style) by the angles of each
    token's position; cos/sin [max_position, d] are the fp32 tables whose two halves repeat."""
    num_tokens, num_heads, head_size = x.shape
    assert x.stride(2) == 1 and cos.stride(1) == 1 and sin.stride() == cos.stride()
    half = head_size // 2
    block_t = _tokens_per_program(num_heads * half)
    count_launch("rotary_embedding")
    _rotary_kernel[(triton.cdiv(num_tokens, block_t),)](
        x,
        positions,
        cos,
        sin,
        num_tokens,
        num_heads,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        HALF=half,
        BLOCK_T=block_t,
        BLOCK_HEADS=triton.next_power_of_2(num_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
    )


@triton.jit
def _act_and_mul_kernel(
    x_ptr,
    out_ptr,
    num_tokens,
    width,
    stride_x,
    stride_o,
    GELU_TANH: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = (tokens < num_tokens)[:, None] & (cols < width)[None, :]
    t = tokens.to(tl.int64)[:, None]
    gate = tl.load(x_ptr + t * stride_x + cols[None, :], mask=mask, other=0.0)
    up = tl.load(x_ptr + t * stride_x + width + cols[None, :], mask=mask, other=0.0)
    dtype = gate.dtype
    g = gate.to(tl.float32)
    if GELU_TANH:
        # 0.5 g (1 + tanh(u)) for u = sqrt(2 / pi) (g + 0.044715 g^3), which is g sigmoid(2u);
        # the sigmoid from exp(-2|u|) <= 1, which cannot overflow.
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        e = tl.exp(-2.0 * tl.abs(u))
        act = (g * tl.where(u >= 0, 1.0, e) / (1.0 + e)).to(dtype)
    else:
        act = (g / (1.0 + tl.exp(-g))).to(dtype)
    # The activation rounded to x's dtype, as F.silu's / F.gelu's output, then times up.
    tl.store(
        out_ptr + t * stride_o + cols[None, :],
        (act.to(tl.float32) * up.to(tl.float32)).to(dtype),
        mask=mask,
    )


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, 2n] (gate, then up) -> silu(gate) * up, [T, n], into `out` (default: new)."""
    return _act_and_mul(x, out, gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, 2n] (gate, then up) -> gelu(gate, tanh approximation) * up (Gemma's GeGLU)."""
    return _act_and_mul(x, out, gelu_tanh=True)


def _act_and_mul(x: torch.Tensor, out: torch.Tensor | None, gelu_tanh: bool) -> torch.Tensor:
    num_tokens, width = x.shape[0], x.shape[1] // 2
    assert x.stride(1) == 1
    if out is None:
        out = torch.empty((num_tokens, width), dtype=x.dtype, device=x.device)
    block_w = min(1024, triton.next_power_of_2(width))
    block_t = _tokens_per_program(block_w)
    count_launch("gelu_tanh_and_mul" if gelu_tanh else "silu_and_mul")
    _act_and_mul_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(width, block_w))](
        x, out, num_tokens, width, x.stride(0), out.stride(0), GELU_TANH=gelu_tanh,
        BLOCK_T=block_t, BLOCK_W=block_w,
    )  # fmt: skip
    return out
