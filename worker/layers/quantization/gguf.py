"""GGUF checkpoints, loaded as the file holds them (quantization="gguf").

`iter_gguf_weights` reads a GGUF file's tensors under the model's checkpoint names (gguf-py's
tensor name map, as vLLM uses it): plain tensors (norms, biases) as torch tensors, block-
quantized ones as a `GGUFWeight`, which the layers' weight loaders keep as their rows of
blocks instead of copying values (`record`). `finalize` then gives each layer its run-time
form: a matmul weight of a type the CPU kernels take (Q4_0, Q4_1, Q8_0; Q5_0, Q4_K, Q5_K and
Q6_K rewritten exactly as Q8_0, Q4_F, Q8_F and Q8_S blocks) re-laid out for `gguf_linear`
(on CUDA, kept as rows of blocks for Triton's `gguf_matmul`); an embedding its rows of
blocks, de-quantized per looked-up token (tied to the LM head: in its blocks); anything else
(another type, a layer whose shards mix types the kernels cannot share, no kernels)
de-quantized into the layer's weight, with one log line naming what.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from tokenmill.kernels.cpu import gguf as kernels

logger = logging.getLogger(__name__)

GGUF_FILE = "model.gguf"  # the file a GGUF model's folder links to (protocol/gguf_model.py)


class GGUFWeight:
    """A block-quantized tensor [N, K] of a GGUF file as rows of blocks [N, K / 32 * block
    bytes], read from the file only as far as a loader narrows it. The int4 checkpoints
    (int4.py) arrive as this too, in the Q4_Z blocks; `perm`, where set, is the input feature
    each column holds (GPTQ's act-order sorts the columns by group)."""

    quantized = True

    def __init__(
        self, rows: np.ndarray, qtype: int, k: int, perm: torch.Tensor | None = None
    ) -> None:
        self.rows, self.qtype, self.k, self.perm = rows, qtype, k, perm
        self.shape = torch.Size((rows.shape[0], k))

    @property
    def type_name(self) -> str:
        if self.qtype in kernels.NAMES:
            return kernels.NAMES[self.qtype]
        import gguf

        return gguf.GGMLQuantizationType(self.qtype).name

    def narrow(self, dim: int, start: int, length: int) -> GGUFWeight | torch.Tensor:
        if dim == 0:
            return GGUFWeight(self.rows[start : start + length], self.qtype, self.k, self.perm)
        if self.perm is not None:
            # The columns are in group order, so x's slice of features is no slice of them:
            # that shard is de-quantized.
            return self.load().narrow(1, start, length).contiguous()
        if self.qtype in kernels.BLOCK_BYTES:
            block, block_bytes = kernels.BLOCK, kernels.BLOCK_BYTES[self.qtype]
        else:
            import gguf

            block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(self.qtype)]
        if start % block or length % block:
            raise ValueError(
                f"a {self.type_name} tensor splits along its input features only at whole "
                f"blocks of {block}: [{start}, {start + length}) of {self.k}"
            )
        b0, b1 = start // block * block_bytes, (start + length) // block * block_bytes
        return GGUFWeight(self.rows[:, b0:b1], self.qtype, length)

    def raw(self) -> torch.Tensor:
        """The rows of blocks, uint8 [N, K / 32 * block bytes]."""
        return torch.from_numpy(np.array(self.rows))  # a copy: the file is mapped read-only

    def load(self) -> torch.Tensor:
        """The de-quantized fp32 values [N, K], columns in x's order."""
        values = dequantize(self.raw(), self.qtype)
        if self.perm is None:
            return values
        ordered = torch.empty_like(values)
        ordered[:, self.perm] = values
        return ordered


