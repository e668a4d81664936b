"""int8 W8A8 on the default model against the same model unquantized, both in bf16 (the
dtype W8A8 serves in): the unquantized engine's greedy continuations scored by both
(teacher-forced, prompt log-probabilities), so that one early different token does not
decide the comparison."""

from __future__ import annotations

import pytest
from helpers import smollm2_prompts, teacher_forced_logprobs
from transformers import AutoTokenizer

from tokenmill import LLM, SamplingParams

# |log-probability difference| per scored token over 8 prompts x 32 tokens. SmolLM2-135M is
# sensitive to int8: its weights quantized per channel alone move its log-probabilities by
# 0.04 on average, and int8 activations per token bring that to 0.12 (95th percentile 0.45,
# measured on an AMX Xeon); the bounds leave room for other CPUs' bf16 arithmetic. A real
# error (a wrong scale, a lost zero point) moves them by whole nats.
MEAN_TOLERANCE = 0.2
P95_TOLERANCE = 0.75


@pytest.mark.slow
def test_int8_w8a8_log_probabilities_stay_near_bf16(smollm2_path: str) -> None:
    prompts = smollm2_prompts(AutoTokenizer.from_pretrained(smollm2_path))[:8]
    common = dict(max_model_len=1024, kv_cache_memory_bytes=128 << 20, dtype="bfloat16",
                  multiprocess=False)  # fmt: skip
    base = LLM(smollm2_path, **common)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        outs = base.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        sequences = [(p, list(o.outputs[0].token_ids)) for p, o in zip(prompts, outs)]
        reference = teacher_forced_logprobs(base, sequences)
    finally:
        base.shutdown()
    int8 = LLM(smollm2_path, quantization="int8", **common)
    try:
        assert int8.llm_engine.config.model_config.quantization == "int8"
        got = teacher_forced_logprobs(int8, sequences)
    finally:
        int8.shutdown()
    diff = (got - reference).abs()
    assert len(diff) == 8 * 32
    mean, p95 = float(diff.mean()), float(diff.quantile(0.95))
    print(f"int8 W8A8 against bf16: mean |d logprob| {mean:.4f}, 95th percentile {p95:.4f}")
    assert mean <= MEAN_TOLERANCE and p95 <= P95_TOLERANCE, (mean, p95)


def test_int8_on_triton_matmuls_matches_the_torch_reference(tiny_model, monkeypatch) -> None:
    """W8A8 through Triton's kernel (kernels/quantized.py), as on CUDA (here interpreted),
    against the same arithmetic in torch (no CPU kernels either way): the same greedy tokens
    and log-probabilities (int32 sums against fp32 ones of the same integers)."""
    pytest.importorskip("triton")
    from tokenmill.worker import model_loader

    monkeypatch.setenv("TOKENMILL_CPU_KERNELS", "0")
    monkeypatch.setenv("TOKENMILL_MULTIPROC", "0")
    path = str(tiny_model("llama-gqa"))
    prompts = [{"prompt_token_ids": [5, 9, 200, 31]}, {"prompt_token_ids": list(range(40, 70))}]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1)
    results = {}
    for triton in (False, True):
        monkeypatch.setattr(model_loader, "_triton_matmuls", lambda device, on=triton: on)
        llm = LLM(path, quantization="int8", dtype="float32", skip_tokenizer_init=True,
                  kv_cache_memory_bytes=16 << 20)  # fmt: skip
        try:
            results[triton] = llm.generate(prompts, params, use_tqdm=False)
            model = llm.llm_engine.client.engine_core.executor.worker.model_runner.model
            flags = {m.qweight.triton for m in model.modules() if getattr(m, "qweight", None)}
            assert flags == {triton}, flags
        finally:
            llm.shutdown()
    for a, b in zip(results[True], results[False]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for t, got, want in zip(a.outputs[0].token_ids, a.outputs[0].logprobs,
                                b.outputs[0].logprobs):  # fmt: skip
            assert abs(got[t].logprob - want[t].logprob) < 1e-4
