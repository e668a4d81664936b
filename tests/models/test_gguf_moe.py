"""A mixture-of-experts GGUF model (llama.cpp's [experts, N, K] `ffn_*_exps` tensors) run as
the file holds it: a small random Qwen3-MoE (every layer sparse, as llama.cpp's qwen3moe has
it) and Mixtral (llama.cpp's "llama" architecture, q/k rows interleaved for its rope) written
by the test as llama.cpp's converter lays them out (gguf-py's names and quantizers), against
the same model with gguf-py's de-quantized values in safetensors (fp32, the torch experts);
also at TP=2, each rank holding its share of every expert's blocks."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from helpers import assert_same_greedy_tokens, teacher_forced_logprobs
from safetensors import safe_open
from safetensors.torch import save_file

from tokenmill import LLM, SamplingParams
from tokenmill.kernels import cpu
from tokenmill.protocol import envs
from tokenmill.worker.layers.fused_moe import FusedMoE

Q = gguf.GGMLQuantizationType
# A checkpoint's per-expert tensor: layer, the experts' container, expert, projection.
EXPERT = re.compile(r"model\.layers\.(\d+)\.(\w+)\.experts\.(\d+)\.(\w+)\.weight")


def make_qwen3_moe(folder: Path) -> Path:
    """A random Qwen3-MoE checkpoint (fp32 safetensors): 2 layers of 8 experts, 2 per token
    (intermediate size 64: at TP=2 each rank's down projection is one block of 32 wide)."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=64, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], tie_word_embeddings=False, max_position_embeddings=1024,
        initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).float().eval().save_pretrained(str(folder))
    return folder


