"""Builds the model for this rank and fills its weights.

`load_format="auto"` streams safetensors tensor by tensor through each parameter's
`weight_loader`. The loaders receive a `CheckpointTensor`, which reads from the file only the
slice a loader asks for (`narrow`), so a tensor-parallel rank reads its own shard and never
holds the full model; fused q/k/v and gate/up parameters are filled shard by shard through the
model's `packed_modules_mapping`. `load_format="dummy"` gives random weights of the right
shapes (drawn per rank, so they differ between tensor-parallel sizes).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Union

import torch
from safetensors import safe_open
from torch import nn

from tokenmill.kernels.batch_invariant import batch_invariant
from tokenmill.protocol.config import EngineConfig
from tokenmill.protocol.device_defaults import has_triton
from tokenmill.worker.attention.base import AttentionBackend
from tokenmill.worker.layers.linear import default_weight_loader
from tokenmill.worker.models import get_model_class
from tokenmill.worker.platform import platform_of
from tokenmill.worker.pooler import drop_lm_head

logger = logging.getLogger(__name__)


class CheckpointTensor:
    """One tensor of an open safetensors file, read only when (and as far as) it is asked for."""

    def __init__(self, file: Any, name: str) -> None:
        self._slice = file.get_slice(name)
        self.shape = torch.Size(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Reads rows [start, start + length) of dimension `dim`, and nothing else."""
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]

    def load(self) -> torch.Tensor:
        return self._slice[:]


Loaded = Union[torch.Tensor, CheckpointTensor]


def get_model(config: EngineConfig, device: torch.device, backend: AttentionBackend) -> nn.Module:
    model_config = config.model_config
    dtype = getattr(torch, model_config.dtype)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = get_model_class(model_config.architecture)(model_config, backend)
    finally:
        torch.set_default_dtype(previous)
    if model_config.convert_type == "embed":
        drop_lm_head(model)
    # Which kernels quantized layers run on: the CPU kernels, Triton's (CUDA), or neither
    # (their weights de-quantized, int8's in torch).
    kernels = dict(kernels_in_use=platform_of(device).cpu_kernels(), triton=_triton_matmuls(device))
    if batch_invariant() and model_config.quantization is not None and kernels["triton"]:
        # (Their tiles follow the row count: kernels/quantized.py's _block_m.)
        raise ValueError(
            f"batch_invariant=True has no batch-invariant Triton matmul for quantization="
            f"{model_config.quantization!r} on {device.type}: run the unquantized checkpoint, "
            f"or leave batch_invariant off"
        )
    folder = Path(model_config.model)
    if config.load_config.load_format == "dummy":
        _init_dummy(model, model_config.seed)
    elif model_config.quantization == "gguf":
        from tokenmill.worker.layers.quantization import gguf

        load_weights(model, gguf.iter_gguf_weights(folder / gguf.GGUF_FILE, model))
        gguf.finalize(model, **kernels)
    elif model_config.quantization in ("awq", "gptq"):
        from tokenmill.worker.layers.quantization import gguf, int4

        weights = _iter_safetensors(folder)
        load_weights(model, int4.iter_int4_weights(weights, folder, model_config.quantization))
        gguf.finalize(model, **kernels)
    else:
        load_weights(model, _iter_safetensors(folder))
    if model_config.quantization == "int8":  # (dummy weights too: benchmarks quantize them)
        from tokenmill.worker.layers.quantization import int8

        int8.finalize(model, **kernels)
    platform_of(device).prepare_model(model)
    return model.eval()


def _triton_matmuls(device: torch.device) -> bool:
    """Whether quantized layers run Triton's matmuls (kernels/quantized.py): on CUDA, with
    triton installed."""
    return device.type == "cuda" and has_triton()


def _iter_safetensors(folder: Path) -> Iterator[tuple[str, CheckpointTensor]]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder} (load_format='auto')")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, CheckpointTensor(f, name)


# A mixture-of-experts layer's per-expert tensors: ...experts.{expert}.{projection}.weight
_EXPERT_TENSOR = re.compile(r"\.experts\.(\d+)\.(\w+)\.weight$")


def load_weights(model: nn.Module, weights: Iterator[tuple[str, Loaded]]) -> None:
    """Checkpoint tensors into the model's parameters, by name. A model may rename parts of
    the checkpoint's names (`checkpoint_renames`), stack experts' projections into one
    parameter (`expert_projections`: checkpoint projection -> gate, up or down), fuse q/k/v
    and gate/up (`packed_modules_mapping`), or take them fused from the checkpoint and load
    each shard's rows (`fused_checkpoint_tensors`: part -> [(shard id, rows)])."""
    params = dict(model.named_parameters())
    mapping: dict[str, tuple[str, object]] = getattr(model, "packed_modules_mapping", {})
    renames: dict[str, str] = getattr(model, "checkpoint_renames", {})
    splits: dict[str, list[tuple[object, int]]] = getattr(model, "fused_checkpoint_tensors", {})
    experts: dict[str, str] = getattr(model, "expert_projections", {})
    # A tied LM head is the embedding's; a dropped one (a pooling model's) is not loaded.
    dropped = hasattr(model, "lm_head") and model.lm_head is None
    skip_lm_head = getattr(model, "tie_word_embeddings", False) or dropped
    loaded: set[str] = set()
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name or (skip_lm_head and name.startswith("lm_head.")):
            continue
        for theirs, ours in renames.items():
            name = name.replace(theirs, ours)
        expert = _EXPERT_TENSOR.search(name) if experts else None
        if expert is not None and expert.group(2) in experts:
            shard = experts[expert.group(2)]
            target = name[: expert.start()] + (".experts.w2_weight" if shard == "down"
                                                else ".experts.w13_weight")  # fmt: skip
            param = _param(params, target, name)
            param.weight_loader(param, tensor, shard, int(expert.group(1)))  # type: ignore[attr-defined]
            loaded.add(target)
            continue
        fused = next((part for part in splits if f".{part}." in name), None)
        if fused is not None:  # one checkpoint tensor holding several shards (Phi-3's qkv)
            param = _param(params, name, name)
            offset = 0
            for shard_id, size in splits[fused]:
                param.weight_loader(param, tensor.narrow(0, offset, size), shard_id)  # type: ignore[attr-defined]
                offset += size
            loaded.add(name)
            continue
        for checkpoint_part, (fused_part, shard_id) in mapping.items():
            if f".{checkpoint_part}." in name:
                target = name.replace(f".{checkpoint_part}.", f".{fused_part}.")
                param = _param(params, target, name)
                param.weight_loader(param, tensor, shard_id)  # type: ignore[attr-defined]
                loaded.add(target)
                break
        else:
            param = _param(params, name, name)
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
    missing = set(params) - loaded - ({"lm_head.weight"} if skip_lm_head else set())
    if missing:
        raise ValueError(f"the checkpoint lacks weights for: {sorted(missing)[:10]}")


def _param(params: dict[str, nn.Parameter], name: str, checkpoint_name: str) -> nn.Parameter:
    try:
        return params[name]
    except KeyError:
        raise ValueError(
            f"checkpoint tensor {checkpoint_name!r} matches no model parameter"
        ) from None


@torch.no_grad()
def _init_dummy(model: nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        values = torch.empty(param.shape, dtype=torch.float32)
        fill = getattr(param, "dummy_fill", None)  # (Gemma's norms hold w of 1 + w)
        if fill is not None:
            values.fill_(fill)
        elif "norm" in name:
            values.fill_(1.0)
        else:
            values.uniform_(-0.05, 0.05, generator=generator)
        param.data.copy_(values)
