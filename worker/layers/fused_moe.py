"""A mixture-of-experts MLP: a router picks each token's top_k experts (gated SiLU MLPs) and
weights their outputs (vLLM's FusedMoE).

Routing is HF's: softmax over the router logits in fp32, the top_k, renormalized to sum to 1
where the model says (Mixtral always, Qwen3-MoE by `norm_topk_prob`), cast to the activations'
dtype. The experts' weights are stacked into one parameter per projection, w13 [E, 2I, H]
(gate rows, then up rows) and w2 [E, H, I], filled expert by expert from the checkpoint's
per-expert tensors, and split along the intermediate dimension I across tensor-parallel ranks
(as a column-parallel layer followed by a row-parallel one: each rank's output is a partial
sum, all-reduced here). The CPU path is torch (`moe_on_cpu`): every expert on every token
for a few tokens; otherwise the tokens sorted by expert into padded blocks, two batched
matmuls over all experts for a step of up to a few thousand assignments (an expert with
more tokens than the blocks hold takes the rest in a block of its own), else a pair of
matmuls per expert; the Triton path sorts tokens by expert and runs grouped GEMMs
(kernels/fused_moe.py). A GGUF model's experts on the CPU kernels stay in their blocks, one
packed weight per expert and projection (`quantized_experts`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

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
        # A GGUF model's experts on the CPU kernels: per expert, its [gate; up] and its down
        # projection in their blocks (kernels/cpu/gguf.py), the stacks above left empty.
        self.gguf_experts: tuple[list, list] | None = None

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard: str, expert: int) -> None:
        """One expert's projection from the checkpoint: "gate" and "up" ([I, H], this rank's
        rows) into w13, "down" ([H, I], this rank's columns) into w2. A quantized one (GGUF's
        blocks) is recorded as it is, for the quantization method to lay out once all are in
        (worker/layers/quantization/gguf.py)."""
        i, start = self.inter, self.tp_rank * self.inter
        if getattr(loaded, "quantized", False):
            from tokenmill.worker.layers.quantization.gguf import record_expert

            if shard == "down":
                record_expert(param, expert, loaded.narrow(1, start, i), 0)
            else:
                offset = 0 if shard == "gate" else i
                record_expert(param, expert, loaded.narrow(0, start, i), offset)
            return
        if shard == "down":
            default_weight_loader(param.data[expert], loaded.narrow(1, start, i))
        elif shard in ("gate", "up"):
            target = param.data[expert].narrow(0, 0 if shard == "gate" else i, i)
            default_weight_loader(target, loaded.narrow(0, start, i))
        else:
            raise ValueError(f"an expert's shard is gate, up or down, got {shard!r}")

    def route(self, router_logits: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """(weights, expert ids), each [T, top_k]. Renormalized, the top_k probabilities are
        the softmax of the top_k logits (the full softmax's denominator cancels), so that the
        softmax runs over top_k values instead of every expert and the division goes; the
        order is the same (softmax is monotonic)."""
        if self.renormalize:
            logits, ids = torch.topk(router_logits, self.top_k, dim=-1)
            return torch.softmax(logits, dim=-1, dtype=torch.float32).to(dtype), ids
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        return weights.to(dtype), ids

    def forward_native(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(router_logits, x.dtype)
        if self.gguf_experts is not None:
            return tp_all_reduce(quantized_experts(x, *self.gguf_experts, weights, ids))
        return tp_all_reduce(moe_on_cpu(x, self.w13_weight, self.w2_weight, weights, ids))

    def forward_triton(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        from tokenmill.kernels.fused_moe import fused_moe

        weights, ids = self.route(router_logits, x.dtype)
        return tp_all_reduce(fused_moe(x, self.w13_weight, self.w2_weight, weights, ids))


def gemm_rows(n: int) -> int:
    """The row count a CPU matmul of n rows runs at: n rounded up to one of eight steps per
    power of two, 16 at least (17 -> 18, 100 -> 104, 1500 -> 1536).

    oneDNN compiles a kernel for every matmul shape it meets and keeps a bounded number of
    them (worker/platform.py: ONEDNN_KERNEL_CACHE). Each expert's share of a step's tokens
    changes from step to step: unrounded, its kernels never stop being compiled, or evicted
    and compiled again (1248 compiled in one W1-cpu run of the tiny Qwen3-MoE, 127 rounded).
    Rounded, a weight meets about 70 shapes up to 8192 rows, for at most 1/8 more rows.
    (Dense layers run on the step's token count as it is: a few hundred counts per run, and
    padding their inputs costs 15-40% of a small matmul here.)"""
    if n <= 16:
        return 16
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step


# When a step's experts run as two batched matmuls over blocks of one size instead of a pair
# of matmuls per expert: a dozen ops per layer instead of a few per expert, for padding rows
# and for reading the weights of experts without tokens. Measured on 2 AMX cores (16
# experts, top-4, hidden 512, bf16, row counts rounded), batched against per expert: 1 token
# (4 experts used) 0.94 against 0.74 ms per layer; 2 tokens (6 used) 0.89 against 0.96; 64
# tokens 1.27 against 2.28; 2048 tokens spread evenly 6.0 against 10.2 (oneDNN splits one
# matmul of 512 rows or more between the cores poorly; a batched one gives each core whole
# matmuls). Past BATCHED_MAX_ASSIGNMENTS assignments the padded copies grow past tens of MB
# for little gain. Blocks of up to BATCHED_WEIGHT_BOUND_ROWS rows are padded freely (such a
# matmul is bound by reading its weights), larger ones to at most twice the assignments.
BATCHED_MAX_ASSIGNMENTS = 8192
BATCHED_WEIGHT_BOUND_ROWS = 64

# Where the batched blocks are large (past WEIGHTS_FIRST_MAX_ROWS: the matmuls are bound by
# arithmetic, so every padding row costs), they need not hold the busiest expert: the
# capacity that costs least is chosen (`batched_capacity`), and the experts with more tokens
# multiply the rest in blocks of their own, each counted as OWN_BLOCK_ROWS rows more for its
# extra pair of matmuls (64 and 1024 both did worse). A prefill step of 2048 tokens routes up
# to twice the mean to one expert here (1010 of 8192 assignments against 512): one capacity
# for all pads to 16384 rows and took 11.1-12.7 ms per layer; 576 rows for all and four own
# blocks, 9924 rows, take 8.7. Evenly spread routing keeps one capacity.
OWN_BLOCK_ROWS = 256

# Blocks of up to this many rows multiply with the experts' weights as the first operand
# (W [2I, H] @ block^T [H, rows]) instead of the second (block @ W^T). oneDNN's AMX and
# AVX-512 kernels re-lay the second operand out on every call: as the second, a weight is
# read, written and read again; as the first it streams through once, and the small block is
# what gets re-laid. Measured on 2 AMX cores with the experts' weights coming from DRAM (as
# in a decode step; 16 experts, hidden 512, bf16, both matmuls of a layer): 16-row blocks
# 0.88 against 0.67 ms, 32 rows 1.25 against 0.64, 128 rows 2.9 against 2.3; level at 512
# rows, and 5% slower at 768.
WEIGHTS_FIRST_MAX_ROWS = 256

# Steps of up to this many tokens that use most experts (where the sorted path would run
# batched matmuls over every expert anyway) run every expert on every token instead
# (`_every_expert`). That is 2 flops per token per byte of weights read, far below what the
# cores do while the weights stream in, so the matmuls cost what reading the weights costs,
# and the sorting, gathering and scattering (a dozen ops) go. Measured on 2 AMX cores with
# the weights in DRAM (16 experts, top-4, hidden 512, bf16), per layer: 4-16 tokens 0.94-0.97
# against 1.11-1.18 ms; 24 tokens 4% faster; 32 tokens 5% slower.
DENSE_MAX_TOKENS = 16


def batched_capacity(per_expert: np.ndarray, assignments: int) -> int:
    """The rows of the blocks every expert gets in the batched matmuls, 0 for none (each
    expert with tokens multiplies its own block). Experts with more tokens than that take
    the rest in blocks of their own (see OWN_BLOCK_ROWS)."""
    num_experts = per_expert.size
    most_in_use = 3 * np.count_nonzero(per_expert) >= num_experts  # a third of them, at least
    if not most_in_use or assignments > BATCHED_MAX_ASSIGNMENTS:
        return 0
    counts = per_expert.tolist()
    busiest = gemm_rows(max(counts))
    if busiest <= BATCHED_WEIGHT_BOUND_ROWS:
        return busiest
    if busiest <= WEIGHTS_FIRST_MAX_ROWS:  # bound by reading the weights: one block each
        return busiest if num_experts * busiest <= 2 * assignments else 0

    def rows(capacity: int) -> int:
        extra = [gemm_rows(n - capacity) + OWN_BLOCK_ROWS for n in counts if n > capacity]
        return num_experts * capacity + sum(extra)

    capacity = min(sorted({gemm_rows(n) for n in counts if n}), key=rows)
    return capacity if rows(capacity) <= 2 * assignments else 0


def moe_on_cpu(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """The experts' outputs, [T, H], as kernels/reference.py computes them.

    The step's (token, expert) assignments are sorted by expert and copied into blocks of
    padded rows (vLLM's `moe_align_block_size`), `gemm_rows` of them so that oneDNN meets a
    few matmul shapes instead of a new one per expert and step. Where that pays, every expert
    gets a block of one size (`batched_capacity`) and they all go through two batched
    matmuls; the tokens an expert has beyond it, or all of them where nothing is batched, go
    into a block of its own with a pair of matmuls. Small blocks are multiplied weights-first
    (WEIGHTS_FIRST_MAX_ROWS). Each row's activations are scaled by its routing weight (0 on
    padding rows) before the down projection, as vLLM's kernel weights the rows it
    computes, so that the block rows add into their tokens' rows as they are."""
    num_experts, hidden = w13.shape[0], x.shape[1]
    # The bookkeeping runs in numpy: at decode a few hundred assignments, where a torch op
    # costs more than its work.
    flat = ids.reshape(-1).cpu().numpy()
    per_expert = np.bincount(flat, minlength=num_experts)
    most_in_use = 3 * np.count_nonzero(per_expert) >= num_experts  # a third of them, at least
    if most_in_use and x.shape[0] <= DENSE_MAX_TOKENS:
        return _every_expert(x, w13, w2, weights, ids)
    assignments = flat.size
    order = np.argsort(flat, kind="stable")
    experts = flat[order]
    capacity = batched_capacity(per_expert, assignments)
    own = [gemm_rows(n - capacity) if n > capacity else 0 for n in per_expert.tolist()]
    batched_rows = num_experts * capacity
    own_starts = np.concatenate(([0], np.cumsum(own)))  # counted from the first own-block row
    # Each assignment's rank among its expert's (its place in sorted order less the
    # assignments sorted before), then its row: in its expert's batched block while the
    # rank fits, else in the expert's own block (after all the batched ones).
    rank = np.arange(assignments) - (np.cumsum(per_expert) - per_expert)[experts]
    rows = np.where(
        rank < capacity,
        experts * capacity + rank,
        batched_rows + own_starts[experts] + rank - capacity,
    )
    # Each block row's token and routing weight (padding rows repeat token 0, finite, with
    # weight 0: they add zeros).
    source = np.zeros(batched_rows + int(own_starts[-1]), dtype=np.int64)
    source[rows] = order // ids.shape[1]
    row_weights = np.zeros(source.size, dtype=np.float32)
    row_weights[rows] = weights.reshape(-1).float().cpu().numpy()[order]
    source_t = torch.from_numpy(source).to(x.device)
    scale = torch.from_numpy(row_weights).to(x.device, x.dtype)  # exact: they were x.dtype

    padded = x.index_select(0, source_t)
    y = padded.new_empty(source.size, hidden)
    inter = w2.shape[2]
    if capacity:
        blocks = padded[:batched_rows].view(num_experts, capacity, hidden)
        block_scale = scale[:batched_rows].view(num_experts, capacity)
        out = y[:batched_rows].view(num_experts, capacity, hidden)
        if capacity <= WEIGHTS_FIRST_MAX_ROWS:  # [2I, H] @ [H, rows]
            gate_up = torch.bmm(w13, blocks.transpose(1, 2))
            act = F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])
            act.mul_(block_scale.unsqueeze(1))
            out.copy_(torch.bmm(w2, act).transpose(1, 2))
        else:
            gate, up = torch.bmm(blocks, w13.transpose(1, 2)).chunk(2, dim=-1)
            act = F.silu(gate).mul_(up).mul_(block_scale.unsqueeze(2))
            torch.bmm(act, w2.transpose(1, 2), out=out)
    # The own blocks, each expert's span of rows in them.
    x_own, y_own, scale_own = padded[batched_rows:], y[batched_rows:], scale[batched_rows:]
    bounds = own_starts.tolist()
    spans = [(e, slice(bounds[e], bounds[e + 1])) for e, size in enumerate(own) if size]
    if spans and max(own) <= WEIGHTS_FIRST_MAX_ROWS:
        for expert, span in spans:
            gate_up = torch.mm(w13[expert], x_own[span].t())
            act = F.silu(gate_up[:inter]).mul_(gate_up[inter:]).mul_(scale_own[span])
            torch.mm(w2[expert], act, out=y_own[span].t())
    elif spans:
        gate_up = x_own.new_empty(x_own.shape[0], w13.shape[1])
        for expert, span in spans:
            torch.mm(x_own[span], w13[expert].t(), out=gate_up[span])
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate).mul_(up).mul_(scale_own[:, None])
        for expert, span in spans:
            torch.mm(act[span], w2[expert].t(), out=y_own[span])
    return torch.zeros_like(x).index_add_(0, source_t, y)


