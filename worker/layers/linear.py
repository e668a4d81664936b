"""Tensor-parallel linear layers whose parameters know how to load their own shard.

Column-parallel layers split the output features across ranks, row-parallel ones the input
features (followed by an all-reduce). `QKVParallelLinear` and `MergedColumnParallelLinear`
fuse several checkpoint tensors (q/k/v, gate/up) into one matmul; their `weight_loader` takes
a shard id and copies the checkpoint tensor into its slice. The model loader calls
`param.weight_loader(param, loaded[, shard_id])` for each tensor as it streams the checkpoint;
`loaded` is a tensor or a lazily read `CheckpointTensor`, and loaders `narrow` it to their
rank's shard before anything is read.

On the CPU the model loader then re-lays every matmul weight out once (`pack_cpu_weights`):
for tokenmill's own CPU kernels (kernels/cpu/linear.py), else for oneDNN's prepacked GEMM;
`matmul` runs whichever the weight's layout says. In the batch-invariant mode on the Triton
path (CUDA, or a CPU model built with Triton's layers) weights stay plain and `matmul` runs
kernels/matmul.py, whose tiles do not depend on the row count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels.batch_invariant import batch_invariant
from tokenmill.worker.forward_context import current_lora_mapping
from tokenmill.worker.parallel_state import get_tp_rank, get_tp_size, tp_all_reduce

if TYPE_CHECKING:
    from tokenmill.worker.lora.layers import LoRALayer
    from tokenmill.worker.model_loader import CheckpointTensor

Loaded = Union[torch.Tensor, "CheckpointTensor"]


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(
            f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}"
        )
    return numerator // denominator


# The batch size oneDNN is told to expect when it packs a weight. Packed for 64 rows, a weight
# runs as fast at 1 to 2048 rows as when packed for each (fp32 and bf16, measured on AVX-512).
_PACK_BATCH_HINT = 64


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias), for a plain weight or one packed by `pack_cpu_weights`. A 16-bit
    x with a weight widened to fp32 is multiplied in fp32 and the product rounded back to x's
    dtype: bf16 x bf16 products are exact in fp32, so this is a bf16 GEMM with fp32
    accumulation (oneDNN's and HF's), at the speed of the fp32 one. In the batch-invariant
    mode a weight on the Triton path (on CUDA, or marked by `keep_for_triton_matmul`) runs
    kernels/matmul.py: cuBLAS, oneDNN and MKL choose their blocking by the row count."""
    if weight.dtype != x.dtype:
        return matmul(x.to(weight.dtype), weight, bias).to(x.dtype)
    if batch_invariant() and (weight.is_cuda or getattr(weight, "triton_matmul", False)):
        from tokenmill.kernels.matmul import matmul as invariant_matmul

        return invariant_matmul(x, weight, bias)
    if weight.dim() > 2 and not weight.is_mkldnn:
        from tokenmill.kernels.cpu.linear import linear

        return linear(x, weight, bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _reorder(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's blocked layout; None where oneDNN cannot pack it here (no
    oneDNN in this build, or no bf16 GEMM on this CPU)."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)
    except (RuntimeError, AttributeError):
        return None


def pack_cpu_weights(modules: list[nn.Module], own_kernels: bool = False) -> tuple[int, int]:
    """Re-lays the weights of these CPU matmul layers out, once: for tokenmill's own kernels
    (`own_kernels`; oneDNN's batch-reduce microkernel over column blocks, faster than oneDNN's
    own linear at every row count a decode step has, see kernels/cpu/csrc/linear.cpp) where
    the layout fits the weight, else into oneDNN's blocked layout. The packed tensor replaces
    the plain one, so memory does not grow; a weight shared with an embedding gets its own
    packed copy. torch's `F.linear` runs fp32 through MKL's
    sgemm, which on AMD CPUs takes a path without AVX-512: on a 2-core AMD EPYC oneDNN's
    prepacked GEMM is 2.5x faster in fp32 (1 to 2048 rows; 190 -> 450 GFLOPS at 2048) and
    10-40% faster in bf16, with fp32 accuracy.

    Where oneDNN has no bf16 GEMM for this CPU (no AVX-512: torch's own bf16 `F.linear` then
    runs 7-8x slower than fp32 here), bf16 weights are widened to fp32 (and packed where
    oneDNN is present) and `matmul` multiplies in fp32: bf16 activations and KV cache at
    fp32's matmul speed, for twice the weight memory. Returns (packed, widened) counts."""
    packed = widened = 0
    if own_kernels:
        from tokenmill.kernels.cpu import cpu_isa
        from tokenmill.kernels.cpu.linear import pack_weight

        bf16_gemm = cpu_isa() >= 1  # oneDNN's microkernel runs bf16 on AVX-512 and up
    for module in modules:
        weight = module.weight
        if getattr(module, "qweight", None) is not None or weight.dim() > 2 or weight.is_mkldnn:
            continue
        if weight.dtype not in (torch.float32, torch.bfloat16):
            continue
        if own_kernels:
            if weight.dtype == torch.bfloat16 and not bf16_gemm:
                weight = _widened(module)
                widened += 1
            blocked = pack_weight(weight)
            if blocked is not None:
                module.weight = nn.Parameter(blocked, requires_grad=False)
                module.weight.logical_shape = tuple(weight.shape)  # type: ignore[attr-defined]
                packed += 1
                continue
        blocked = _reorder(weight)
        if blocked is None and weight.dtype == torch.bfloat16:
            weight = _widened(module)
            widened += 1
        if blocked is not None:
            packed += 1
        module.weight = nn.Parameter(weight if blocked is None else blocked, requires_grad=False)
    return packed, widened


def keep_for_triton_matmul(modules: list[nn.Module]) -> None:
    """Leaves these CPU matmul layers' weights plain [N, K], marked for kernels/matmul.py: the
    batch-invariant mode on the Triton path, instead of `pack_cpu_weights` (oneDNN's prepacked
    GEMM picks its kernel by the row count). bf16 weights stay bf16: the Triton kernel
    multiplies them with fp32 accumulation, as a widened weight would be."""
    for module in modules:
        module.weight.triton_matmul = True  # type: ignore[attr-defined]


def _widened(module: nn.Module) -> torch.Tensor:
    """The module's bf16 weight as fp32 (its bias too), for a CPU without a bf16 GEMM."""
    bias = getattr(module, "bias", None)
    if bias is not None:
        module.bias = nn.Parameter(bias.detach().float(), requires_grad=False)
    return module.weight.detach().float()


def default_weight_loader(param: torch.Tensor, loaded: Loaded) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}"
        )
    param.data.copy_(loaded if isinstance(loaded, torch.Tensor) else loaded.load())


