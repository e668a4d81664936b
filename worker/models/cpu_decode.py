"""A decode step's Llama decoder layers as one call of tokenmill's CPU kernels
(`torch.ops.tokenmill.decode_layers`, kernels/cpu/csrc/decode_layers.cpp): the CPU's
counterpart of a captured CUDA graph.

At one request a layer's dozen ops cost as much in Python and dispatch as in arithmetic (SmolLM2
in bf16 on 2 cores: about 2.5 of a step's 13 ms). The call runs the same kernels the layers
call, in the same order, so its results are theirs bit for bit. It takes the steps whose every
request decodes one token, on models whose layers are Llama ones on the kernels (packed
or GGUF weights, biases or none as Qwen2's, no per-head norms, no soft-caps, one rank, CPU_ATTN);
anything else, and TOKENMILL_CPU_DECODE_LOOP=0, runs layer by layer. Projections with LoRA
slots (worker/lora/layers.py, on the CPU kernels) hand the call their adapters, and the step's
LoRAMapping (the forward context's) says which rows run which: the call adds the adapters'
products where the layers would, with the same kernels (csrc/lora.cpp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill.protocol import envs

if TYPE_CHECKING:
    from tokenmill.kernels.punica import LoRAMapping


@dataclass
class DecodePlan:
    weights: list[torch.Tensor]  # per layer: input norm, qkv, o, post-attention norm, gate/up, down
    biases: list[torch.Tensor | None]  # per layer: qkv, o, gate/up, down
    caches: list[torch.Tensor]
    windows: list[int]
    num_heads: int
    num_kv_heads: int
    scale: float
    eps: float
    # Per projection (qkv, o, gate/up, down): a GGUF weight's qs, d, m and its type (0: the
    # packed weight in `weights`).
    quant: list[torch.Tensor | None]
    qtypes: list[int]
    # Per projection, where any has LoRA slots (else all three empty / None): its a_stacked
    # and its slices' b_stacked, None past its slices (all None without slots), each slice's
    # first output column (0 past its slices), and the slots' scales all layers share.
    lora: list[torch.Tensor | None]
    lora_offsets: list[int]
    lora_scales: torch.Tensor | None


def plan_decode(layers: nn.ModuleList, dtype: torch.dtype) -> DecodePlan | None:
    """The plan for these layers, or None where one of them cannot run in the call."""
    from tokenmill.kernels.cpu import int8
    from tokenmill.kernels.cpu.linear import fuses_silu_mul
    from tokenmill.worker.attention.cpu_backend import CpuAttentionBackend
    from tokenmill.worker.models.llama import LlamaDecoderLayer, LlamaMLP
    from tokenmill.worker.parallel_state import get_tp_size

    if not envs.TOKENMILL_CPU_DECODE_LOOP or get_tp_size() != 1 or not len(layers):
        return None
    weights, biases, caches, windows, shapes = [], [], [], [], set()
    quant: list[torch.Tensor | None] = []
    qtypes: list[int] = []
    lora: list[torch.Tensor | None] = []
    lora_offsets: list[int] = []
    scales: list[torch.Tensor] = []
    for layer in layers:
        if type(layer) is not LlamaDecoderLayer or type(layer.mlp) is not LlamaMLP:
            return None
        attention, mlp = layer.self_attn, layer.mlp
        attn = attention.attn
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        projections = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if (
            attention.q_norm is not None
            or attn.logit_softcap is not None
            or not isinstance(attn.backend, CpuAttentionBackend)
            or attn.kv_cache.dim() != 5
            or mlp.act_fn.kind != "cpu"
            or any(n.kind != "cpu" or n.weight.dtype != dtype for n in norms)
            or any(p.qweight is None and (p.weight.dim() < 3 or p.weight.dtype != dtype)
                   for p in projections)  # fmt: skip
            or (mlp.gate_up_proj.qweight is None and not fuses_silu_mul(mlp.gate_up_proj.weight))
            or any(p.qweight is not None and _decode_operands(p.qweight) is None
                   for p in projections)  # fmt: skip
            or (isinstance(mlp.gate_up_proj.qweight, int8.PackedInt8)
                and not int8.fuses_silu_mul(mlp.gate_up_proj.qweight))
        ):
            return None
        weights += [norms[0].weight, projections[0].weight, projections[1].weight,
                    norms[1].weight, projections[2].weight, projections[3].weight]  # fmt: skip
        for p in projections:
            qtype, tensors = (0, [None] * 3) if p.qweight is None else _decode_operands(p.qweight)
            quant += tensors
            qtypes.append(qtype)
        for p in projections:
            if not _add_lora(getattr(p, "lora", None), dtype, lora, lora_offsets, scales):
                return None
        biases += [getattr(p, "bias", None) for p in projections]
        caches.append(attn.kv_cache)
        windows.append(attn.sliding_window or 0)
        shapes.add((attention.num_heads, attention.num_kv_heads, attn.scale, norms[0].eps,
                    norms[1].eps))  # fmt: skip
    if len(shapes) != 1:
        return None
    num_heads, num_kv_heads, scale, eps, post_eps = shapes.pop()
    if eps != post_eps:
        return None
    if any(s is not scales[0] for s in scales):
        return None  # (the LoRA manager's layers share one tensor of scales)
    if not scales:
        lora, lora_offsets = [], []
    return DecodePlan(weights, biases, caches, windows, num_heads, num_kv_heads, scale, eps,
                      quant, qtypes, lora, lora_offsets, scales[0] if scales else None)  # fmt: skip


_MAX_SLICES = 3  # a projection's LoRA slices in the call: q/k/v at most


def _add_lora(slots, dtype: torch.dtype, lora: list, offsets: list[int], scales: list) -> bool:
    """Appends a projection's LoRA operands (None for a projection without slots); False where
    its slots run other kernels than the call's (LoRALayer.apply on the CPU kernels)."""
    if slots is None:
        lora += [None] * (1 + _MAX_SLICES)
        offsets += [0] * _MAX_SLICES
        return True
    tensors = [slots.a_stacked, *slots.b_stacked]
    if (
        slots.kind != "cpu"
        or len(slots.b_stacked) > _MAX_SLICES
        or any(t.dtype != dtype or t.device.type != "cpu" for t in tensors)
    ):
        return False
    padding = _MAX_SLICES - len(slots.b_stacked)
    lora += tensors + [None] * padding
    offsets += list(slots.offsets) + [0] * padding
    scales.append(slots.scales)
    return True