def dequantize(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """fp32 values of rows of blocks: the kernels' reference for their formats, gguf-py's
    de-quantization for the others."""
    if qtype in kernels.BLOCK_BYTES:
        return kernels.dequantize(raw, qtype)
    import gguf

    values = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def _reverse_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves the rotary halves of each head of q and k for its
    rope; the checkpoint's (HF) order is the halves one after the other."""
    dim = rows.shape[0] // heads // 2
    return rows.reshape(heads, dim, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _checkpoint_name(
    gguf_name: str, candidates: dict[str, list[str]], accepts
) -> str | None:
    base, _, suffix = gguf_name.rpartition(".")
    for name in candidates.get(base, []):
        if accepts(f"{name}.{suffix}"):
            return f"{name}.{suffix}"
    return None


# Beside a GGUF model's `model.gguf` link (protocol/default_model.py: gguf_model_path): the
# file's scalar metadata and tensor table as gguf-py reads them, written once. gguf-py's
# reader parses every metadata field, a tokenizer's ~100k strings too: 2-3 s of each load on
# 2 cores, where the table takes milliseconds.
TENSOR_TABLE = "gguf_tensors.json"


@dataclass
class GGUFTensor:
    """A tensor of the file as gguf-py's ReaderTensor gives it: its type, its dimensions
    innermost first, and its bytes viewed as gguf-py views them."""

    name: str
    tensor_type: int
    shape: tuple[int, ...]
    data: np.ndarray


def _scalar_fields(reader) -> dict[str, object]:
    """A gguf-py reader's metadata fields but its arrays (the tokenizer's)."""
    import gguf

    return {
        key: field.contents()
        for key, field in reader.fields.items()
        if field.types and field.types[0] != gguf.GGUFValueType.ARRAY
    }


def write_tensor_table(file: Path, folder: Path) -> None:
    """The table of `file` (read by gguf-py) into `folder`."""
    import gguf

    reader = gguf.GGUFReader(str(file))
    fields = _scalar_fields(reader)
    tensors = [
        {"name": t.name, "type": int(t.tensor_type), "shape": [int(d) for d in t.shape],
         "offset": int(t.data_offset), "dtype": t.data.dtype.str,
         "data_shape": [int(d) for d in t.data.shape]}
        for t in reader.tensors
    ]  # fmt: skip
    (folder / TENSOR_TABLE).write_text(json.dumps({"fields": fields, "tensors": tensors}))


def read_gguf(path: Path) -> tuple[dict[str, object], list[GGUFTensor]]:
    """The file's scalar metadata and its tensors: from the table beside it where there is
    one, else read by gguf-py."""
    table = path.parent / TENSOR_TABLE
    if table.is_file():
        header = json.loads(table.read_text())
        raw = np.memmap(path, dtype=np.uint8, mode="r")
        tensors = []
        for t in header["tensors"]:
            dtype = np.dtype(t["dtype"])
            size = int(np.prod(t["data_shape"])) * dtype.itemsize
            data = raw[t["offset"] : t["offset"] + size].view(dtype).reshape(t["data_shape"])
            tensors.append(GGUFTensor(t["name"], t["type"], tuple(t["shape"]), data))
        return header["fields"], tensors
    import gguf

    reader = gguf.GGUFReader(str(path))
    fields = _scalar_fields(reader)
    tensors = [GGUFTensor(t.name, int(t.tensor_type), tuple(int(d) for d in t.shape), t.data)
               for t in reader.tensors]  # fmt: skip
    return fields, tensors


def iter_gguf_weights(path: Path, model: nn.Module) -> Iterator[tuple[str, object]]:
    """The file's tensors under the checkpoint names `model` loads (its parameters' names,
    q/k/v and gate/up before fusing)."""
    import gguf

    fields, tensors = read_gguf(path)
    arch = str(fields["general.architecture"])
    try:
        model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    except StopIteration:
        raise ValueError(f"GGUF architecture {arch!r} is unknown to gguf-py") from None
    blocks = int(fields[f"{arch}.block_count"])
    heads = int(fields[f"{arch}.attention.head_count"])
    kv_heads = int(fields.get(f"{arch}.attention.head_count_kv", heads))
    name_map = gguf.get_tensor_name_map(model_arch, blocks)
    candidates: dict[str, list[str]] = {}
    for theirs, (_, ours) in name_map.mapping.items():
        candidates.setdefault(ours, []).append(theirs)
    params = {name for name, _ in model.named_parameters()}
    mapping = getattr(model, "packed_modules_mapping", {})

    def accepts(name: str) -> bool:
        for part, (fused, _) in mapping.items():
            name = name.replace(f".{part}.", f".{fused}.")
        return name in params or name == "lm_head.weight"

    # A mixture-of-experts layer's projection comes as one [experts, N, K] tensor (gguf-py
    # names it by the experts' merged name, "...experts.gate_proj"); the model loads it per
    # expert ("...experts.{e}.gate_proj.weight") into its stacked parameters.
    projections = getattr(model, "expert_projections", {})
    renames = getattr(model, "checkpoint_renames", {})

    def stacks_experts(merged: str) -> bool:
        prefix, found, projection = merged.rpartition(".experts.")
        if not found or projection not in projections:
            return False
        target = f"{prefix}.experts."
        for theirs, ours in renames.items():
            target = target.replace(theirs, ours)
        stack = "w2_weight" if projections[projection] == "down" else "w13_weight"
        return target + stack in params

    # llama.cpp's converter stores Gemma's (and Nemotron's) norms as 1 + w; the checkpoint
    # (and these models) hold w.
    plus_one_norms = arch in ("gemma", "gemma2", "gemma3", "nemotron")
    for tensor in tensors:
        if len(tensor.shape) == 3:
            yield from _per_expert(tensor, candidates, stacks_experts)
            continue
        name = _checkpoint_name(tensor.name, candidates, accepts)
        if name is None:
            raise ValueError(f"GGUF tensor {tensor.name!r} matches no parameter of the model")
        qtype = int(tensor.tensor_type)
        data = tensor.data
        if arch == "llama" and tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
            data = _reverse_permute(data, heads if "attn_q" in tensor.name else kv_heads)
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                     gguf.GGMLQuantizationType.BF16):  # fmt: skip
            if qtype == gguf.GGMLQuantizationType.BF16:
                data = np.ascontiguousarray(data).view(np.uint16)
                yield name, torch.from_numpy(data.astype(np.int32) << 16).view(torch.float32)
            else:
                values = torch.from_numpy(np.array(data, dtype=np.float32))
                if plus_one_norms and tensor.name.endswith("norm.weight"):
                    values = values - 1
                yield name, values
            continue
        logical = [int(d) for d in reversed(tensor.shape)]  # GGUF lists dimensions innermost first
        if len(logical) != 2:
            raise ValueError(f"GGUF tensor {tensor.name!r} of shape {logical} is not a matrix")
        yield name, GGUFWeight(data, qtype, logical[1])


def _per_expert(tensor, candidates: dict[str, list[str]], stacks_experts
                ) -> Iterator[tuple[str, object]]:  # fmt: skip
    """A GGUF experts tensor [experts, N, K] as each expert's [N, K] under the checkpoint's
    per-expert name."""
    import gguf

    base, _, suffix = tensor.name.rpartition(".")
    merged = next((n for n in candidates.get(base, []) if stacks_experts(n)), None)
    if merged is None:
        raise ValueError(f"GGUF tensor {tensor.name!r} matches no experts of the model")
    prefix, _, projection = merged.rpartition(".experts.")
    experts, _, k = (int(d) for d in reversed(tensor.shape))
    qtype = int(tensor.tensor_type)
    for e in range(experts):
        name = f"{prefix}.experts.{e}.{projection}.{suffix}"
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            yield name, torch.from_numpy(np.array(tensor.data[e], dtype=np.float32))
        else:
            yield name, GGUFWeight(tensor.data[e], qtype, k)


def record(param: torch.Tensor, loaded: GGUFWeight, offset: int = 0) -> None:
    """A loader's shard of a quantized tensor: rows [offset, offset + rows) of `param`."""
    shards = getattr(param, "gguf_shards", None)
    if shards is None:
        shards = param.gguf_shards = []  # type: ignore[attr-defined]
    shards.append((offset, loaded))


# GGUF types the kernels take rewritten, exactly, as one of theirs.
REWRITES = {
    kernels.Q5_0: (kernels.Q8_0, kernels.q5_0_as_q8_0),
    kernels.Q4_K: (kernels.Q4_F, kernels.q4_k_as_q4_f),
    kernels.Q5_K: (kernels.Q8_F, kernels.q5_k_as_q8_f),
    kernels.Q6_K: (kernels.Q8_S, kernels.q6_k_as_q8_s),
}


def _whole(
    recorded: list[tuple[int, GGUFWeight]], shape: tuple[int, int], rewrite: bool
) -> tuple[torch.Tensor, int, torch.Tensor | None] | None:
    """The recorded shards as one tensor of rows of blocks, its type and column order, where
    they are of one type and order and cover a weight of `shape`'s rows and columns;
    `rewrite`: shards of the REWRITES types as the blocks they equal."""
    shards = sorted(recorded, key=lambda s: s[0])

    def target(shard: GGUFWeight) -> int:
        return REWRITES[shard.qtype][0] if rewrite and shard.qtype in REWRITES else shard.qtype

    types = {target(s) for _, s in shards}
    perm = shards[0][1].perm
    if any(not _same_order(s.perm, perm) for _, s in shards):
        return None
    rows, expected = 0, 0
    for offset, shard in shards:
        if offset != expected or shard.k != shape[1]:
            return None
        expected += shard.shape[0]
        rows = expected
    if len(types) != 1 or rows != shape[0]:
        return None
    raws = [
        REWRITES[s.qtype][1](s.raw()) if target(s) != s.qtype else s.raw() for _, s in shards
    ]
    return torch.cat(raws), types.pop(), perm


def _same_order(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def finalize(model: nn.Module, kernels_in_use: bool, triton: bool = False) -> None:
    """Each quantized layer in its run-time form (see the module's doc)."""
    from tokenmill.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from tokenmill.worker.layers.linear import LinearBase

    users: dict[int, list[nn.Module]] = {}
    params: dict[int, nn.Parameter] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, (LinearBase, VocabParallelEmbedding)) and getattr(
            weight, "gguf_shards", None
        ):
            users.setdefault(id(weight), []).append(module)
            params[id(weight)] = weight
    def is_matmul(module: nn.Module) -> bool:  # (else an embedding)
        return isinstance(module, (LinearBase, ParallelLMHead))

    native, dense = Counter(), Counter()
    for key, modules in users.items():
        param = params[key]
        # (Q5_0, most of Gemma 3's Q4_K_M file, runs exactly as Q8_0 blocks, Q4_K as Q4_F,
        # its Q6_K as Q8_S)
        shape = (param.shape[0], param.shape[1])
        recorded = param.gguf_shards  # type: ignore[attr-defined]
        whole = _whole(recorded, shape, rewrite=kernels_in_use or triton)
        raw, qtype, perm = whole if whole is not None else (None, None, None)
        label = None
        if qtype in kernels.NAMES and shards_types(recorded) != kernels.NAMES[qtype]:
            label = f"{shards_types(recorded)} as {kernels.NAMES[qtype]}"
        needs_dense = False
        packed = None
        # Matmuls first: a tied embedding then looks its rows up in its LM head's blocks
        # rather than keep a second copy.
        for module in sorted(modules, key=lambda m: not is_matmul(m)):
            if raw is None:
                needs_dense = True
            elif is_matmul(module) and kernels_in_use and kernels.supported(qtype, shape):
                packed = packed or kernels.repack(raw, qtype, perm)
                module.qweight = packed
            elif is_matmul(module) and triton and qtype in kernels.BLOCK_BYTES:
                # (CUDA: the rows of blocks on the device, for kernels/quantized.py)
                from tokenmill.kernels.quantized import TritonGGUF

                device = param.device
                module.qweight = TritonGGUF(raw.to(device), qtype,
                                            None if perm is None else perm.to(device))  # fmt: skip
            elif is_matmul(module):
                needs_dense = True
            elif kernels_in_use and perm is None:  # an embedding looks its rows up in blocks
                if packed is not None:
                    module.gguf_packed = packed
                else:
                    module.gguf_rows, module.gguf_type = raw, qtype
            else:  # (on CUDA the table is the device's dense weight)
                needs_dense = True
        name = label or (kernels.NAMES.get(qtype) if qtype is not None else None)
        if needs_dense:
            param.data.zero_()  # (a TP rank's padding rows past the vocabulary)
            for offset, shard in recorded:
                param.data[offset : offset + shard.shape[0]].copy_(shard.load())
            dense[name or shards_types(recorded)] += 1
        else:
            native[name] += 1
            param.data = torch.empty(0, dtype=param.dtype)  # the values live in the blocks
        del param.gguf_shards  # type: ignore[attr-defined]
    _finalize_experts(model, kernels_in_use, native, dense)
    if native:
        logger.info("Quantized weights kept in their formats: %s", dict(native))
    if dense:
        logger.info("Quantized weights de-quantized to %s (no kernel for their type or "
                    "layout here): %s", next(model.parameters()).dtype, dict(dense))  # fmt: skip


def shards_types(shards: list[tuple[int, GGUFWeight]]) -> str:
    return "+".join(sorted({s.type_name for _, s in shards}))


def record_expert(param: torch.Tensor, expert: int, loaded: GGUFWeight, offset: int) -> None:
    """A mixture-of-experts layer's shard of one expert's quantized projection (its rows
    [offset, offset + rows) of param[expert])."""
    experts = getattr(param, "gguf_experts", None)
    if experts is None:
        experts = param.gguf_experts = {}  # type: ignore[attr-defined]
    experts.setdefault(expert, []).append((offset, loaded))


def _finalize_experts(model: nn.Module, kernels_in_use: bool, native: Counter,
                      dense: Counter) -> None:  # fmt: skip
    """Each mixture-of-experts layer's stacked projections: on the CPU kernels one packed
    weight per expert and projection (`FusedMoE.gguf_experts`), where every expert's shards
    make whole weights of a type the kernels take; otherwise de-quantized into the stacks
    (CUDA too: the Triton MoE kernels read dense experts)."""
    from tokenmill.worker.layers.fused_moe import FusedMoE

    for module in model.modules():
        stacks = [module.w13_weight, module.w2_weight] if isinstance(module, FusedMoE) else []
        if not any(hasattr(param, "gguf_experts") for param in stacks):
            continue
        wholes, names = [], []
        for param in stacks:
            experts = getattr(param, "gguf_experts", {})
            if sorted(experts) != list(range(param.shape[0])):
                raise ValueError(f"a quantized expert stack of {param.shape[0]} experts got "
                                 f"experts {sorted(experts)}")  # fmt: skip
            shape = (param.shape[1], param.shape[2])
            wholes.append([_whole(experts[e], shape, kernels_in_use) for e in sorted(experts)])
            names.append(shards_types([s for shards in experts.values() for s in shards]))
        packable = kernels_in_use and all(
            w is not None and kernels.supported(w[1], (p.shape[1], p.shape[2]))
            for param_wholes, p in zip(wholes, stacks) for w in param_wholes
        )
        for param, param_wholes, name in zip(stacks, wholes, names):
            if packable:
                qtypes = {kernels.NAMES[w[1]] for w in param_wholes}
                label = "+".join(sorted(qtypes))
                native[label if name == label else f"{name} as {label}"] += param.shape[0]
            else:
                for e, shards in param.gguf_experts.items():  # type: ignore[attr-defined]
                    for offset, shard in shards:
                        param.data[e, offset : offset + shard.shape[0]].copy_(shard.load())
                dense[name] += param.shape[0]
        if packable:
            module.gguf_experts = tuple(
                [kernels.repack(raw, qtype) for raw, qtype, _ in param_wholes]
                for param_wholes in wholes
            )
            for param in stacks:
                param.data = torch.empty(0, dtype=param.dtype)  # the values live in the blocks
        for param in stacks:
            del param.gguf_experts  # type: ignore[attr-defined]
