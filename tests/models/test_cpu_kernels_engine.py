"""The engine on tokenmill's own CPU kernels (their matmuls, layers and CPU_ATTN attention)
against the same engine on the torch path (TOKENMILL_CPU_KERNELS=0: oneDNN and TORCH_SDPA,
also what a machine without a compiler runs): the same greedy tokens on SmolLM2 in fp32, where
the kernels sum in another order; and the same with the kernels' AVX2 builds
(TOKENMILL_CPU_ISA=avx2), as a CPU without AVX-512 runs them. Decode steps as one call
(worker/models/cpu_decode.py) against the same steps layer by layer, with and without LoRA
adapters."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import assert_same_greedy_tokens, smollm2_prompts, write_lora_adapter

from tokenmill import LLM, SamplingParams
from tokenmill.kernels import cpu
from tokenmill.protocol import envs

pytestmark = pytest.mark.slow


def _run(path: str) -> tuple[list, list[int]]:
    llm = LLM(path, dtype="float32", multiprocess=False, max_model_len=512,
              kv_cache_memory_bytes=64 << 20)  # fmt: skip
    try:
        runner = llm.llm_engine.client.engine_core.executor.worker.model_runner
        layouts = [p.dim() for name, p in runner.model.named_parameters() if "proj" in name]
        layouts.append(type(runner.attn_backend).__name__)
        prompts = smollm2_prompts(llm.get_tokenizer())
        params = SamplingParams(temperature=0, max_tokens=24, logprobs=2, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return outs, layouts
    finally:
        llm.shutdown()


def test_kernels_and_the_torch_path_give_the_same_greedy_tokens(smollm2_path, monkeypatch):
    if not cpu.load(envs.TOKENMILL_CACHE):
        pytest.skip("the CPU kernels cannot be built here")
    kernels, (*packed, backend) = _run(smollm2_path)
    assert packed and all(d > 2 for d in packed)  # every projection on the kernels' layout
    assert backend == "CpuAttentionBackend"  # CPU_ATTN, the default where the kernels built
    monkeypatch.setenv("TOKENMILL_CPU_KERNELS", "0")
    torch_path, (*plain, backend) = _run(smollm2_path)
    assert all(d == 2 for d in plain)  # oneDNN's packed weights keep their logical shape
    assert backend == "TorchAttentionBackend"
    assert_same_greedy_tokens(kernels, torch_path)
    # The kernels' AVX2 builds, as a CPU without AVX-512 runs them.
    monkeypatch.setenv("TOKENMILL_CPU_KERNELS", "1")
    monkeypatch.setenv("TOKENMILL_CPU_ISA", "avx2")
    try:
        avx2, _ = _run(smollm2_path)  # in this process: the cap applies here
        assert cpu.cpu_isa() <= 0
    finally:
        cpu.limit_isa(3)
    assert_same_greedy_tokens(avx2, torch_path)


@pytest.mark.parametrize(
    "model, dtype",
    [("smollm2", "bfloat16"), ("smollm2", "float32"), ("qwen2", "bfloat16"),
     ("mistral-window", "bfloat16"), ("smollm2-q4_1", "bfloat16"), ("smollm2-int8", "bfloat16")],
)  # fmt: skip
def test_decode_steps_as_one_call_give_the_layer_by_layer_results_bit_for_bit(
    smollm2_path, tiny_model, monkeypatch, model, dtype
):
    """A decode step's layers as one call of the kernels (worker/models/cpu_decode.py) run the
    same kernels in the same order: the same tokens and log-probabilities, exactly. SmolLM2 in
    both dtypes, Qwen2's q/k/v biases, Mistral's sliding window (random small models), and
    SmolLM2 from its Q4_1 GGUF file (three requests: the few-row GGUF kernel), and SmolLM2
    with int8 W8A8."""
    if not cpu.load(envs.TOKENMILL_CACHE):
        pytest.skip("the CPU kernels cannot be built here")
    if model == "smollm2-q4_1":
        from tokenmill.protocol.default_model import default_gguf_file

        path = str(default_gguf_file())
    else:
        path = smollm2_path if model.startswith("smollm2") else str(tiny_model(model))
    text = model.startswith("smollm2")
    quantization = "int8" if model == "smollm2-int8" else None

    def run() -> tuple[list, bool]:
        llm = LLM(path, dtype=dtype, multiprocess=False, max_model_len=512,
                  kv_cache_memory_bytes=64 << 20, quantization=quantization,
                  skip_tokenizer_init=not text)  # fmt: skip
        try:
            if text:
                prompts = smollm2_prompts(llm.get_tokenizer())
                prompts = prompts[:3] if model == "smollm2-q4_1" else prompts
            else:  # token ids: long enough to pass Mistral's window while decoding
                prompts = [[(7 * i + 3 * j) % 500 + 3 for j in range(20 + 9 * i)] for i in range(4)]
            params = SamplingParams(temperature=0, max_tokens=16, logprobs=3, ignore_eos=True)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)  # fmt: skip
            runner = llm.llm_engine.client.engine_core.executor.worker.model_runner
            planned = runner.model.model.decode_loop._plan is not None
            return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], planned
        finally:
            llm.shutdown()

    looped, planned = run()
    assert planned  # these models' layers run as one call
    monkeypatch.setenv("TOKENMILL_CPU_DECODE_LOOP", "0")
    layered, planned = run()
    assert not planned
    assert len(looped) == len(layered) > 1
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(looped, layered):
        assert tokens == want_tokens
        for got, want in zip(logprobs, want_logprobs):
            assert {t: lp.logprob for t, lp in got.items()} == {
                t: lp.logprob for t, lp in want.items()
            }


def test_decode_steps_with_lora_as_one_call_give_the_layer_by_layer_results(
    smollm2_path, tmp_path, monkeypatch
):
    """With adapters on (ranks 8 and 16 in slots of 16, beside requests of the base model) the
    decode steps still run as one call, and give the layer-by-layer tokens and
    log-probabilities exactly (SmolLM2, bf16)."""
    import json

    from tokenmill import LoRARequest

    if not cpu.load(envs.TOKENMILL_CACHE):
        pytest.skip("the CPU kernels cannot be built here")
    config = json.loads((Path(smollm2_path) / "config.json").read_text())
    adapters = [
        LoRARequest("r8", 1, write_lora_adapter(tmp_path / "r8", config, rank=8, seed=1)),
        LoRARequest("r16", 2, write_lora_adapter(tmp_path / "r16", config, rank=16, seed=2)),
    ]

    def run() -> tuple[list, bool]:
        llm = LLM(smollm2_path, dtype="bfloat16", multiprocess=False, max_model_len=512,
                  kv_cache_memory_bytes=64 << 20, enable_lora=True, max_loras=2,
                  max_lora_rank=16)  # fmt: skip
        try:
            prompts = smollm2_prompts(llm.get_tokenizer())[:6]
            params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
            loras = [[None, *adapters][i % 3] for i in range(len(prompts))]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False, lora_request=loras)  # fmt: skip
            runner = llm.llm_engine.client.engine_core.executor.worker.model_runner
            plan = runner.model.model.decode_loop._plan
            results = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
            return results, plan is not None and plan.lora_scales is not None
        finally:
            llm.shutdown()

    looped, planned = run()
    assert planned  # the adapters run inside the one call
    monkeypatch.setenv("TOKENMILL_CPU_DECODE_LOOP", "0")
    layered, planned = run()
    assert not planned
    assert looped[0][0] != looped[1][0] != looped[2][0]  # the adapters change the tokens
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(looped, layered):
        assert tokens == want_tokens
        for got, want in zip(logprobs, want_logprobs):
            assert {t: lp.logprob for t, lp in got.items()} == {
                t: lp.logprob for t, lp in want.items()
            }
