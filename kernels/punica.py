"""The batched LoRA matmuls in which each row of a batch runs its own adapter (vLLM's punica
ops `lora_shrink` / `lora_expand`; S-LoRA's and Punica's SGMV), in torch: the reference of the
CPU kernels (kernels/cpu/lora.py, which fall back to these) and the Triton ones
(kernels/lora.py). The LoRA linear layers call them; the model runner builds one `LoRAMapping`
per step from the rows' adapter slots, and every layer of the step reuses it.

Adapters sit in S slots, stacked: A [S, R, K], B [S, N, R], ranks below R padded with zeros
(a padded rank adds exact zeros). A layer's output gains scale * x @ A^T @ B^T per row:
`lora_shrink` makes y = scale * x @ A^T [T, R] in fp32, `lora_expand` adds y @ B^T into the
base layer's output. A packed layer (q/k/v, gate/up) stacks its slices' A along R and shrinks
once, then expands once per slice, y's columns of that slice into the output columns at the
slice's offset.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRAMapping:
    """A step's rows grouped by adapter slot, as grouped (SGMV) kernels read them: slot s's
    rows are sorted_rows[starts[s]:starts[s + 1]], in row order; the first starts[0] rows of
    sorted_rows have no adapter (slot -1). Built on the rows' device without waiting for it
    (sizes depend on T and S only), so a CUDA graph can capture the building."""

    row_slots: torch.Tensor  # [T] int64: each row's slot, -1 for none
    sorted_rows: torch.Tensor  # [T] int64: the rows, stably sorted by slot
    starts: torch.Tensor  # [S + 1] int64: where each slot's rows begin in sorted_rows; [S] = T

    @classmethod
    def of(cls, row_slots: torch.Tensor, num_slots: int) -> LoRAMapping:
        """The mapping of row_slots [T] (values in -1..num_slots - 1)."""
        row_slots = row_slots.to(torch.int64)
        if row_slots.device.type == "cpu" and row_slots.numel():
            low, high = row_slots.min().item(), row_slots.max().item()
            if low < -1 or high >= num_slots:
                raise ValueError(
                    f"row slots must lie in -1..{num_slots - 1} (-1: no adapter), got {low}..{high}"
                )
        counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=row_slots.device)
        counts.scatter_add_(0, row_slots + 1, torch.ones_like(row_slots))
        return cls(row_slots, torch.argsort(row_slots, stable=True), torch.cumsum(counts, 0))

    @property
    def num_slots(self) -> int:
        return self.starts.numel() - 1

    def segments(self) -> Iterator[tuple[int, torch.Tensor]]:
        """(slot, its rows) for each slot that has rows, in slot order (reads starts on the
        host)."""
        bounds = self.starts.tolist()
        for slot in range(self.num_slots):
            begin, end = bounds[slot], bounds[slot + 1]
            if end > begin:
                yield slot, self.sorted_rows[begin:end]


def slot_scales(scale: float | torch.Tensor, num_slots: int, device: torch.device) -> torch.Tensor:
    """Each slot's scale (alpha / rank) as an fp32 [S] tensor: one for all, or one each."""
    if isinstance(scale, torch.Tensor):
        if scale.shape != (num_slots,):
            raise ValueError(f"scale must be a float or [{num_slots}], got {tuple(scale.shape)}")
        return scale.to(device=device, dtype=torch.float32)
    return torch.full((num_slots,), float(scale), dtype=torch.float32, device=device)


def lora_shrink(
    x: torch.Tensor, a_stacked: torch.Tensor, mapping: LoRAMapping, scale: float | torch.Tensor
) -> torch.Tensor:
    """y [T, R] fp32: y[t] = scale[s] * x[t] @ a_stacked[s]^T for s = the row's slot, zeros for
    rows of no adapter. x [T, K] and a_stacked [S, R, K] in bf16 or fp32; one matmul per slot
    in use."""
    slots, rank, _ = a_stacked.shape
    scales = slot_scales(scale, slots, x.device)
    y = torch.zeros(x.shape[0], rank, dtype=torch.float32, device=x.device)
    for slot, rows in mapping.segments():
        product = x.index_select(0, rows).float() @ a_stacked[slot].float().T
        y.index_copy_(0, rows, product * scales[slot])
    return y


def lora_expand(
    y: torch.Tensor,
    b_stacked: torch.Tensor,
    mapping: LoRAMapping,
    out: torch.Tensor,
    offset: int = 0,
) -> None:
    """out[t, offset:offset + N] += y[t] @ b_stacked[s]^T in place, summed in fp32 and rounded
    to out's dtype once; rows of no adapter untouched. y [T, R] fp32 (a column slice of a
    packed layer's y is fine), b_stacked [S, N, R] in out's dtype."""
    n = b_stacked.shape[1]
    if offset < 0 or offset + n > out.shape[1]:
        raise ValueError(
            f"columns {offset}..{offset + n} do not fit in an output of {out.shape[1]} columns"
        )
    cols = out[:, offset : offset + n]
    for slot, rows in mapping.segments():
        product = y.index_select(0, rows) @ b_stacked[slot].float().T
        cols.index_copy_(0, rows, (cols.index_select(0, rows).float() + product).to(out.dtype))
