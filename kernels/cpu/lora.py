"""The batched LoRA matmuls on the CPU (csrc/lora.cpp): the LoRA layers' shrink and expand,
each row by its own adapter. Where the kernels are not loaded (TOKENMILL_CPU_KERNELS=0, no
compiler), for other devices or dtypes, these run kernels/punica.py's torch ops, the
kernels' reference; the arguments and results are the same either way. On 2 Zen 4 cores, bf16,
a q/k/v layer's shrink and three expands at rank 16 take 23 us for one decode row (the torch
ops 108 us) and 133 us for 300 prefill rows (670 us); numbers in csrc/lora.cpp.
"""

from __future__ import annotations

import torch

from tokenmill.kernels import cpu, punica
from tokenmill.kernels.punica import LoRAMapping

_KERNEL_DTYPES = (torch.bfloat16, torch.float32)


def _kernel_runs(operand: torch.Tensor, weights: torch.Tensor) -> bool:
    return (
        cpu.loaded()
        and operand.device.type == "cpu"
        and operand.dtype in _KERNEL_DTYPES
        and weights.dtype == operand.dtype
    )


def lora_shrink(
    x: torch.Tensor, a_stacked: torch.Tensor, mapping: LoRAMapping, scale: float | torch.Tensor
) -> torch.Tensor:
    """y [T, R] fp32: scale[s] * x[t] @ a_stacked[s]^T for row t's slot s, zeros for rows of no
    adapter (`punica.lora_shrink`)."""
    if not _kernel_runs(x, a_stacked):
        return punica.lora_shrink(x, a_stacked, mapping, scale)
    scales = punica.slot_scales(scale, a_stacked.shape[0], x.device)
    return torch.ops.tokenmill.lora_shrink(
        x, a_stacked, mapping.sorted_rows, mapping.starts, scales
    )


def lora_expand(
    y: torch.Tensor,
    b_stacked: torch.Tensor,
    mapping: LoRAMapping,
    out: torch.Tensor,
    offset: int = 0,
) -> None:
    """out[t, offset:offset + N] += y[t] @ b_stacked[s]^T in place, rounded once; rows of no
    adapter untouched (`punica.lora_expand`)."""
    if not _kernel_runs(out, b_stacked):
        punica.lora_expand(y, b_stacked, mapping, out, offset)
        return
    torch.ops.tokenmill.lora_expand(out, y, b_stacked, mapping.sorted_rows, mapping.starts, offset)
