"""Gemma 2 and Gemma 3 (text): the Llama layout with Gemma's own pieces.

- embeddings scaled by sqrt(hidden_size) (in the activations' dtype, as HF);
- RMSNorm with (1 + w), in fp32 (`GemmaRMSNorm`), and four norms per layer: before and after
  the attention, before and after the MLP (the "after" ones normalize the sub-layer's output
  before it joins the residual stream);
- a GeGLU MLP (gelu with the tanh approximation);
- attention scores scaled by query_pre_attn_scalar ** -0.5;
- Gemma 2: attention-score soft-capping and final-logit soft-capping, sliding windows on
  alternate layers;
- Gemma 3: per-head q/k norms, a local:global layer pattern (`layer_types`) where the sliding
  layers rotate with their own base frequency (two rotary tables), no soft-capping.
Parameter names are HF's (q/k/v and gate/up fused as in the Llama family). Gemma's own
config.json fields are parsed here (`GemmaConfig`), from ModelConfig.hf_text_config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.protocol.config import ModelConfig
from tokenmill.worker.attention.base import AttentionBackend
from tokenmill.worker.layers.attention import Attention
from tokenmill.worker.layers.custom_op import CustomOp
from tokenmill.worker.layers.embedding import VocabParallelEmbedding
from tokenmill.worker.layers.layernorm import RMSNorm
from tokenmill.worker.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tokenmill.worker.layers.rotary import RotaryEmbedding, StepRotation
from tokenmill.worker.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class GemmaConfig:
    """Gemma's fields of config.json that the engine as a whole does not need."""

    # Attention scores scaled by query_pre_attn_scalar ** -0.5 (None: head_size's).
    query_pre_attn_scalar: float | None
    # Gemma 2's soft-capping of the attention scores and of the final logits (None: none).
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None

    @classmethod
    def parse(cls, config: ModelConfig) -> GemmaConfig:
        text = config.hf_text_config
        return cls(
            query_pre_attn_scalar=_optional_float(text.get("query_pre_attn_scalar")),
            attn_logit_softcapping=_optional_float(text.get("attn_logit_softcapping")),
            final_logit_softcapping=_optional_float(text.get("final_logit_softcapping")),
        )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w), all in fp32, then cast (HF's Gemma arithmetic); the checkpoint's
    w is zero-centred, so random-weight (dummy) models fill it with 0."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self.weight.data.zero_()
        self.weight.dummy_fill = 0.0  # type: ignore[attr-defined]

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        y = x * x.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        return y.mul_(1.0 + self.weight.float()).to(dtype)

    # RMSNorm.forward_triton runs Triton's kernel in this form (torch's CUDA reductions pick
    # their split by the row count: not batch-invariant).
    plus_one = True

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.forward_native(x, residual)  # the C++ kernel scales by w, not 1 + w


class GeluTanhAndMul(CustomOp):
    """GeGLU: gelu(gate, tanh approximation) * up, from the fused gate/up output."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def forward_triton(self, x: torch.Tensor) -> torch.Tensor:
        from tokenmill.kernels.layers import gelu_tanh_and_mul

        return gelu_tanh_and_mul(x)


class GemmaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        gemma: GemmaConfig,
        backend: AttentionBackend,
        layer: int,
        qk_norm: bool,
    ) -> None:
        super().__init__()
        hidden, self.head_size = config.hidden_size, config.head_size
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_size, config.num_attention_heads, config.num_kv_heads,
            config.attention_bias,
        )  # fmt: skip
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_size, hidden, bias=config.attention_bias
        )
        eps = config.rms_norm_eps
        self.q_norm = GemmaRMSNorm(self.head_size, eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_size, eps) if qk_norm else None
        scalar = gemma.query_pre_attn_scalar or self.head_size
        self.attn = Attention(
            self.num_heads, self.head_size, self.num_kv_heads, scalar**-0.5, backend,
            sliding_window=config.window_of(layer),
            logit_softcap=gemma.attn_logit_softcapping,
        )  # fmt: skip

    def forward(self, rope: StepRotation, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_size)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        qk = rope.apply(torch.cat((q, k), dim=1))
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return self.o_proj(self.attn(q, k, v))


class GemmaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(
                f"hidden_activation={config.hidden_act!r} is not supported for Gemma "
                "(gelu_pytorch_tanh is)"
            )
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter])
        self.down_proj = RowParallelLinear(inter, hidden)
        self.act_fn = GeluTanhAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        gemma: GemmaConfig,
        backend: AttentionBackend,
        layer: int,
        qk_norm: bool,
    ) -> None:
        super().__init__()
        self.sliding = config.is_sliding(layer)
        self.self_attn = GemmaAttention(config, gemma, backend, layer, qk_norm)
        self.mlp = GemmaMLP(config)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self,
        rope: StepRotation,
        x: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried apart (`residual`) and x is the last sub-layer's
        normalized output, added in by the next norm."""
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(rope, x))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaModel(nn.Module):
    def __init__(
        self, config: ModelConfig, gemma: GemmaConfig, backend: AttentionBackend, qk_norm: bool
    ) -> None:
        super().__init__()
        self.gemma = gemma
        self.hidden_size = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, gemma, backend, i, qk_norm)
            for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        max_pos = config.max_position_embeddings
        self.rotary_emb = RotaryEmbedding(config.head_size, max_pos, config.rope_parameters)
        # Gemma 3's sliding layers rotate with their own base frequency.
        self.rotary_emb_local = None
        if config.sliding_rope_parameters is not None:
            self.rotary_emb_local = RotaryEmbedding(
                config.head_size, max_pos, config.sliding_rope_parameters
            )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.hidden_size**0.5, dtype=x.dtype)
        rope = self.rotary_emb.prepare(positions, x.dtype)
        local = rope
        if self.rotary_emb_local is not None:
            local = self.rotary_emb_local.prepare(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(local if layer.sliding else rope, x, residual)
        x, _ = self.norm(x, residual)
        return x


class Gemma2ForCausalLM(LlamaForCausalLM):
    """The Llama family's LM head (tied, vocabulary-parallel) and weight mapping around
    Gemma's decoder stack, with Gemma 2's final-logit soft-capping."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__(config, backend)
        self.final_softcap = self.model.gemma.final_logit_softcapping

    def build_model(self, config: ModelConfig, backend: AttentionBackend) -> nn.Module:
        return GemmaModel(config, GemmaConfig.parse(config), backend, self.qk_norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