def llama_cpp_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """q/k rows as llama.cpp's converter writes them for a "llama" file: each head's two
    rotary halves interleaved."""
    return rows.reshape(heads, 2, -1, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def write_gguf_model(source: Path, folder: Path, arch: str, types: dict[str, Q]) -> Path:
    """`source`'s tensors as a GGUF file of architecture `arch` (matmuls in `types`' formats
    by the name's part, each layer's experts stacked into one tensor per projection, norms
    and the router in fp32) in `folder` beside its config.json; a second folder
    `folder`-reference holds the de-quantized values as safetensors."""
    config = json.loads((source / "config.json").read_text())
    layers = config["num_hidden_layers"]
    model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    name_map = gguf.get_tensor_name_map(model_arch, layers)
    with safe_open(str(source / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k).float().numpy() for k in f.keys()}
    per_expert: dict[str, dict[int, np.ndarray]] = {}
    for name in [n for n in tensors if EXPERT.fullmatch(n)]:
        layer, container, expert, projection = EXPERT.fullmatch(name).groups()
        merged = f"model.layers.{layer}.{container}.experts.{projection}"
        per_expert.setdefault(merged, {})[int(expert)] = tensors.pop(name)
    stacked = {k: np.stack([v[e] for e in sorted(v)]) for k, v in per_expert.items()}
    writer = gguf.GGUFWriter(str(folder / "model.gguf"), arch)
    writer.add_block_count(layers)
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    reference: dict[str, torch.Tensor] = {}
    for name, values in [*tensors.items(), *stacked.items()]:
        base = name.removesuffix(".weight")
        gguf_name = name_map.get_name(base) + ".weight"
        kind = next((t for part, t in types.items() if part in name), None)
        permuted = arch == "llama" and base.rpartition(".")[2] in heads
        if permuted:
            values = llama_cpp_permute(values, heads[base.rpartition(".")[2]])
        if values.ndim == 1 or kind is None or name.endswith(".gate.weight"):
            writer.add_tensor(gguf_name, values.astype(np.float32))
            dequantized = values
        else:
            blocks = gguf.quants.quantize(values, kind)
            writer.add_tensor(gguf_name, blocks, raw_dtype=kind)
            dequantized = gguf.quants.dequantize(blocks, kind)
        if permuted:  # (rows quantize independently: un-permuting commutes with it)
            heads_of = heads[base.rpartition(".")[2]]
            dequantized = dequantized.reshape(heads_of, -1, 2, dequantized.shape[1])
            dequantized = dequantized.swapaxes(1, 2).reshape(values.shape)
        if values.ndim == 3:  # back to the checkpoint's per-expert tensors
            prefix, _, projection = base.rpartition(".experts.")
            for e in range(values.shape[0]):
                reference[f"{prefix}.experts.{e}.{projection}.weight"] = torch.from_numpy(
                    np.ascontiguousarray(dequantized[e], dtype=np.float32)
                )
        else:
            reference[name] = torch.from_numpy(np.ascontiguousarray(dequantized, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    shutil.copy(source / "config.json", folder / "config.json")
    ref = folder.with_name(folder.name + "-reference")
    ref.mkdir()
    shutil.copy(source / "config.json", ref / "config.json")
    save_file(reference, str(ref / "model.safetensors"))
    return ref


# Matmul formats by the checkpoint name's part; the embedding and LM head in Q8_0.
NATIVE = {"gate_proj": Q.Q4_1, "up_proj": Q.Q4_1, "down_proj": Q.Q8_0, "self_attn": Q.Q4_0,
          "embed_tokens": Q.Q8_0, "lm_head": Q.Q8_0}  # fmt: skip
# gate and up in two formats: one expert's [gate; up] cannot be one weight of the kernels.
MIXED = {**NATIVE, "gate_proj": Q.Q4_0}
# Mixtral's experts: w1 (gate), w3 (up), w2 (down).
MIXTRAL = {"experts.w1": Q.Q4_1, "experts.w3": Q.Q4_1, "experts.w2": Q.Q8_0, "self_attn": Q.Q4_0,
           "embed_tokens": Q.Q8_0, "lm_head": Q.Q8_0}  # fmt: skip


@pytest.mark.parametrize(
    "model, types, native, tp",
    [("qwen3moe", NATIVE, True, 1), ("qwen3moe", MIXED, False, 1), ("qwen3moe", NATIVE, True, 2),
     ("mixtral", MIXTRAL, True, 1)],
    ids=["native", "mixed", "native-tp2", "mixtral"],
)  # fmt: skip
def test_gguf_experts_equal_the_dequantized_model(tiny_model, tmp_path, monkeypatch, model,
                                                  types, native, tp) -> None:  # fmt: skip
    monkeypatch.setenv("TOKENMILL_MULTIPROC", "0")
    folder = tmp_path / f"{model}-gguf"
    folder.mkdir()
    if model == "mixtral":
        reference = write_gguf_model(tiny_model("mixtral"), folder, "llama", types)
    else:
        reference = write_gguf_model(make_qwen3_moe(tmp_path / model), folder, model, types)
    prompts = [[5, 9, 200, 31], list(range(40, 110)), [7] * 3]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
    kwargs = dict(dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=16 << 20)
    outputs = {}
    for key, path in (("gguf", folder), ("reference", reference)):
        llm = LLM(str(path), tensor_parallel_size=tp if key == "gguf" else 1, **kwargs)
        try:
            if key == "gguf" and tp == 1:
                assert llm.llm_engine.config.model_config.quantization == "gguf"
                model = llm.llm_engine.client.engine_core.executor.worker.model_runner.model
                moe = [m for m in model.modules() if isinstance(m, FusedMoE)]
                # (without the CPU kernels every GGUF weight is de-quantized at load)
                packed = native and envs.TOKENMILL_CPU_KERNELS and cpu.load(envs.TOKENMILL_CACHE)
                assert moe and all((m.gguf_experts is not None) == packed for m in moe)
            requests = [{"prompt_token_ids": p} for p in prompts]
            outputs[key] = llm.generate(requests, params, use_tqdm=False)
            # Scored on the same tokens (the GGUF engine's), however the two would part.
            sequences = [(p, list(o.outputs[0].token_ids)) for p, o in zip(prompts, outputs[key])]
            if key == "gguf":
                scored_on = sequences
            outputs[key + "-scores"] = teacher_forced_logprobs(llm, scored_on)
        finally:
            llm.shutdown()
    assert_same_greedy_tokens(outputs["gguf"], outputs["reference"])
    # The same weights, multiplied in another order (the kernels sum x * q per block, then
    # scale): fp32 accumulation differences only.
    diff = (outputs["gguf-scores"] - outputs["reference-scores"]).abs()
    assert float(diff.max()) < 1e-3, float(diff.max())
