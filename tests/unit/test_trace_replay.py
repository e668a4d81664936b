"""Trace replay (SamplingParams.trace_decode_token_ids, vLLM's): the request emits the trace,
EOS inside it included, and ends with it, while its logprobs are the model's own (HF's
log-softmax at the trace's positions); other requests in the batch sample as before; a
proposal is verified against the trace as against any other target."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenmill import LLM, SamplingParams

EOS = 2  # the tiny models' eos_token_id
TRACE = [17, 301, EOS, 17, 301, EOS, 17, 301, 44, 9, 17, 301]  # repeats: n-grams propose


def test_trace_params_are_checked_and_bound_generation() -> None:
    params = SamplingParams(max_tokens=50, trace_decode_token_ids=[5, 6, 7])
    assert params.max_tokens == 3 and params.ignore_eos
    assert SamplingParams(max_tokens=None, trace_decode_token_ids=[5, 6]).max_tokens == 2
    assert SamplingParams(max_tokens=1, trace_decode_token_ids=[5, 6]).max_tokens == 1
    for bad in ([], [-1], ["a"], [1.5], 3):
        with pytest.raises(ValueError, match="trace_decode_token_ids"):
            SamplingParams(trace_decode_token_ids=bad)


def hf_logprobs(hf, prompt: list[int], trace: list[int]) -> torch.Tensor:
    """log-softmax at every position that predicts a trace token: [len(trace), V]."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + trace[:-1]])).logits[0, len(prompt) - 1 :]
    return logits.float().log_softmax(dim=-1)


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "ngram"])
def test_trace_is_emitted_with_the_models_logprobs(tiny_model, speculate: bool) -> None:
    path = str(tiny_model("llama-gqa"))
    prompt = [5, 17, 301, 44, 9, 17, 301, 6]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, "auto_disable": False}  # fmt: skip
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=16 << 20,
              speculative_config=spec if speculate else None)  # fmt: skip
    try:
        greedy = SamplingParams(temperature=0, max_tokens=50, logprobs=3,
                                trace_decode_token_ids=TRACE)  # fmt: skip
        sampled = SamplingParams(temperature=1.0, top_p=0.5, seed=3, max_tokens=50,
                                 trace_decode_token_ids=TRACE)  # fmt: skip
        plain = SamplingParams(temperature=0, max_tokens=len(TRACE), ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": prompt}] * 3, [greedy, sampled, plain],
                               use_tqdm=False)  # fmt: skip
        # An id outside the vocabulary ends that request with an error, as any other field's.
        outside = SamplingParams(trace_decode_token_ids=[3, 512])
        bad = llm.generate({"prompt_token_ids": prompt}, outside, use_tqdm=False)[0]
        assert bad.outputs[0].finish_reason == "error" and "outside [0, 512)" in bad.error
    finally:
        llm.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for out in outputs[:2]:
        completion = out.outputs[0]
        assert completion.token_ids == TRACE  # EOS inside the trace did not stop it
        assert completion.finish_reason == "length"
    reference = hf_logprobs(hf, prompt, TRACE)
    entries = outputs[0].outputs[0].logprobs
    assert entries is not None and len(entries) == len(TRACE)
    for j, (token, entry) in enumerate(zip(TRACE, entries)):
        assert abs(entry[token].logprob - reference[j, token].item()) < 1e-4, j
        assert set(reference[j].topk(3).indices.tolist()) <= set(entry), j
    # The plain request in the same batch is HF's greedy continuation.
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=len(TRACE),
                               do_sample=False, eos_token_id=None)[0, len(prompt) :]  # fmt: skip
    assert outputs[2].outputs[0].token_ids == expected.tolist()
    assert outputs[2].outputs[0].token_ids != TRACE