def _decode_operands(qweight) -> tuple[int, list[torch.Tensor | None]] | None:
    """A quantized weight's operands for the call (its `decode_operands`), None for kinds
    the call does not take (Triton's)."""
    operands = getattr(qweight, "decode_operands", None)
    return operands() if operands is not None else None


def run_decode(
    plan: DecodePlan, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, metadata, lora_mapping: LoRAMapping | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The layers' (hidden, residual) for this decode step's embeddings x; with the step's
    LoRAMapping (kernels/punica.py), the rows run their adapters."""
    # (Without a mapping the call gets no LoRA operands: a step of the base model alone costs
    # what it did without LoRA, not the conversion of 16 more list entries a layer.)
    lora = plan.lora if lora_mapping is not None else []
    mapping = lora_mapping if lora else None
    return torch.ops.tokenmill.decode_layers(
        x, plan.weights, plan.biases, plan.caches, positions, cos, sin, metadata.slots,
        metadata.block_table, metadata.seq_lens, plan.num_heads, plan.num_kv_heads,
        plan.scale, plan.eps, plan.windows, plan.quant, plan.qtypes, lora,
        plan.lora_offsets if lora else [], plan.lora_scales if lora else None,
        None if mapping is None else mapping.sorted_rows,
        None if mapping is None else mapping.starts,
    )  # fmt: skip


class DecodeLoop:
    """Holds a model's plan (remade when its KV caches are) and says, step by step, whether
    the call takes the step."""

    def __init__(self) -> None:
        # The first layer's cache and q/k/v LoRA slots the plan was made for (the LoRA manager
        # sets every layer's slots at once).
        self._key: tuple | None = None
        self._plan: DecodePlan | None = None

    def run(
        self, layers: nn.ModuleList, x: torch.Tensor, rope
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden, residual) of the layers for this step, or None where it runs layer by
        layer."""
        from tokenmill.worker.attention.cpu_backend import CpuAttentionMetadata
        from tokenmill.worker.forward_context import get_forward_context
        from tokenmill.worker.layers.rotary import CpuRotation

        if type(rope) is not CpuRotation or x.dim() != 2:
            return None
        context = get_forward_context()
        metadata = context.attn_metadata
        if (
            not isinstance(metadata, CpuAttentionMetadata)
            or metadata.profile_prefills is not None
            or metadata.prefill_lens.shape[0]
            or metadata.seq_lens.shape[0] != x.shape[0]
        ):
            return None
        if not len(layers):
            return None
        attention = layers[0].self_attn
        cache = attention.attn.kv_cache
        slots = getattr(getattr(attention, "qkv_proj", None), "lora", None)
        if self._key is None or cache is not self._key[0] or slots is not self._key[1]:
            self._key, self._plan = (cache, slots), plan_decode(layers, x.dtype)
        if self._plan is None:
            return None
        return run_decode(self._plan, x, rope.positions, rope.cos, rope.sin, metadata,
                          context.lora_mapping)  # fmt: skip
