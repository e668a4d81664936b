"""RMSNorm, optionally fused with the residual add that precedes it (as in vLLM)."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.worker.layers.custom_op import CustomOp


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension in HF's arithmetic, in the same order, with in-place
    steps on the temporaries; `weight` broadcasts against x (per-head norms may pass one row
    of weights per head)."""
    dtype = x.dtype
    x = x.float()
    scale = x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    y = x * scale
    if y.dtype != dtype:
        y = y.to(dtype)
    return y.mul_(weight)


class RMSNorm(CustomOp):
    # Gemma's norm scales by 1 + w in fp32 (worker/models/gemma.py); Triton's kernel takes
    # both forms, reducing each row alone.
    plus_one = False

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_native(x, self.weight, self.eps)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """With a residual: adds x into it (in place; the caller hands it over) and normalizes
        the sum, returning both."""
        if residual is None:
            return self._norm(x)
        residual.add_(x)
        return self._norm(residual), residual

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.dtype != self.weight.dtype or not x.is_contiguous():
            return self.forward_native(x, residual)
        from tokenmill.kernels.cpu.layers import rms_norm

        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps, residual), residual

    def forward_triton(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from tokenmill.kernels.layers import rms_norm

        shape = x.shape
        x = x.reshape(-1, shape[-1])  # per-head norms (Qwen3) come as [T, heads, d]
        out = rms_norm(x, self.weight, self.eps, residual, plus_one=self.plus_one).view(shape)
        return out if residual is None else (out, residual)
