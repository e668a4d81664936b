"""Async scheduling must not change results: one mixed workload (preemption, chunked
prefill, prefix hits, stop strings, max_tokens endings, logprobs, penalties, n > 1, a JSON
schema, seeded sampling) gives the same outputs with `async_scheduling` on and off: on
SmolLM2 in-process and with a spawned core, and on a random tiny model in-process and at
TP=2."""

from __future__ import annotations

import json

import pytest
from helpers import smollm2_prompts

from tokenmill import LLM, SamplingParams
from tokenmill.protocol.messages import StructuredOutputsParams

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
# Small enough that requests are preempted, chunked and share cached blocks.
ENGINE = dict(
    max_model_len=336,
    num_gpu_blocks_override=22,  # 21 usable blocks of 16: one long request fills them
    block_size=16,
    max_num_batched_tokens=64,
    max_num_seqs=8,
)


def workload(base: list[list[int]], text: bool) -> tuple[list[dict], list[SamplingParams]]:
    """Every feature once or more. `text`: the model has a tokenizer (stop strings and a
    JSON schema need one)."""
    greedy = dict(temperature=0.0)
    prompts, params = [], []

    def add(tokens: list[int], **kwargs) -> None:
        prompts.append({"prompt_token_ids": tokens})
        params.append(SamplingParams(**kwargs))

    for i, tokens in enumerate(base):  # EOS and length endings, 1 to 40 tokens
        add(tokens, max_tokens=(1, 2, 7, 24, 40)[i % 5], **greedy)
    shared = base[-1] + base[-2]  # 2 copies of a long prompt and 2 extensions: prefix hits
    add(shared, max_tokens=12, **greedy)
    add(shared, max_tokens=12, **greedy)
    add(shared + base[0], max_tokens=12, **greedy)
    add(shared + base[1], max_tokens=12, ignore_eos=True, **greedy)
    add(base[2], max_tokens=16, logprobs=3, prompt_logprobs=2, **greedy)
    add(base[3], max_tokens=20, presence_penalty=0.5, frequency_penalty=0.3,
        repetition_penalty=1.2, **greedy)  # fmt: skip
    add(base[4], max_tokens=16, temperature=0.9, seed=1234, logprobs=2)
    add(base[5], max_tokens=16, n=2, temperature=0.8, seed=7)
    # Any token but those of special meaning stops it, once min_tokens are out.
    add(base[6], max_tokens=16, min_tokens=6, stop_token_ids=list(range(3, 480)), **greedy)
    if text:
        add(base[0], max_tokens=48, stop=[".", "\n"], **greedy)
        add(base[1], max_tokens=48, stop=[" the"], include_stop_str_in_output=True, **greedy)
        schema = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
        add(base[0], max_tokens=60, structured_outputs=schema, **greedy)
    return prompts, params


def run(path: str, prompts, params, **engine_args) -> tuple[list, dict]:
    llm = LLM(path, **{**ENGINE, **engine_args})
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return outputs, llm.get_stats()
    finally:
        llm.shutdown()


def assert_same(expected: list, actual: list) -> None:
    assert len(actual) == len(expected)
    for want, got in zip(expected, actual):
        assert len(got.outputs) == len(want.outputs)
        for a, b in zip(want.outputs, got.outputs):
            assert b.token_ids == a.token_ids, (want.request_id, a.token_ids, b.token_ids)
            assert (b.text, b.finish_reason, b.stop_reason) == (a.text, a.finish_reason,
                                                                a.stop_reason)  # fmt: skip
            assert (a.logprobs is None) == (b.logprobs is None)
            for pa, pb in zip(a.logprobs or [], b.logprobs or []):
                assert pa.keys() == pb.keys()
                for token in pa:
                    assert abs(pa[token].logprob - pb[token].logprob) < 1e-4
        assert (want.prompt_logprobs is None) == (got.prompt_logprobs is None)
        for pa, pb in zip(want.prompt_logprobs or [], got.prompt_logprobs or []):
            assert (pa is None) == (pb is None)
            if pa is not None:
                assert pa.keys() == pb.keys()


@pytest.fixture(scope="module")
def smollm2_workload(smollm2_path: str):
    from transformers import AutoTokenizer

    prompts, params = workload(smollm2_prompts(AutoTokenizer.from_pretrained(smollm2_path)), True)
    expected, stats = run(smollm2_path, prompts, params, async_scheduling=False, multiprocess=False)
    assert stats["num_preemptions"] > 0, stats
    assert stats["prefix_cache_hits"] > 0, stats
    return prompts, params, expected


@pytest.mark.parametrize("multiprocess", [False, True], ids=["inproc", "spawned"])
def test_smollm2_async_equals_sync(smollm2_path: str, smollm2_workload, multiprocess) -> None:
    prompts, params, expected = smollm2_workload
    outputs, stats = run(
        smollm2_path, prompts, params, async_scheduling=True, multiprocess=multiprocess
    )
    assert stats["num_preemptions"] > 0, stats
    assert_same(expected, outputs)
    # The mix exercised what it is meant to: a JSON answer, a stop string, length endings.
    answer = outputs[-1].outputs[0]
    assert answer.finish_reason == "stop" and json.loads(answer.text).keys() == {"name", "age"}
    assert outputs[-3].outputs[0].stop_reason == "."
    assert {o.outputs[0].finish_reason for o in outputs} == {"stop", "length"}


@pytest.mark.parametrize("tp", [1, 2])
def test_tiny_model_async_equals_sync(tiny_model, tp: int) -> None:
    path = str(tiny_model("llama-gqa"))
    base = [[(11 * i + 5 * j) % 480 + 3 for j in range(n)] for i, n in
            enumerate((3, 9, 17, 30, 41, 66, 100, 130))]  # fmt: skip
    prompts, params = workload(base, text=False)
    common = dict(skip_tokenizer_init=True, tensor_parallel_size=tp, multiprocess=False)
    expected, stats = run(path, prompts, params, async_scheduling=False, **common)
    outputs, async_stats = run(path, prompts, params, async_scheduling=True, **common)
    assert stats["num_preemptions"] > 0 and async_stats["num_preemptions"] > 0, (stats, async_stats)
    assert stats["prefix_cache_hits"] > 0
    assert_same(expected, outputs)
    assert {o.outputs[0].finish_reason for o in outputs} == {"stop", "length"}
