"""The adapter slots of one linear layer (`LoRALayer`, set on a `LinearBase` as `.lora` by the
LoRA manager) and how a step's rows run them: after the base matmul, each row's output gains
scaling * x @ A^T @ B^T of the adapter in its slot (kernels/punica.py's shrink and expand, on
the CPU kernels, in Triton on CUDA, else in torch).

A packed layer (q/k/v, gate/up) keeps its slices' A stacked along the rank, shrinks once and
expands once per slice into the slice's output columns. Shards follow the base layer's: a
column-parallel layer's B is cut along its output rows as the weight is, a row-parallel
layer's A along its input columns, whose partial products the layer's all-reduce then sums
(x A^T B^T is linear in x's shards)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenmill.kernels.punica import LoRAMapping

if TYPE_CHECKING:
    from tokenmill.worker.layers.linear import LinearBase
    from tokenmill.worker.lora.adapter import LoRALayerWeights

# Where each slice of a layer's output comes from in the full (unsharded) weight: (slice id as
# the adapter reader keys it, first row, rows) on this rank.
SliceRows = tuple[str | int | None, int, int]


def layer_slices(layer: LinearBase) -> list[SliceRows]:
    """The base layer's output slices on this rank: q/k/v, gate/up, or the whole output."""
    from tokenmill.worker.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )

    rank = layer.tp_rank
    if isinstance(layer, QKVParallelLinear):
        q, kv = layer.num_heads * layer.head_size, layer.num_kv_heads * layer.head_size
        kv_rank = rank // layer.kv_replicas
        return [("q", rank * q, q), ("k", kv_rank * kv, kv), ("v", kv_rank * kv, kv)]
    if isinstance(layer, MergedColumnParallelLinear):
        sizes = [size // layer.tp_size for size in layer.output_sizes]
        return [(i, rank * size, size) for i, size in enumerate(sizes)]
    width = layer.out_features
    first = 0 if isinstance(layer, RowParallelLinear) or layer.tp_dim is None else rank * width
    return [(None, first, width)]


def full_shape(layer: LinearBase) -> tuple[int, list[int]]:
    """The whole (unsharded) layer's input width and its slices' output rows, which an
    adapter's A [r, in] and B [out, r] are read as."""
    from tokenmill.worker.layers.linear import QKVParallelLinear, RowParallelLinear

    tp = layer.tp_size
    if isinstance(layer, RowParallelLinear):
        return layer.in_features * tp, [layer.out_features]
    if isinstance(layer, QKVParallelLinear):
        kv_heads = layer.num_kv_heads * tp // layer.kv_replicas
        q, kv = layer.num_heads * tp * layer.head_size, kv_heads * layer.head_size
        return layer.in_features, [q, kv, kv]
    sizes = getattr(layer, "output_sizes", None)
    if sizes is not None:
        return layer.in_features, list(sizes)
    return layer.in_features, [layer.out_features * (1 if layer.tp_dim is None else tp)]


class LoRALayer:
    """Slots for `max_loras` adapters on one linear layer: a_stacked [S, slices * R, K] in
    the model's dtype (slice i's A in rows i*R .. i*R + rank, zeros below a smaller rank),
    b_stacked[i] [S, N_i, R] per slice, and the manager's per-slot scales [S] (fp32), shared
    by all layers."""

    def __init__(
        self,
        base: LinearBase,
        max_loras: int,
        max_rank: int,
        scales: torch.Tensor,
        dtype: torch.dtype,
        device: torch.device,
        kind: str,
    ) -> None:
        from tokenmill.worker.layers.linear import RowParallelLinear

        self.slices = layer_slices(base)
        self.full_in, self.full_rows = full_shape(base)
        self.row_parallel = isinstance(base, RowParallelLinear)
        self.in_features = in_features = base.in_features  # on this rank
        self.tp_rank = base.tp_rank
        self.max_rank = max_rank
        self.kind = kind  # "cpu", "triton" or "native": which kernels apply() runs
        self.scales = scales
        self.a_stacked = torch.zeros(
            max_loras, len(self.slices) * max_rank, in_features, dtype=dtype, device=device
        )
        self.b_stacked = [
            torch.zeros(max_loras, rows, max_rank, dtype=dtype, device=device)
            for _, _, rows in self.slices
        ]
        # Output column of each slice in the base layer's output on this rank.
        self.offsets = [
            sum(rows for _, _, rows in self.slices[:i]) for i in range(len(self.slices))
        ]

    def check(self, name: str, weights: dict[str | int | None, LoRALayerWeights]) -> None:
        """A ValueError naming the module where an adapter's matrices do not fit the whole
        layer (an adapter of another base model): refused when it is added, not in a step."""
        for (slice_id, _, _), rows in zip(self.slices, self.full_rows):
            pair = weights.get(slice_id)
            if pair is None:
                continue
            a, b = tuple(pair.lora_a.shape), tuple(pair.lora_b.shape)
            if a[1] != self.full_in or b[0] != rows:
                part = "" if slice_id is None else f" (slice {slice_id})"
                raise ValueError(
                    f"{name}{part}: the adapter's lora_A {list(a)} and lora_B {list(b)} do not "
                    f"fit the model's layer (lora_A [r, {self.full_in}], lora_B [{rows}, r]): "
                    "is the adapter made for another base model?"
                )

    def set_slot(self, slot: int, weights: dict[str | int | None, LoRALayerWeights]) -> None:
        """Slot `slot` holds these slices' matrices (PEFT's A [r, in], B [out, r], whole:
        this rank's shard is cut here); slices the adapter leaves out are zeros."""
        self.a_stacked[slot].zero_()
        for b in self.b_stacked:
            b[slot].zero_()
        k = self.in_features
        for i, (slice_id, first, rows) in enumerate(self.slices):
            pair = weights.get(slice_id)
            if pair is None:
                continue
            a, b = pair.lora_a, pair.lora_b
            rank = a.shape[0]
            if self.row_parallel:
                a = a[:, self.tp_rank * k : (self.tp_rank + 1) * k]
            else:
                b = b[first : first + rows]
            if a.shape[1] != k or b.shape[0] != rows:
                raise ValueError(
                    f"the adapter's matrices {tuple(pair.lora_a.shape)} and "
                    f"{tuple(pair.lora_b.shape)} do not fit the layer ({rows} x {k} here)"
                )
            row = i * self.max_rank
            self.a_stacked[slot, row : row + rank].copy_(a)
            self.b_stacked[i][slot, :, :rank].copy_(b)

    def apply(self, x: torch.Tensor, out: torch.Tensor, mapping: LoRAMapping) -> None:
        """out [T, N] += each row's adapter's product for x [T, K], in place."""
        ops = _ops(self.kind)
        y = ops.lora_shrink(x, self.a_stacked, mapping, self.scales)
        rank = self.max_rank
        for i, (b, offset) in enumerate(zip(self.b_stacked, self.offsets)):
            ops.lora_expand(y[:, i * rank : (i + 1) * rank], b, mapping, out, offset)


def _ops(kind: str):
    if kind == "cpu":
        from tokenmill.kernels.cpu import lora as ops
    elif kind == "triton":
        from tokenmill.kernels import lora as ops  # type: ignore[no-redef]
    else:
        from tokenmill.kernels import punica as ops  # type: ignore[no-redef]
    return ops
