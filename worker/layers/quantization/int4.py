"""AWQ and GPTQ int4 checkpoints (quantization="awq" / "gptq"), loaded as vLLM loads them.

A quantized linear layer `prefix` of such a checkpoint holds (safetensors):
  qweight int32   GPTQ: [K / 8, N], eight 4-bit values a word along K (value j in bits 4j);
                  AWQ:  [K, N / 8], eight along N in AutoAWQ's order: nibble i holds column
                        (0, 2, 4, 6, 1, 3, 5, 7)[i] of its eight
  qzeros int32    [K / group, N / 8], the zero points, packed along N as the format packs q
  scales fp16     [K / group, N]
  g_idx int32     [K], GPTQ only: each input feature's group (act-order checkpoints, desc_act,
                  list them out of order)
and its weight is w[n, k] = scales[g, n] * (q[k, n] - z[g, n]) with g = g_idx[k] (GPTQ) or
k // group (AWQ); GPTQ's original format (checkpoint_format "gptq", the default) stores z - 1.

`iter_int4_weights` turns each such layer, once at load, into rows of Q4_Z blocks (the CPU
kernels' int4 format with an integer zero point per 32 weights: kernels/cpu/gguf.py), handed
to the layers' loaders as a GGUF tensor is; gguf.finalize then lays them out for the kernels
(or de-quantizes them where there are none). An act-order layer's columns are sorted by group,
and the layer takes x's features in that order (`PackedGGUF.perm`). Other tensors (norms, the
embedding, layers left unquantized) pass through as they are.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill.kernels.cpu import gguf as kernels
from tokenmill.worker.layers.quantization.gguf import GGUFWeight

logger = logging.getLogger(__name__)

PACK = 8  # 4-bit values per int32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column each nibble of an AWQ word holds
PARTS = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class Int4Config:
    """config.json's quantization_config, the fields the loader reads."""

    method: str  # "awq" or "gptq"
    group_size: int  # -1: one group per output column
    zeros_minus_one: bool  # GPTQ's original format

    @classmethod
    def from_model(cls, folder: Path, method: str) -> Int4Config:
        config = json.loads((folder / "config.json").read_text()).get("quantization_config") or {}
        bits = int(config.get("bits", config.get("w_bit", 4)))
        if bits != 4:
            raise ValueError(f"quantization_config.bits must be 4 for {method}, got {bits}")
        group = int(config.get("group_size", config.get("q_group_size", 128)))
        if group != -1 and (group <= 0 or group % PACK):
            raise ValueError(
                "quantization_config.group_size must be -1 or a positive multiple of 8, got "
                f"{group}"
            )
        if method == "awq":
            if not config.get("zero_point", True):
                raise ValueError("quantization_config.zero_point must be true for awq, got false")
            version = str(config.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(
                    f"quantization_config.version must be 'gemm' for awq, got {version!r}"
                )
        fmt = str(config.get("checkpoint_format", "gptq")).lower()
        return cls(method, group, method == "gptq" and fmt != "gptq_v2")


def unpack_along_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] of eight 4-bit values a word along rows -> int32 [8R, C]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32).view(1, PACK, 1)
    return ((packed.unsqueeze(1) >> shifts) & 0xF).reshape(-1, packed.shape[1])


def unpack_along_columns(packed: torch.Tensor, awq: bool) -> torch.Tensor:
    """int32 [R, C] of eight 4-bit values a word along columns -> int32 [R, 8C]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    values = (packed.unsqueeze(-1) >> shifts) & 0xF  # [R, C, nibble]
    if awq:  # column j of a word sits in nibble AWQ_ORDER.index(j)
        values = values[..., [AWQ_ORDER.index(j) for j in range(PACK)]]
    return values.reshape(packed.shape[0], -1)


def to_q4_z(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, groups: torch.Tensor
) -> torch.Tensor | None:
    """Rows of Q4_Z blocks [N, K / 32 * 20] of a layer given as q [K, N] (integers 0-15),
    zeros [G, N] (integers), scales fp16 [G, N] and each input feature's group [K]; None where
    a block of 32 features spans two groups."""
    k, n = q.shape
    if k % kernels.BLOCK:
        return None
    block_groups = groups.view(-1, kernels.BLOCK)
    if not (block_groups == block_groups[:, :1]).all():
        return None
    g = block_groups[:, 0].long()  # [K / 32]
    blocks = k // kernels.BLOCK
    d = scales[g].T.contiguous()  # [N, K / 32] fp16
    z = zeros[g].T.to(torch.float16).contiguous()  # small integers: exact
    qt = q.T.reshape(n, blocks, kernels.BLOCK).to(torch.uint8)
    nibbles = qt[..., :16] | (qt[..., 16:] << 4)  # weights 0-15 low, 16-31 high
    raw = torch.empty(n, blocks, kernels.BLOCK_BYTES[kernels.Q4_Z], dtype=torch.uint8)
    raw[..., 0:2] = d.view(torch.uint8).view(n, blocks, 2)
    raw[..., 2:4] = z.view(torch.uint8).view(n, blocks, 2)
    raw[..., 4:] = nibbles
    return raw.view(n, -1)


def convert_layer(parts: dict[str, torch.Tensor], config: Int4Config, name: str) -> Any:
    """One quantized layer's tensors -> its weight [N, K]: Q4_Z blocks (a `GGUFWeight`), or
    the de-quantized fp32 values where the groups do not fall on blocks of 32."""
    awq = config.method == "awq"
    qweight, scales = parts["qweight"], parts["scales"].to(torch.float16)
    if awq:
        q = unpack_along_columns(qweight, awq=True)  # [K, N]
    else:
        q = unpack_along_rows(qweight)
    k, n = q.shape
    zeros = unpack_along_columns(parts["qzeros"], awq=awq)[:, :n]
    if config.zeros_minus_one:
        zeros = zeros + 1
    if scales.shape != (zeros.shape[0], n):
        raise ValueError(
            f"{name}.scales has shape {tuple(scales.shape)}, expected {(zeros.shape[0], n)} "
            f"from its qweight and qzeros"
        )
    group = k if config.group_size == -1 else config.group_size
    plain = torch.arange(k, dtype=torch.int32) // group
    groups = parts["g_idx"].to(torch.int32) if "g_idx" in parts else plain
    perm = None
    if not torch.equal(groups, plain):  # act-order: the features sorted by group
        perm = torch.argsort(groups, stable=True)
        q, groups = q[perm], groups[perm]
    raw = to_q4_z(q, zeros, scales, groups)
    if raw is not None:
        return GGUFWeight(raw.numpy(), kernels.Q4_Z, k, perm)
    logger.info("%s: groups not on blocks of 32 features, de-quantized at load", name)
    values = scales[groups.long()].float() * (q - zeros[groups.long()]).float()  # [K, N]
    ordered = torch.empty_like(values)
    ordered[perm if perm is not None else slice(None)] = values
    return ordered.T.contiguous()


def iter_int4_weights(
    weights: Iterator[tuple[str, Any]], folder: Path, method: str
) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors with each quantized layer's parts as one `<layer>.weight`."""
    config = Int4Config.from_model(folder, method)
    needed = {"qweight", "qzeros", "scales"} | ({"g_idx"} if method == "gptq" else set())
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part not in PARTS:
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor if isinstance(tensor, torch.Tensor) else tensor.load()
        if needed <= parts.keys():
            del pending[prefix]
            yield f"{prefix}.weight", convert_layer(parts, config, prefix)
    for prefix, parts in pending.items():
        missing = sorted(needed - parts.keys())
        raise ValueError(f"{method} checkpoint: {prefix} lacks {', '.join(missing)}")
