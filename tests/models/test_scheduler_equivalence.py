"""The scheduler must not change results: the same greedy requests on SmolLM2 give the same
token ids with ample KV, under heavy preemption, with tiny prefill chunks, with prefix
caching over a shared prefix, and for prompts that are fully cached."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def make_prompts(vocab: int = 49152, shared_prefix: int = 0, n: int = 16) -> list[dict]:
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(100, vocab, (shared_prefix,), generator=g).tolist()
    prompts = []
    for i in range(n):
        length = 5 + (i * 37) % 90  # 5..94 tokens, varied
        tail = torch.randint(100, vocab, (length,), generator=g).tolist()
        prompts.append({"prompt_token_ids": prefix + tail})
    return prompts


def run(path: str, prompts: list[dict], **engine_args) -> tuple[list, dict]:
    engine_args.setdefault("kv_cache_memory_bytes", 256 << 20)
    # fp32: a recomputed or differently chunked prefill rounds bf16 otherwise
    llm = LLM(path, max_model_len=256, dtype="float32", **engine_args)
    try:
        outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
        return outputs, llm.get_stats()
    finally:
        llm.shutdown()


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference(smollm2_path: str) -> list[list[int]]:
    outputs, stats = run(smollm2_path, make_prompts(), enable_prefix_caching=False)
    assert stats["num_preemptions"] == 0
    return token_ids(outputs)


@pytest.mark.parametrize("caching", [False, True])
def test_heavy_preemption(smollm2_path: str, reference, caching: bool) -> None:
    # 16 usable blocks of 16 tokens: two or three requests fit at a time.
    outputs, stats = run(
        smollm2_path,
        make_prompts(),
        num_gpu_blocks_override=17,
        enable_prefix_caching=caching,
    )
    assert stats["num_preemptions"] >= 3, stats
    assert token_ids(outputs) == reference


def test_tiny_prefill_chunks(smollm2_path: str, reference) -> None:
    outputs, _ = run(smollm2_path, make_prompts(), max_num_batched_tokens=32)
    assert token_ids(outputs) == reference


def test_shared_prefix_hits_the_cache(smollm2_path: str) -> None:
    prompts = make_prompts(shared_prefix=100)
    expected, _ = run(smollm2_path, prompts, enable_prefix_caching=False)
    outputs, stats = run(smollm2_path, prompts, enable_prefix_caching=True)
    assert token_ids(outputs) == token_ids(expected)
    # All but the first request reuse the six full blocks of the prefix.
    assert sum(o.num_cached_tokens >= 96 for o in outputs) >= 15
    assert stats["prefix_cache_hits"] >= 15 * 96


def test_fully_cached_prompt(smollm2_path: str) -> None:
    prompt = {"prompt_token_ids": make_prompts()[5]["prompt_token_ids"] * 4}  # 40 tokens
    llm = LLM(smollm2_path, max_model_len=256, kv_cache_memory_bytes=256 << 20, dtype="float32")
    try:
        first = llm.generate([prompt, prompt], PARAMS, use_tqdm=False)
        later = llm.generate(prompt, PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()
    assert token_ids(first)[0] == token_ids(first)[1] == token_ids(later)[0]
    n = len(prompt["prompt_token_ids"])
    full_blocks_before_last = (n - 1) // 16 * 16
    assert first[1].num_cached_tokens == full_blocks_before_last
    assert later[0].num_cached_tokens == full_blocks_before_last