def load_rows(param: nn.Parameter, loaded: Loaded, offset: int = 0) -> None:
    """`loaded` into rows [offset, offset + its rows) of `param`; a quantized checkpoint
    tensor (GGUF's blocks) is kept as the file holds it, for the quantization method to lay
    out once all shards are in (worker/layers/quantization/)."""
    if getattr(loaded, "quantized", False):
        from tokenmill.worker.layers.quantization.gguf import record

        record(param, loaded, offset)  # type: ignore[arg-type]
        return
    rows = loaded.shape[0]
    whole = offset == 0 and rows == param.shape[0]
    default_weight_loader(param.data if whole else param.data.narrow(0, offset, rows), loaded)


def quantized_matmul(x: torch.Tensor, qweight, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T (+ bias) on a quantized weight (a GGUF or int4 one in the CPU kernels' blocks,
    an int8 one: each has its own `linear`); fp16 runs in fp32."""
    if x.dtype not in (torch.bfloat16, torch.float32):
        return qweight.linear(x.float(), bias).to(x.dtype)
    return qweight.linear(x, bias)


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp_dim: int | None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.tp_dim = tp_dim  # the dimension of the weight split across ranks, if any
        self.in_features, self.out_features = in_features, out_features  # on this rank
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)
        # A quantized weight in the kernels' layout (set by a quantization method's finalize;
        # the weight parameter is then empty).
        self.qweight = None
        # The adapter slots, where LoRA is on and targets this layer (worker/lora/).
        self.lora: LoRALayer | None = None

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.qweight is not None:
            y = quantized_matmul(x, self.qweight, bias)
        else:
            y = matmul(x, self.weight, bias)
        if self.lora is not None:
            mapping = current_lora_mapping()
            if mapping is not None:
                self.lora.apply(x, y, mapping)
        return y

    def _shard(self, param: nn.Parameter, loaded: Loaded) -> Loaded:
        dim = self.tp_dim
        if dim is None or self.tp_size == 1 or (param.dim() == 1 and dim == 1):
            return loaded
        size = param.shape[dim]
        return loaded.narrow(dim, self.tp_rank * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded) -> None:
        load_rows(param, self._shard(param, loaded))


class ColumnParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        out_per_rank = divide(out_features, get_tp_size(), "output features")
        super().__init__(in_features, out_per_rank, bias, tp_dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one weight, e.g. an MLP's gate and up projections."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(
        self, param: nn.Parameter, loaded: Loaded, shard_id: int | None = None
    ) -> None:
        if shard_id is None:
            raise ValueError("a merged linear layer loads one shard at a time")
        tp = self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // tp
        size = self.output_sizes[shard_id] // tp
        load_rows(param, loaded.narrow(0, self.tp_rank * size, size), offset)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k and v projections; KV heads are split across ranks (or replicated when
    there are fewer KV heads than ranks)."""

    def __init__(
        self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        tp = get_tp_size()
        self.head_size = head_size
        self.num_heads = divide(num_heads, tp, "num_attention_heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = divide(num_kv_heads, tp, "num_key_value_heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = divide(tp, num_kv_heads, "tensor_parallel_size / kv heads")
        out = (self.num_heads + 2 * self.num_kv_heads) * head_size * tp
        super().__init__(hidden_size, out, bias)

    def weight_loader(
        self, param: nn.Parameter, loaded: Loaded, shard_id: str | None = None
    ) -> None:
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        if shard_id == "q":
            offset, size, rank = 0, q_size, self.tp_rank
        elif shard_id in ("k", "v"):
            offset = q_size + (kv_size if shard_id == "v" else 0)
            size, rank = kv_size, self.tp_rank // self.kv_replicas
        else:
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        load_rows(param, loaded.narrow(0, rank * size, size), offset)


class ReplicatedLinear(LinearBase):
    """Whole on every rank (a mixture-of-experts router)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias, tp_dim=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class RowParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        in_per_rank = divide(in_features, get_tp_size(), "input features")
        super().__init__(in_per_rank, out_features, bias, tp_dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, after the partial sums of all ranks are reduced.
        y = tp_all_reduce(self._matmul(x, None))
        return y + self.bias if self.bias is not None else y
