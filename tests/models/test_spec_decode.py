"""Speculative decoding never changes a greedy output: the mixed workload of the async tests
(preemption, chunked prefill, prefix hits, stop strings, max_tokens endings, n > 1, a JSON
schema, logprobs, penalties) plus input-grounded prompts (the answer repeats a passage of the
prompt, so n-gram proposals are accepted), with speculation off, with n-gram proposals and
with a draft model: on SmolLM2 (its draft: its own first layers) and on a tiny random model at
TP=1 and TP=2. A draft that is the target itself must have nearly all its proposals accepted,
which checks that the draft's KV cache follows the target's through rejections and
preemptions. Sampled requests are held to their distribution by
tests/unit/test_spec_decode.py instead (their random draws differ)."""

from __future__ import annotations

import json

import pytest
from conftest import make_tiny_model
from helpers import PERSON, smollm2_prompts, workload
from test_async_scheduling import ENGINE
from transformers import AutoTokenizer

from tokenmill import LLM, SamplingParams
from tokenmill.protocol.default_model import DRAFT_MODEL
from tokenmill.protocol.messages import StructuredOutputsParams

pytestmark = pytest.mark.slow

# auto_disable off: every step speculates, whatever the governor would measure here.
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4, "auto_disable": False}  # fmt: skip
PASSAGE = (
    "The committee met on Tuesday to review the budget. After a long discussion the members "
    "agreed to postpone the decision until the auditors had finished their report, and the "
    "chair asked every department to send its figures by the end of the month."
)


def grounded_prompts(tokenizer) -> list[list[int]]:
    asks = [
        f"Repeat this text exactly:\n\n{PASSAGE}",
        f"Correct the spelling in this text and write it out again:\n\n"
        f"{PASSAGE.replace('committee', 'comittee').replace('month', 'mnoth')}",
    ]
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": ask}], add_generation_prompt=True, tokenize=False
        )
        for ask in asks
    ]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


def run(path: str, prompts, params, **engine_args):
    llm = LLM(path, **{**ENGINE, "max_num_batched_tokens": 96, **engine_args})
    try:
        return llm.generate(prompts, params, use_tqdm=False), llm.get_stats()
    finally:
        llm.shutdown()


def assert_greedy_same(params: list[SamplingParams], expected: list, actual: list) -> None:
    compared = 0
    for p, want, got in zip(params, expected, actual):
        if p.temperature != 0.0:
            continue  # sampled and speculating: other draws, same distribution
        for a, b in zip(want.outputs, got.outputs):
            assert b.token_ids == a.token_ids, (want.request_id, a.token_ids, b.token_ids)
            assert (b.text, b.finish_reason, b.stop_reason) == (a.text, a.finish_reason,
                                                                a.stop_reason)  # fmt: skip
        compared += 1
    assert compared >= len(params) - 2


SMOLLM2_ENGINE = dict(multiprocess=False, max_model_len=400, num_gpu_blocks_override=30)


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_path: str):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    prompts, params = workload(smollm2_prompts(tokenizer), text=True)
    for tokens in grounded_prompts(tokenizer):
        prompts.append({"prompt_token_ids": tokens})
        params.append(SamplingParams(temperature=0.0, max_tokens=64))
    expected, stats = run(smollm2_path, prompts, params, **SMOLLM2_ENGINE)
    assert stats["num_preemptions"] > 0
    return prompts, params, expected


def test_smollm2_ngram_greedy_equals_no_speculation(smollm2_path: str, smollm2_reference) -> None:
    prompts, params, expected = smollm2_reference
    actual, stats = run(smollm2_path, prompts, params, speculative_config=NGRAM, **SMOLLM2_ENGINE)
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert_greedy_same(params, expected, actual)
    # The grounded answers copy their prompt: most proposals there are accepted.
    assert stats["spec_decode_num_accepted_tokens"] > 40, stats
    assert stats["spec_decode_acceptance_rate"] > 0.2, stats


def test_smollm2_draft_model_async_greedy_equals_no_speculation(
    smollm2_path: str, smollm2_reference
) -> None:
    prompts, params, expected = smollm2_reference
    draft = {"method": "draft_model", "model": DRAFT_MODEL, "num_speculative_tokens": 2,
             "auto_disable": False}  # fmt: skip
    actual, stats = run(smollm2_path, prompts, params, speculative_config=draft,
                        async_scheduling=True, **SMOLLM2_ENGINE)  # fmt: skip
    assert stats["num_preemptions"] > 0
    assert_greedy_same(params, expected, actual)
    assert stats["spec_decode_num_drafts"] > 50, stats


# TP=1 with async scheduling off and on; TP=2 with it on.
MODES = pytest.mark.parametrize("tp,overlap", [(1, False), (1, True), (2, True)],
                                ids=["tp1", "tp1-async", "tp2-async"])  # fmt: skip


