"""Mixture-of-experts members of the Llama family: Qwen3-MoE (Qwen3's attention; a top-k
router over `num_experts` experts, renormalized by `norm_topk_prob`, on every
`decoder_sparse_step`-th layer except `mlp_only_layers`, which keep a dense MLP) and Mixtral
(Mistral's attention; top-2 of 8 experts, renormalized, on every layer). The experts are one
FusedMoE layer (worker/layers/fused_moe.py); their checkpoint tensors, one per expert and
projection, are stacked into it by the loader (`expert_projections`). The experts' config.json
fields are parsed here (`MoeConfig`), from ModelConfig.hf_text_config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.protocol.config import ModelConfig
from tokenmill.worker.layers.fused_moe import FusedMoE
from tokenmill.worker.layers.linear import ReplicatedLinear
from tokenmill.worker.models.llama import LlamaForCausalLM, LlamaMLP


@dataclass(frozen=True)
class MoeConfig:
    """The experts' fields of config.json: experts per sparse layer, experts per token, each
    expert's intermediate size, whether the top-k weights are renormalized, and which layers
    are sparse (every decoder_sparse_step-th, except mlp_only_layers, which keep a dense MLP
    of the model's intermediate_size)."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]

    @classmethod
    def parse(cls, config: ModelConfig) -> MoeConfig:
        text = config.hf_text_config
        # (Mixtral names them num_local_experts and intermediate_size)
        return cls(
            num_experts=int(text.get("num_experts") or text.get("num_local_experts") or 0),
            num_experts_per_tok=int(text.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(
                text.get("moe_intermediate_size") or config.intermediate_size
            ),
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            decoder_sparse_step=int(text.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(text.get("mlp_only_layers") or ()),
        )

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )


class SparseMoeBlock(nn.Module):
    """The router (`gate`, whole on every rank) and the experts."""

    def __init__(self, config: ModelConfig, moe: MoeConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported for experts")
        self.gate = ReplicatedLinear(config.hidden_size, moe.num_experts)
        self.experts = FusedMoE(
            moe.num_experts,
            moe.num_experts_per_tok,
            config.hidden_size,
            moe.moe_intermediate_size,
            renormalize=moe.norm_topk_prob,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    qk_norm = True
    expert_projections = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

    @staticmethod
    def make_mlp(config: ModelConfig, layer: int) -> nn.Module:
        moe = MoeConfig.parse(config)
        return SparseMoeBlock(config, moe) if moe.is_sparse(layer) else LlamaMLP(config)


class MixtralForCausalLM(LlamaForCausalLM):
    checkpoint_renames = {".block_sparse_moe.": ".mlp."}
    expert_projections = {"w1": "gate", "w3": "up", "w2": "down"}

    @staticmethod
    def make_mlp(config: ModelConfig, layer: int) -> nn.Module:
        return SparseMoeBlock(config, MoeConfig.parse(config))
