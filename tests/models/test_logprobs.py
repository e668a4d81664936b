"""Logprobs against HF transformers: greedy generation with logprobs=5 and prompt_logprobs=5 on
SmolLM2 (fp32) gives HF's log_softmax of the same positions to 1e-4, values and top-5 ids,
with chunked prefill (64-token chunks) and prefix caching on."""

from __future__ import annotations

import pytest
import torch
from helpers import smollm2_prompts
from transformers import AutoModelForCausalLM, AutoTokenizer

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow
K = 5
TOLERANCE = 1e-4


def check_position(entry: dict, chosen: int, ref_logprobs: torch.Tensor) -> None:
    """One position's Logprob dict against HF's log-probabilities there."""
    top = ref_logprobs.topk(K)
    ours_top = sorted((t for t, lp in entry.items() if lp.rank is not None and lp.rank <= K),
                      key=lambda t: entry[t].rank)  # fmt: skip
    assert ours_top == top.indices.tolist()
    for token, lp in entry.items():
        assert abs(lp.logprob - ref_logprobs[token].item()) < TOLERANCE
    # Its rank: 1 + the tokens more likely than it. Deep in the tail tokens lie closer than
    # the tolerance, so those within it of the chosen one may fall on either side.
    value = ref_logprobs[chosen].item()
    surely_above = int((ref_logprobs > value + TOLERANCE).sum())
    maybe_above = int((ref_logprobs > value - TOLERANCE).sum()) - 1  # less the chosen one
    assert surely_above + 1 <= entry[chosen].rank <= maybe_above + 1


def test_smollm2_logprobs_match_hf(smollm2_path: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    every = smollm2_prompts(tokenizer)
    prompts = [min(every, key=len), every[0], max(every, key=len)]
    assert max(len(p) for p in prompts) > 64  # so that some prompt is chunked
    llm = LLM(
        smollm2_path,
        dtype="float32",  # HF's fp32 log-probabilities are the reference
        max_model_len=1024,
        kv_cache_memory_bytes=256 << 20,
        max_num_batched_tokens=64,
        enable_prefix_caching=True,
    )
    try:
        token_prompts = [{"prompt_token_ids": p} for p in prompts]
        with_prompt = SamplingParams(temperature=0, max_tokens=12, logprobs=K, prompt_logprobs=K)
        first = llm.generate(token_prompts, with_prompt, use_tqdm=False)
        # Again without prompt logprobs: these read the prefix cache.
        again = llm.generate(
            token_prompts, SamplingParams(temperature=0, max_tokens=12, logprobs=K), use_tqdm=False
        )
    finally:
        llm.shutdown()
    assert all(o.num_cached_tokens == 0 for o in first)  # prompt logprobs skip the cache
    assert sum(o.num_cached_tokens for o in again) > 0
    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    for prompt, out, cached in zip(prompts, first, again):
        completion = out.outputs[0]
        assert cached.outputs[0].token_ids == completion.token_ids
        with torch.inference_mode():
            ids = torch.tensor([prompt + completion.token_ids])
            ref = hf(ids).logits[0].float().log_softmax(-1)
        n = len(prompt)
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == n
        assert out.prompt_logprobs[0] is None
        for i in range(1, n):
            check_position(out.prompt_logprobs[i], prompt[i], ref[i - 1])
        total = 0.0
        for run in (completion, cached.outputs[0]):
            assert run.logprobs is not None and len(run.logprobs) == len(completion.token_ids)
            for j, token in enumerate(completion.token_ids):
                check_position(run.logprobs[j], token, ref[n - 1 + j])
        total = sum(ref[n - 1 + j, t].item() for j, t in enumerate(completion.token_ids))
        assert abs(completion.cumulative_logprob - total) < 1e-3


def test_logprobs_limits(tiny_model) -> None:
    llm = LLM(
        str(tiny_model("llama-gqa")),
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=16 << 20,
        max_logprobs=3,
    )
    try:
        prompt = {"prompt_token_ids": [5, 6, 7]}
        with pytest.raises(ValueError, match="logprobs=4 asks for more than max_logprobs=3"):
            llm.generate(prompt, SamplingParams(logprobs=4), use_tqdm=False)
        with pytest.raises(ValueError, match="prompt_logprobs=-1 asks for more"):
            llm.generate(prompt, SamplingParams(prompt_logprobs=-1), use_tqdm=False)
        out = llm.generate(prompt, SamplingParams(max_tokens=3, logprobs=0), use_tqdm=False)
        # logprobs=0: only the sampled token's entry.
        assert [len(d) for d in out[0].outputs[0].logprobs] == [1, 1, 1]
        plain = llm.generate(prompt, SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0]
        assert plain.logprobs is None and plain.cumulative_logprob is None
    finally:
        llm.shutdown()
    whole = LLM(
        str(tiny_model("llama-gqa")),
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=16 << 20,
        max_logprobs=-1,
    )
    try:
        out = whole.generate(prompt, SamplingParams(max_tokens=2, logprobs=-1), use_tqdm=False)
        entry = out[0].outputs[0].logprobs[0]
        assert len(entry) == 512  # the whole vocabulary
        total = torch.tensor([lp.logprob for lp in entry.values()]).exp().sum()
        assert abs(total.item() - 1.0) < 1e-4
    finally:
        whole.shutdown()