@MODES
def test_tiny_model_ngram_greedy_equals_no_speculation(tiny_model, tp: int, overlap) -> None:
    path = str(tiny_model("llama-gqa"))
    base = [[(11 * i + 5 * j) % 480 + 3 for j in range(n)] for i, n in
            enumerate((3, 9, 17, 30, 41, 66, 100, 130))]  # fmt: skip
    prompts, params = workload(base, text=False)
    for i in range(4):  # periodic prompts: the model's continuation often follows the period
        prompts.append({"prompt_token_ids": [3 + (j % (3 + i)) for j in range(60)]})
        params.append(SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    common = dict(skip_tokenizer_init=True, tensor_parallel_size=tp, multiprocess=False)
    expected, stats = run(path, prompts, params, **common)
    actual, spec_stats = run(path, prompts, params, speculative_config=NGRAM,
                             async_scheduling=overlap, **common)  # fmt: skip
    assert stats["num_preemptions"] > 0 and spec_stats["num_preemptions"] > 0
    assert_greedy_same(params, expected, actual)
    assert spec_stats["spec_decode_num_drafts"] > 0, spec_stats


@MODES
def test_tiny_model_draft_greedy_equals_no_speculation(
    tiny_model, tmp_path, tp: int, overlap
) -> None:
    path = str(tiny_model("llama-gqa"))
    other = str(make_tiny_model(tmp_path, "llama-gqa", seed=1))  # same shapes, other weights
    base = [[(11 * i + 5 * j) % 480 + 3 for j in range(n)] for i, n in
            enumerate((3, 9, 17, 30, 41, 66, 100, 130))]  # fmt: skip
    prompts, params = workload(base, text=False)
    common = dict(skip_tokenizer_init=True, tensor_parallel_size=tp, multiprocess=False)
    expected, _ = run(path, prompts, params, **common)
    common["async_scheduling"] = overlap
    spec = {
        "method": "draft_model",
        "model": other,
        "num_speculative_tokens": 3,
        "auto_disable": False,
    }
    actual, stats = run(path, prompts, params, speculative_config=spec, **common)
    assert stats["num_preemptions"] > 0
    assert_greedy_same(params, expected, actual)
    assert stats["spec_decode_num_drafts"] > 0, stats
    # The target as its own draft, on the greedy requests whose logits nothing adjusts (the
    # draft proposes plain argmaxes): its argmax is the target's, so (up to float ties)
    # every proposal is accepted. Steps with more than 3 requests running do not
    # speculate: the draft catches up on what it missed when they resume.
    greedy = [
        i
        for i, p in enumerate(params)
        if p.temperature == 0.0 and not p.has_penalties and not p.min_tokens
    ]
    spec["model"] = path
    spec["disable_by_batch_size"] = 3
    actual, stats = run(
        path, [prompts[i] for i in greedy], [params[i] for i in greedy],
        speculative_config=spec, **common,
    )  # fmt: skip
    assert stats["num_preemptions"] > 0
    assert_greedy_same([params[i] for i in greedy], [expected[i] for i in greedy], actual)
    assert stats["spec_decode_acceptance_rate"] > 0.97, stats


def test_logprobs_of_accepted_tokens_equal_those_without_speculation(tiny_model) -> None:
    """A request asking for logprobs speculates too: every emitted token (accepted proposals
    included) gets its row, equal to the one it gets without speculation."""
    path = str(tiny_model("llama-gqa"))
    prompts = [{"prompt_token_ids": [3 + (j % (3 + i)) for j in range(50)]} for i in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=3)] * 6
    common = dict(skip_tokenizer_init=True, multiprocess=False)
    expected, _ = run(path, prompts, params, **common)
    actual, stats = run(path, prompts, params, speculative_config=NGRAM, **common)
    assert stats["spec_decode_num_accepted_tokens"] >= 10, stats
    for want, got in zip(expected, actual):
        want, got = want.outputs[0], got.outputs[0]
        assert got.token_ids == want.token_ids
        assert len(got.logprobs) == len(got.token_ids)
        for token, w, g in zip(got.token_ids, want.logprobs, got.logprobs):
            assert token in g and set(w) <= set(g) | {token}
            for t in w:
                if t in g:
                    assert abs(g[t].logprob - w[t].logprob) < 1e-4, (t, w[t], g[t])
                    assert g[t].rank == w[t].rank


def test_smollm2_grammar_bad_words_and_penalties_speculate_per_position(smollm2_path: str) -> None:
    """Requests whose logits depend on the tokens before each position speculate too, each
    verified position adjusted by the proposed tokens before it: a JSON-schema request
    copying a record (a bitmask per position from the core; proposals the grammar forbids
    are rejected), and passages to repeat with a bad word and with a frequency penalty.
    Greedy: each equals its run without speculation, and proposals are accepted."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    record = '{"name":"Ada Lovelace","age":36}'
    asks = [f"Copy this JSON record exactly:\n{record}\n{record}"] + [
        f"Repeat this text exactly:\n\n{PASSAGE}"
    ] * 2
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": ask}], add_generation_prompt=True, tokenize=False
        )
        for ask in asks
    ]
    schema = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=schema),
        SamplingParams(temperature=0.0, max_tokens=48, bad_words=[" the"]),
        SamplingParams(temperature=0.0, max_tokens=48, frequency_penalty=0.4),
    ]
    expected, _ = run(smollm2_path, prompts, params, multiprocess=False)
    # One at a time, so that each request's own proposals are counted.
    for prompt, p, want in zip(prompts, params, expected):
        actual, stats = run(smollm2_path, [prompt], [p], speculative_config=NGRAM,
                            multiprocess=False)  # fmt: skip
        got = actual[0].outputs[0]
        assert got.token_ids == want.outputs[0].token_ids, (got.text, want.outputs[0].text)
        assert stats["spec_decode_num_accepted_tokens"] > 3, (p, stats)
        if p.structured_outputs is not None:
            assert set(json.loads(got.text)) <= set(PERSON["properties"]), got.text
