"""Mixture-of-experts members of the Llama family: Qwen3-MoE (Qwen3's attention; a top-k
router over `num_experts` experts, renormalized by `norm_topk_prob`, on every
`decoder_sparse_step`-th layer except `mlp_only_layers`, which keep a dense MLP) and Mixtral
(Mistral's attention; top-2 of 8 experts, renormalized, on every layer). The experts are one
FusedMoE layer (worker/layers/fused_moe.py); their checkpoint tensors, one per expert and
projection, are stacked into it by the loader (`expert_projections`).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.protocol.config import ModelConfig
from tokenmill.worker.layers.fused_moe import FusedMoE
from tokenmill.worker.layers.linear import ReplicatedLinear
from tokenmill.worker.models.llama import LlamaForCausalLM, LlamaMLP


class SparseMoeBlock(nn.Module):
    """The router (`gate`, whole on every rank) and the experts."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported for experts")
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts)
        self.experts = FusedMoE(
            config.num_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
            renormalize=config.norm_topk_prob,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    qk_norm = True
    expert_projections = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

    @staticmethod
    def make_mlp(config: ModelConfig, layer: int) -> nn.Module:
        return SparseMoeBlock(config) if config.is_sparse(layer) else LlamaMLP(config)


class MixtralForCausalLM(LlamaForCausalLM):
    checkpoint_renames = {".block_sparse_moe.": ".mlp."}
    expert_projections = {"w1": "gate", "w3": "up", "w2": "down"}

    @staticmethod
    def make_mlp(config: ModelConfig, layer: int) -> nn.Module:
        return SparseMoeBlock(config)
