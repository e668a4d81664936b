"""kv_cache_dtype="fp8": the KV cache in fp8 e4m3 on the CPU kernels (CPU_ATTN) and the torch
path (TORCH_SDPA), against the cache in the model's dtype: the default model's greedy
continuations, teacher-forced (prompt log-probabilities), so that one early different token
does not decide the comparison. (The kernels against the torch reference on the same fp8
values: tests/unit/test_cpu_kernels.py. End to end the two backends cannot be compared more
tightly than against fp32: sums in another order move a value across an fp8 rounding edge,
1/16 of itself.)"""

from __future__ import annotations

import pytest
import torch
from helpers import smollm2_prompts, teacher_forced_logprobs
from transformers import AutoTokenizer

from tokenmill import LLM, SamplingParams

# |log-probability difference| per scored token (8 prompts x 32 tokens, fp32 activations)
# against the fp32 cache. e4m3 keeps 3 bits of mantissa: each cached value moves by up to
# 1/16 of itself (SmolLM2's keys stay under 20 and its values under 11: nothing saturates at
# 448); SmolLM2-135M's log-probabilities move by 0.05 on average (95th percentile 0.17,
# measured on an AMX Xeon). A misread cache (a wrong exponent bias, bytes in the wrong place)
# moves them by nats.
MEAN_TOLERANCE = 0.1
P95_TOLERANCE = 0.4


@pytest.mark.slow
def test_fp8_kv_cache_log_probabilities_stay_near_the_model_dtype(smollm2_path: str) -> None:
    prompts = smollm2_prompts(AutoTokenizer.from_pretrained(smollm2_path))[:8]
    common = dict(max_model_len=1024, kv_cache_memory_bytes=128 << 20, dtype="float32",
                  multiprocess=False)  # fmt: skip
    scores, blocks = {}, {}
    sequences = None
    for name, kv, backend in (("auto", "auto", None), ("fp8", "fp8", "CPU_ATTN"),
                              ("fp8-torch", "fp8_e4m3", "TORCH_SDPA")):  # fmt: skip
        llm = LLM(smollm2_path, kv_cache_dtype=kv, attention_backend=backend, **common)
        try:
            if sequences is None:
                greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                                    use_tqdm=False)  # fmt: skip
                sequences = [(p, list(o.outputs[0].token_ids)) for p, o in zip(prompts, outs)]
            scores[name] = teacher_forced_logprobs(llm, sequences)
            runner = llm.llm_engine.client.engine_core.executor.worker.model_runner
            blocks[name] = runner.kv_caches[0].shape[0]
            want = torch.float32 if kv == "auto" else torch.float8_e4m3fn
            assert runner.kv_caches[0].dtype == want
        finally:
            llm.shutdown()
    # One byte a value against fp32's four: four times the blocks in the same bytes.
    assert blocks["fp8"] >= 4 * blocks["auto"] - 4, blocks
    for name in ("fp8", "fp8-torch"):
        diff = (scores[name] - scores["auto"]).abs()
        mean, p95 = float(diff.mean()), float(diff.quantile(0.95))
        print(f"{name} KV cache against fp32: mean |d logprob| {mean:.4f}, 95th percentile "
              f"{p95:.4f}")  # fmt: skip
        assert mean <= MEAN_TOLERANCE and p95 <= P95_TOLERANCE, (name, mean, p95)
