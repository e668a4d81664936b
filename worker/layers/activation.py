"""SiLU-and-multiply for gated MLPs: the fused gate/up output [.., 2n] -> [.., n]."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.worker.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """Overwrites the gate half of x (a temporary of the MLP)."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate, inplace=True) * up

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        from tokenmill.kernels.cpu.layers import silu_and_mul

        return silu_and_mul(x)

    def forward_triton(self, x: torch.Tensor) -> torch.Tensor:
        from tokenmill.kernels.layers import silu_and_mul

        return silu_and_mul(x)
