"""Matmuls on weights packed once at load (csrc/linear.cpp): the packing and the product.

A packed weight is [N / block_n, K / 2, block_n, 2] in bf16 (pairs of k side by side, as AMX
tiles and AVX-512 bf16 dot products read them) or [N / block_n, K, block_n] in fp32; its shape
says everything `linear` needs. Where the layout does not fit a weight (K odd in bf16, N not
a multiple of 16), `pack_weight` returns None and the caller keeps its own path.
"""

from __future__ import annotations

import torch

# Output columns per block: each block is one microkernel call per row block. 32 columns are
# two AMX tiles' worth; N a multiple of 16 only takes blocks of 16.
BLOCK_N = (64, 32, 16)


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [N, K] (bf16 or fp32) in the layout `linear` streams, or None where it does
    not fit."""
    n, k = weight.shape
    if weight.dtype == torch.bfloat16 and k % 2:
        return None
    block_n = next((b for b in BLOCK_N if n % b == 0), None)
    if block_n is None or weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    return torch.ops.tokenmill.pack_linear_weight(weight.detach().contiguous(), block_n)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N], in x's dtype (the packed weight's)."""
    shape = x.shape
    y = torch.ops.tokenmill.linear(x.reshape(-1, shape[-1]), packed, bias)
    return y.view(*shape[:-1], y.shape[-1])


def linear_silu_mul(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """silu(gate) * up for a gated MLP's packed [gate; up] weight, [..., K] -> [..., N / 2]:
    silu_and_mul(linear(x, packed, bias)) bit for bit, without the [..., N] product. The
    halves must be whole column blocks (`fuses_silu_mul`)."""
    shape = x.shape
    y = torch.ops.tokenmill.linear_silu_mul(x.reshape(-1, shape[-1]), packed, bias)
    return y.view(*shape[:-1], y.shape[-1])


def fuses_silu_mul(packed: torch.Tensor) -> bool:
    """Whether `linear_silu_mul` takes this weight: packed for `linear`, its gate and up
    halves whole blocks."""
    return packed.dim() in (3, 4) and not packed.is_mkldnn and packed.shape[0] % 2 == 0


def unpack_weight(packed: torch.Tensor) -> torch.Tensor:
    """The [N, K] weight a packed one was made from."""
    if packed.dim() == 4:
        blocks, half_k, block_n, _ = packed.shape
        return packed.permute(0, 2, 1, 3).reshape(blocks * block_n, half_k * 2)
    blocks, k, block_n = packed.shape
    return packed.transpose(1, 2).reshape(blocks * block_n, k)
