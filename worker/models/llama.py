"""The Llama family: Llama and SmolLM2 (tied embeddings), Mistral, Qwen2 (q/k/v bias) and
Qwen3 (per-head q/k RMSNorm, explicit head_dim).

Built from the HF config.json dict; module and parameter names follow HF's so that the
loader maps checkpoint names directly, except q/k/v and gate/up, which are fused
(`packed_modules_mapping`). `forward(input_ids, positions)` takes the flattened batch and
returns hidden states; `compute_logits` runs the LM head on the rows that get sampled.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.worker.attention.base import AttentionBackend
from tokenmill.worker.layers.activation import SiluAndMul
from tokenmill.worker.layers.attention import Attention
from tokenmill.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.worker.layers.layernorm import RMSNorm
from tokenmill.worker.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tokenmill.worker.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters


class LlamaAttention(nn.Module):
    def __init__(
        self, config: dict[str, Any], backend: AttentionBackend, qkv_bias: bool, qk_norm: bool
    ) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        num_heads = config["num_attention_heads"]
        num_kv_heads = config.get("num_key_value_heads") or num_heads
        self.head_size = config.get("head_dim") or hidden // num_heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_size, num_heads, num_kv_heads, qkv_bias)
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        o_bias = bool(config.get("attention_bias", False))  # Qwen2's qkv bias leaves o_proj bare
        self.o_proj = RowParallelLinear(num_heads * self.head_size, hidden, bias=o_bias)
        eps = config.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(self.head_size, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_size, eps) if qk_norm else None
        self.attn = Attention(
            self.num_heads, self.head_size, self.num_kv_heads, self.head_size**-0.5, backend
        )

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_size)
        qk, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        # Queries and keys rotate together: one set of elementwise ops instead of two.
        qk = apply_rotary(qk, rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden, inter = config["hidden_size"], config["intermediate_size"]
        bias = bool(config.get("mlp_bias", False))
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config['hidden_act']!r} is not supported (only silu)")
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias=bias)
        self.down_proj = RowParallelLinear(inter, hidden, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: dict[str, Any], backend: AttentionBackend, qkv_bias: bool, qk_norm: bool
    ) -> None:
        super().__init__()
        eps = config.get("rms_norm_eps", 1e-6)
        self.self_attn = LlamaAttention(config, backend, qkv_bias, qk_norm)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], eps)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(
        self, config: dict[str, Any], backend: AttentionBackend, qkv_bias: bool, qk_norm: bool
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, backend, qkv_bias, qk_norm)
            for _ in range(config["num_hidden_layers"])
        )
        self.norm = RMSNorm(config["hidden_size"], config.get("rms_norm_eps", 1e-6))
        # One table for every layer: all layers rotate by the same positions.
        head_size = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        self.rotary_emb = RotaryEmbedding(
            head_size, config.get("max_position_embeddings", 2048), rope_parameters(config)
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary_emb.cos_sin(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(rope, x, residual)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    # checkpoint name -> (fused module name, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    qkv_bias = False
    qk_norm = False

    def __init__(self, config: dict[str, Any], backend: AttentionBackend) -> None:
        super().__init__()
        qkv_bias = self.qkv_bias or bool(config.get("attention_bias", False))
        self.model = LlamaModel(config, backend, qkv_bias, self.qk_norm)
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config["vocab_size"], config["hidden_size"])
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
