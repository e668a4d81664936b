"""The elementwise layers' CPU kernels (csrc/rms_norm.cpp, activation.cpp, rotary.cpp): one
call each where the torch path (worker/layers/, their reference) runs three to nine ops."""

from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm over the last dimension; with a residual, residual += x first (in place) and
    the sum is normalized."""
    return torch.ops.tokenmill.rms_norm(x, weight, eps, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[.., 2n] -> silu(gate) * up [.., n] (overwrites the gate half, a temporary)."""
    return torch.ops.tokenmill.silu_and_mul(x)


def rotary_embedding_(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Rotates x [T, heads, d] in place by the rows `positions` of the fp32 tables."""
    torch.ops.tokenmill.rotary_embedding(x, positions, cos, sin)
    return x