def quantized_experts(
    x: torch.Tensor,
    w13: list,
    w2: list,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """The experts' outputs, [T, H], with each expert's projections quantized (objects with
    `linear`, as kernels/cpu/gguf.py's packed weights): each expert multiplies the tokens
    routed to it (at decode a few rows each: the kernels' few-row loop streams only the
    experts in use), its activations scaled by their routing weights before the down
    projection, as `moe_on_cpu` does."""
    top_k, inter = ids.shape[1], w2[0].shape[1]
    flat = ids.reshape(-1).cpu().numpy()
    order = np.argsort(flat, kind="stable")
    bounds = np.concatenate(([0], np.cumsum(np.bincount(flat, minlength=len(w13)))))
    order_t = torch.from_numpy(order).to(x.device)
    tokens_t = order_t // top_k
    scales = weights.reshape(-1).index_select(0, order_t)
    y = torch.zeros_like(x)
    for expert in np.flatnonzero(np.diff(bounds)).tolist():
        span = slice(int(bounds[expert]), int(bounds[expert + 1]))
        rows = tokens_t[span]
        gate_up = w13[expert].linear(x.index_select(0, rows))
        act = F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:]).mul_(scales[span, None])
        y.index_add_(0, rows, w2[expert].linear(act))
    return y


def _every_expert(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """The experts' outputs with every expert run on every token, its output scaled by the
    token's routing weight for it (0 where the router did not pick it), before the down
    projection: two matmuls, weights first, and no sorting, gathering or scattering. See
    DENSE_MAX_TOKENS for when this pays."""
    num_experts, two_inter, hidden = w13.shape
    inter, tokens = two_inter // 2, x.shape[0]
    gate_up = torch.mm(w13.view(-1, hidden), x.t()).view(num_experts, two_inter, tokens)
    act = F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])  # [E, I, T]
    routing = x.new_zeros(tokens, num_experts).scatter_(1, ids, weights)
    act.mul_(routing.t().unsqueeze(1))
    return torch.bmm(w2, act).sum(0).t()  # the experts' [E, H, T] products, summed
