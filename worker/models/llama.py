"""The Llama family: Llama and SmolLM2 (tied embeddings), Mistral (a sliding window on every
layer), Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm, explicit head_dim) and Phi-3
(q/k/v and gate/up fused in the checkpoint, LongRoPE).

Built from the typed `ModelConfig` (config.json is read once, in protocol/config.py);
module and parameter names follow HF's so that the loader maps checkpoint names directly,
except q/k/v and gate/up, which are fused (`packed_modules_mapping`). `forward(input_ids,
positions)` takes the flattened batch and returns hidden states; `compute_logits` runs the LM
head on the rows that get sampled.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenmill.kernels.cpu import int8
from tokenmill.kernels.cpu.linear import fuses_silu_mul, linear_silu_mul
from tokenmill.protocol.config import ModelConfig
from tokenmill.worker.attention.base import AttentionBackend
from tokenmill.worker.forward_context import current_lora_mapping
from tokenmill.worker.layers.activation import SiluAndMul
from tokenmill.worker.layers.attention import Attention
from tokenmill.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.worker.layers.layernorm import RMSNorm, rms_norm_native
from tokenmill.worker.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tokenmill.worker.layers.rotary import LongRope, RotaryEmbedding, StepRotation
from tokenmill.worker.models.cpu_decode import DecodeLoop


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        qkv_bias: bool,
        qk_norm: bool,
        layer: int,
    ) -> None:
        super().__init__()
        hidden, self.head_size = config.hidden_size, config.head_size
        num_heads = config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_size, num_heads, config.num_kv_heads, qkv_bias
        )
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        # Qwen2's q/k/v bias leaves o_proj bare.
        self.o_proj = RowParallelLinear(
            num_heads * self.head_size, hidden, bias=config.attention_bias
        )
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(self.head_size, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_size, eps) if qk_norm else None
        self.attn = Attention(
            self.num_heads, self.head_size, self.num_kv_heads, self.head_size**-0.5, backend,
            sliding_window=config.window_of(layer),
        )  # fmt: skip

    def forward(self, rope: StepRotation, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_size)
        qk, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None and self.k_norm is not None:
            qk = self.norm_heads(qk, self.q_norm, self.k_norm)
        # Queries and keys rotate together: one set of elementwise ops instead of two.
        qk = rope.apply(qk)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return self.o_proj(self.attn(q, k, v))

    def norm_heads(self, qk: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm) -> torch.Tensor:
        """Qwen3's per-head norms: q_norm over the query heads, k_norm over the key heads. In
        torch, one pass over both with a row of weights per head (the same arithmetic as two
        norms and a concatenation, in a third of the ops)."""
        if q_norm.use_triton:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            return torch.cat((q_norm(q), k_norm(k)), dim=1)
        weight = torch.cat(
            (q_norm.weight.expand(self.num_heads, -1), k_norm.weight.expand(self.num_kv_heads, -1))
        )
        return rms_norm_native(qk, weight, q_norm.eps)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported (only silu)")
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], config.mlp_bias)
        self.down_proj = RowParallelLinear(inter, hidden, bias=config.mlp_bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj
        weight = gate_up.weight
        # Packed for tokenmill's CPU kernels (and not widened to fp32 for this CPU): one
        # pass, no [.., 2 * inter] product; not where an adapter adds to that product.
        fused = gate_up.lora is None or current_lora_mapping() is None
        if (
            fused
            and self.act_fn.kind == "cpu"
            and weight.dtype == x.dtype
            and fuses_silu_mul(weight)
        ):
            return self.down_proj(linear_silu_mul(x, weight, gate_up.bias))
        q = gate_up.qweight
        if (
            fused
            and self.act_fn.kind == "cpu"
            and isinstance(q, int8.PackedInt8)
            and int8.fuses_silu_mul(q)
            and x.dtype in (torch.bfloat16, torch.float32)
        ):
            return self.down_proj(int8.int8_linear_silu_mul(x, q, gate_up.bias))
        return self.down_proj(self.act_fn(gate_up(x)))


MlpFactory = Callable[[ModelConfig, int], nn.Module]


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        qkv_bias: bool,
        qk_norm: bool,
        layer: int,
        make_mlp: MlpFactory,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, backend, qkv_bias, qk_norm, layer)
        self.mlp = make_mlp(config, layer)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        rope: StepRotation,
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
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        qkv_bias: bool,
        qk_norm: bool,
        make_mlp: MlpFactory,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, backend, qkv_bias, qk_norm, i, make_mlp)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.decode_loop = DecodeLoop()
        # One table for every layer: all layers rotate by the same positions.
        self.rotary_emb = RotaryEmbedding(
            config.head_size, config.max_position_embeddings, config.rope_parameters
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary_emb.prepare(positions, x.dtype)
        # On the CPU kernels a decode step's layers run as one call (worker/models/cpu_decode.py).
        done = self.decode_loop.run(self.layers, x, rope) if x.device.type == "cpu" else None
        if done is not None:
            x, residual = done
        else:
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

    @staticmethod
    def make_mlp(config: ModelConfig, layer: int) -> nn.Module:
        return LlamaMLP(config)

    def build_model(self, config: ModelConfig, backend: AttentionBackend) -> nn.Module:
        """The decoder stack (embeddings, layers, final norm, rotary table); the LM head
        around it is this class's, for every family."""
        qkv_bias = self.qkv_bias or config.attention_bias
        return LlamaModel(config, backend, qkv_bias, self.qk_norm, self.make_mlp)

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.model = self.build_model(config, backend)
        self.tie_word_embeddings = config.tie_word_embeddings
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    @property
    def long_rope(self) -> LongRope | None:
        """LongRoPE's rule for the rotary table's rows (worker/layers/rotary.py), which the
        model runner applies to every step's positions; None without it."""
        return self.model.rotary_emb.long_rope


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3: Llama's layers with q/k/v and gate/up fused in the checkpoint (each split onto
    this rank's shards while loading), LongRoPE, and a sliding window on every layer where
    the config sets one."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__(config, backend)
        q = config.num_attention_heads * config.head_size
        kv = config.num_kv_heads * config.head_size
        inter = config.intermediate_size
        self.fused_checkpoint_tensors = {
            "qkv_proj": [("q", q), ("k", kv), ("v", kv)],
            "gate_up_proj": [(0, inter), (1, inter)],
        }
