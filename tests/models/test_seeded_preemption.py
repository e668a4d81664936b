"""A seeded sampled request draws the same tokens whether or not it is preempted.

The request's generator lives in its per-request state in the workers (worker/input_batch.py
RequestState), which a preemption leaves alone: the resumed request draws on from where it
stopped. Twenty seeded requests (temperature, top-p, top-k, seed 1000 + i) with ample KV
are the reference; a KV cache tight enough to preempt many times must give the same tokens,
with async scheduling off and on, on SmolLM2 and on a tiny random model at TP=1 and TP=2.
"""

from __future__ import annotations

import pytest
from helpers import smollm2_prompts
from transformers import AutoTokenizer

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow

NUM_PROMPTS = 20


def seeded_params(i: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.9, top_p=0.95, top_k=50, seed=1000 + i, max_tokens=max_tokens
    )


def generate(path: str, prompts: list[list[int]], max_tokens: int, **engine_args):
    # fp32: a preempted request's recomputed prefill would round bf16 otherwise (a draw
    # near a boundary may then flip), which is not what is tested here
    llm = LLM(path, dtype="float32", **engine_args)
    try:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            [seeded_params(i, max_tokens) for i in range(len(prompts))],
            use_tqdm=False,
        )
        return [o.outputs[0].token_ids for o in outputs], llm.get_stats()
    finally:
        llm.shutdown()


def assert_all_equal(expected: list[list[int]], actual: list[list[int]]) -> None:
    differ = [i for i, (a, b) in enumerate(zip(expected, actual)) if a != b]
    assert not differ, f"{len(differ)}/{len(expected)} requests changed: {differ}"


@pytest.fixture(scope="module")
def smollm2_setup(smollm2_path: str):
    base = smollm2_prompts(AutoTokenizer.from_pretrained(smollm2_path))
    # 20 prompts: the parity prompts, then each of them shortened.
    prompts = [base[i % len(base)][: None if i < len(base) else -(i // len(base))]
               for i in range(NUM_PROMPTS)]  # fmt: skip
    common = dict(max_model_len=320, block_size=16, multiprocess=False, max_num_seqs=20)
    ample, stats = generate(smollm2_path, prompts, 24, kv_cache_memory_bytes=64 << 20, **common)
    assert stats["num_preemptions"] == 0, stats
    return prompts, common, ample


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_smollm2_seeded_requests_survive_preemption(
    smollm2_path: str, smollm2_setup, async_scheduling: bool
) -> None:
    prompts, common, ample = smollm2_setup
    tight, stats = generate(
        smollm2_path,
        prompts,
        24,
        num_gpu_blocks_override=30,  # room for a few requests at a time
        async_scheduling=async_scheduling,
        **common,
    )
    assert stats["num_preemptions"] >= 5, stats
    assert_all_equal(ample, tight)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("tp", [1, 2])
def test_tiny_model_seeded_requests_survive_preemption(
    tiny_model, tp: int, async_scheduling: bool
) -> None:
    path = str(tiny_model("llama-gqa"))
    prompts = [[(13 * i + 7 * j) % 480 + 3 for j in range(10 + 9 * i)] for i in range(NUM_PROMPTS)]
    common = dict(
        skip_tokenizer_init=True,
        max_model_len=256,
        block_size=16,
        max_num_seqs=20,
        tensor_parallel_size=tp,
        multiprocess=False,
        async_scheduling=async_scheduling,
    )
    ample, stats = generate(path, prompts, 40, num_gpu_blocks_override=600, **common)
    assert stats["num_preemptions"] == 0, stats
    tight, stats = generate(path, prompts, 40, num_gpu_blocks_override=24, **common)
    assert stats["num_preemptions"] >= 5, stats
    assert_all_equal(ample, tight)
