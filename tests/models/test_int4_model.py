"""AWQ and GPTQ int4 checkpoints: random int4 weights written here in AutoAWQ's and GPTQ's
layouts (packed by this file's own code), run by tokenmill on its CPU kernels (and without
them, de-quantized), against HF's fp32 model holding the de-quantized weights (computed here
by hand: scale * (q - zero) per group)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from test_hf_parity import MAX_TOKENS, compare_greedy
from transformers import LlamaConfig, LlamaForCausalLM

from tokenmill import LLM, SamplingParams
from tokenmill.worker.layers.quantization.int4 import unpack_along_columns, unpack_along_rows

# Log-probabilities of the tokens both chose (fp32): the kernels multiply the blocks' integers
# and scale each block's sum, HF the de-quantized values; fp32 sums of 256-512 terms in
# another order, through 2 layers, move them by ~1e-5.
LOGPROB_TOLERANCE = 1e-3
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def pack_words(values: np.ndarray) -> np.ndarray:
    """[..., 8] 4-bit values -> [...] int32, value j in bits 4j."""
    words = np.zeros(values.shape[:-1], dtype=np.uint32)
    for j in range(8):
        words |= (values[..., j].astype(np.uint32) & 0xF) << (4 * j)
    return words.view(np.int32)


def quantize_layer(
    weight: torch.Tensor, method: str, group: int, g_idx: torch.Tensor, generator: torch.Generator
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Random int4 values in the format's layout for a layer shaped as `weight` [N, K], each
    input feature in group g_idx[k], and their de-quantized fp32 weight [N, K]."""
    n, k = weight.shape
    groups = k // group
    q = torch.randint(0, 16, (k, n), generator=generator)
    zeros = torch.randint(1, 16, (groups, n), generator=generator)  # (GPTQ's stores zero - 1)
    zeros[0, :4] = torch.tensor([1, 15, 8, 8])
    scales = (torch.rand(groups, n, generator=generator) * 0.05 + 0.01).half()
    dense = (scales[g_idx.long()].float() * (q - zeros[g_idx.long()]).float()).T.contiguous()
    qn, zn = q.numpy(), zeros.numpy()
    if method == "gptq":
        tensors = {
            "qweight": pack_words(qn.reshape(k // 8, 8, n).transpose(0, 2, 1)),
            "qzeros": pack_words((zn - 1).reshape(groups, n // 8, 8)),
            "g_idx": g_idx.numpy().copy(),
        }
    else:
        order = list(AWQ_ORDER)
        tensors = {
            "qweight": pack_words(qn.reshape(k, n // 8, 8)[..., order]),
            "qzeros": pack_words(zn.reshape(groups, n // 8, 8)[..., order]),
        }
    out = {name: torch.from_numpy(np.ascontiguousarray(t)) for name, t in tensors.items()}
    out["scales"] = scales
    return out, dense


def write_checkpoint(folder: Path, method: str, group: int, act_order: bool) -> LlamaForCausalLM:
    """The int4 checkpoint in `folder`; returns HF's model holding its de-quantized weights."""
    config = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float().eval()
    generator = torch.Generator().manual_seed(group + 1000 * act_order + 7 * (method == "awq"))
    tensors = {}
    state = model.state_dict()
    quantized = {f"model.layers.{i}.{p}" for i in range(2) for p in PROJECTIONS}
    orders: dict[tuple[str, int], torch.Tensor] = {}

    def groups_of(prefix: str, k: int) -> torch.Tensor:
        """Each input feature's group; act-order (GPTQ's desc_act) leaves them out of order,
        in one order for the layers that read the same input (it follows that input's
        Hessian): q/k/v, gate/up."""
        if not act_order:
            return torch.arange(k, dtype=torch.int32) // group
        key = (prefix.rsplit(".", 1)[0] + (".o" if "o_proj" in prefix else ""), k)
        if key not in orders:
            g_idx = torch.empty(k, dtype=torch.int32)
            order = torch.randperm(k, generator=generator)
            g_idx[order] = torch.arange(k, dtype=torch.int32) // group
            orders[key] = g_idx
        return orders[key]

    for name, value in state.items():
        prefix = name.removesuffix(".weight")
        if prefix not in quantized:
            tensors[name] = value.contiguous()
            continue
        g_idx = groups_of(prefix, value.shape[1])
        parts, dense = quantize_layer(value, method, group, g_idx, generator)
        with torch.no_grad():
            value.copy_(dense)
        tensors.update({f"{prefix}.{part}": t for part, t in parts.items()})
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    config_dict = config.to_dict() | {"architectures": ["LlamaForCausalLM"]}
    if method == "gptq":
        config_dict["quantization_config"] = {"quant_method": "gptq", "bits": 4,
                                              "group_size": group, "desc_act": act_order,
                                              "sym": False}  # fmt: skip
    else:
        config_dict["quantization_config"] = {"quant_method": "awq", "bits": 4,
                                              "group_size": group, "zero_point": True,
                                              "version": "gemm"}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config_dict))
    return model


def assert_logprobs_match_hf(hf: LlamaForCausalLM, prompts: list[list[int]], outputs) -> None:
    """Each chosen token's log-probability within LOGPROB_TOLERANCE of HF's on the same
    tokens."""
    for prompt, out in zip(prompts, outputs):
        ids = out.outputs[0].token_ids
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
        want = torch.log_softmax(logits.float(), dim=-1)
        for i, t in enumerate(ids):
            got = out.outputs[0].logprobs[i][t].logprob
            assert math.isclose(got, float(want[i, t]), abs_tol=LOGPROB_TOLERANCE), (i, got)


def test_unpacking_undoes_the_formats_packing() -> None:
    values = np.random.default_rng(0).integers(0, 16, size=(16, 8, 24))
    rows = torch.from_numpy(pack_words(values.transpose(0, 2, 1)))  # along rows: [16, 24]
    assert torch.equal(unpack_along_rows(rows), torch.from_numpy(values.reshape(128, 24)).int())
    flat = values.reshape(16, 192)
    plain = torch.from_numpy(pack_words(flat.reshape(16, 24, 8)))
    assert torch.equal(unpack_along_columns(plain, awq=False), torch.from_numpy(flat).int())
    awq = torch.from_numpy(pack_words(flat.reshape(16, 24, 8)[..., list(AWQ_ORDER)]))
    assert torch.equal(unpack_along_columns(awq, awq=True), torch.from_numpy(flat).int())


# (method, group size, act-order, CPU kernels): every packing on the kernels; the torch path
# (the blocks de-quantized at load) on the act-order checkpoint.
CASES = [("awq", 128, False, "on"), ("awq", 64, False, "on"), ("gptq", 128, False, "on"),
         ("gptq", 32, True, "on"), ("gptq", 32, True, "off")]  # fmt: skip


CASE_IDS = [f"{m}-g{g}{'-act' if a else ''}-{k}" for m, g, a, k in CASES]


@pytest.mark.parametrize("method,group,act_order,kernels", CASES, ids=CASE_IDS)
def test_int4_checkpoint_matches_hf_on_its_dequantized_weights(
    tmp_path, monkeypatch, method: str, group: int, act_order: bool, kernels: str
) -> None:
    if kernels == "off":
        monkeypatch.setenv("TOKENMILL_CPU_KERNELS", "0")
    hf = write_checkpoint(tmp_path / "ckpt", method, group, act_order)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (1, 7, 40, 300)]
    llm = LLM(str(tmp_path / "ckpt"), dtype="float32", skip_tokenizer_init=True,
              kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=128)  # fmt: skip
    try:
        assert llm.llm_engine.config.model_config.quantization == method
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert compare_greedy(hf, prompts, tokens) == 0
    assert_logprobs_match_hf(hf, prompts, outputs)


def test_int4_checkpoint_on_triton_matmuls_matches_hf(tmp_path, monkeypatch) -> None:
    """The layers' blocks multiplied by Triton's kernel (kernels/quantized.py), as on CUDA;
    here in the interpreter (slow: short prompts, few tokens), on the act-order checkpoint."""
    pytest.importorskip("triton")
    from tokenmill.worker import model_loader

    monkeypatch.setattr(model_loader, "_triton_matmuls", lambda device: True)
    monkeypatch.setenv("TOKENMILL_CPU_KERNELS", "0")
    monkeypatch.setenv("TOKENMILL_MULTIPROC", "0")
    hf = write_checkpoint(tmp_path / "ckpt", "gptq", 32, True)
    prompts = [[5, 9, 200, 31], list(range(40, 76))]
    llm = LLM(str(tmp_path / "ckpt"), dtype="float32", skip_tokenizer_init=True,
              kv_cache_memory_bytes=16 << 20)  # fmt: skip
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        layer = llm.llm_engine.client.engine_core.executor.worker.model_runner.model
        kinds = {type(m.qweight).__name__ for m in layer.modules() if getattr(m, "qweight", None)}
        assert kinds == {"TritonGGUF"}, kinds
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outputs):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist()
    assert_logprobs_match_hf(hf, prompts, outputs)


def test_quantization_named_against_the_checkpoint(tmp_path) -> None:
    write_checkpoint(tmp_path / "ckpt", "awq", 128, False)
    with pytest.raises(ValueError, match=r"model config \(awq\) does not match.*\(gptq\)"):
        LLM(str(tmp_path / "ckpt"), quantization="gptq", skip_tokenizer_init=True)
