"""SiLU-and-multiply for gated MLPs: the fused gate/up output [.., 2n] -> [.., n]."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Overwrites the gate half of x (a temporary of the MLP)."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate, inplace=True) * up
