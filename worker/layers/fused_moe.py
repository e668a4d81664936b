"""A mixture-of-experts MLP: a router picks each token's top_k experts (gated SiLU MLPs) and
weights their outputs (vLLM's FusedMoE).

Routing is HF's: softmax over the router logits in fp32, the top_k, renormalized to sum to 1
where the model says (Mixtral always, Qwen3-MoE by `norm_topk_prob`), cast to the activations'
dtype. The experts' weights are stacked into one parameter per projection, w13 [E, 2I, H]
(gate rows, then up rows) and w2 [E, H, I], filled expert by expert from the checkpoint's
per-expert tensors, and split along the intermediate dimension I across tensor-parallel ranks
(as a column-parallel layer followed by a row-parallel one: each rank's output is a partial
sum, all-reduced here). The CPU path is torch: two batched matmuls over the experts' padded
token groups for a step of up to a few thousand assignments, else one matmul per expert
(kernels/reference.py); the Triton path sorts tokens by expert and runs grouped GEMMs
(kernels/fused_moe.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels.reference import fused_moe_reference
from tokenmill.worker.layers.custom_op import CustomOp
from tokenmill.worker.layers.linear import Loaded, default_weight_loader, divide
from tokenmill.worker.parallel_state import get_tp_rank, get_tp_size, tp_all_reduce


class FusedMoE(CustomOp):
    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.inter = divide(intermediate_size, self.tp_size, "moe_intermediate_size")
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * self.inter, hidden_size), requires_grad=False
        )
        self.w2_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, self.inter), requires_grad=False
        )
        for param in (self.w13_weight, self.w2_weight):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard: str, expert: int) -> None:
        """One expert's projection from the checkpoint: "gate" and "up" ([I, H], this rank's
        rows) into w13, "down" ([H, I], this rank's columns) into w2."""
        i, start = self.inter, self.tp_rank * self.inter
        if shard == "down":
            default_weight_loader(param.data[expert], loaded.narrow(1, start, i))
        elif shard in ("gate", "up"):
            target = param.data[expert].narrow(0, 0 if shard == "gate" else i, i)
            default_weight_loader(target, loaded.narrow(0, start, i))
        else:
            raise ValueError(f"an expert's shard is gate, up or down, got {shard!r}")

    def route(self, router_logits: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """(weights, expert ids), each [T, top_k]."""
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(dtype), ids

    def forward_native(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(router_logits, x.dtype)
        return tp_all_reduce(moe_on_cpu(x, self.w13_weight, self.w2_weight, weights, ids))

    def forward_triton(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        from tokenmill.kernels.fused_moe import fused_moe

        weights, ids = self.route(router_logits, x.dtype)
        return tp_all_reduce(fused_moe(x, self.w13_weight, self.w2_weight, weights, ids))


# Up to this many (token, expert) assignments a step's experts run as two batched matmuls
# over every expert's tokens padded to the busiest expert's count, instead of a pair of
# matmuls per expert: a decode step is then ~12 ops per layer instead of ~10 per expert.
# Measured on 2 AMX cores (16 experts, top-4, hidden 512, bf16): 35 decodes 1.1 ms against
# 2.9 ms per layer, 512 tokens 3.2 against 5.9; at 2048 tokens the padding and its copies
# cost more than the loop (21 against 15 ms), and with fewer assignments than experts
# (one decode) the loop touches only the experts used.
BATCHED_MAX_ASSIGNMENTS = 4096


def moe_on_cpu(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """The experts' outputs, [T, H]: batched over experts when that pays, else the
    per-expert reference (kernels/reference.py)."""
    num_experts = w13.shape[0]
    assignments = ids.numel()
    if assignments < num_experts or assignments > BATCHED_MAX_ASSIGNMENTS:
        return fused_moe_reference(x, w13, w2, weights, ids)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    capacity = int(counts.max())
    if num_experts * capacity > 2 * assignments:  # too uneven: mostly padding
        return fused_moe_reference(x, w13, w2, weights, ids)
    experts = flat[order]
    # Each assignment's row in [experts x capacity]: its expert's block, its rank there.
    starts = torch.cumsum(counts, 0) - counts
    rows = experts * capacity + (torch.arange(assignments, device=x.device) - starts[experts])
    tokens = order // ids.shape[1]
    padded = x.new_zeros(num_experts * capacity, x.shape[1])
    padded[rows] = x[tokens]
    gate, up = torch.bmm(padded.view(num_experts, capacity, -1), w13.transpose(1, 2)).chunk(
        2, dim=-1
    )
    y = torch.bmm(F.silu(gate) * up, w2.transpose(1, 2)).view(num_experts * capacity, -1)
    out = torch.zeros_like(x)
    out.index_add_(0, tokens, y[rows] * weights.reshape(-1)[order, None])
    return out
