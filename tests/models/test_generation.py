"""End-to-end behaviour of LLM.generate on the real SmolLM2 weights: stop conditions,
finish reasons, chat, text/token consistency and bad input."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
EOS = 2  # <|im_end|>


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kwargs)


def test_eos_ends_a_chat_answer(smollm2_llm: LLM) -> None:
    out = smollm2_llm.chat(QUESTION, greedy(max_tokens=64), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason is None
    assert completion.token_ids[-1] == EOS and EOS not in completion.token_ids[:-1]
    assert "Paris" in completion.text and "<|im_end|>" not in completion.text
    tokenizer = smollm2_llm.get_tokenizer()
    assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def test_max_tokens_ends_with_length(smollm2_llm: LLM) -> None:
    out = smollm2_llm.generate("Once upon a time", greedy(max_tokens=7), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 7
    assert out.prompt == "Once upon a time" and out.finished


def test_ignore_eos_runs_to_max_tokens(smollm2_llm: LLM) -> None:
    out = smollm2_llm.chat(QUESTION, greedy(max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 40
    assert EOS in out.outputs[0].token_ids


def test_stop_token_ids(smollm2_llm: LLM) -> None:
    reference = smollm2_llm.chat(QUESTION, greedy(max_tokens=64), use_tqdm=False)[0].outputs[0]
    stop_id = reference.token_ids[3]
    first = reference.token_ids.index(stop_id)
    out = smollm2_llm.chat(
        QUESTION, greedy(max_tokens=64, stop_token_ids=[stop_id]), use_tqdm=False
    )
    completion = out[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_id
    assert completion.token_ids == reference.token_ids[: first + 1]


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings(smollm2_llm: LLM, include: bool) -> None:
    reference = smollm2_llm.chat(QUESTION, greedy(max_tokens=64), use_tqdm=False)[0].outputs[0]
    text = reference.text
    stop = "France"
    assert stop in text, text
    params = greedy(
        max_tokens=64, stop=["no such string", stop], include_stop_str_in_output=include
    )
    completion = smollm2_llm.chat(QUESTION, params, use_tqdm=False)[0].outputs[0]
    cut = text.index(stop) + (len(stop) if include else 0)
    assert completion.text == text[:cut]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert len(completion.token_ids) < len(reference.token_ids)


def test_min_tokens_holds_back_eos(smollm2_llm: LLM) -> None:
    reference = smollm2_llm.chat(QUESTION, greedy(max_tokens=64), use_tqdm=False)[0].outputs[0]
    n = len(reference.token_ids)  # ends with EOS
    out = smollm2_llm.chat(QUESTION, greedy(max_tokens=n + 20, min_tokens=n + 5), use_tqdm=False)
    completion = out[0].outputs[0]
    assert len(completion.token_ids) >= n + 5
    assert EOS not in completion.token_ids[: n + 5]
    # Up to the point where the reference emitted EOS, greedy decoding is unchanged.
    assert completion.token_ids[: n - 1] == reference.token_ids[: n - 1]


def test_outputs_come_back_in_prompt_order(smollm2_llm: LLM) -> None:
    prompts = ["One", "Two three four five six seven", "Eight nine"]
    params = [greedy(max_tokens=n) for n in (9, 3, 6)]
    outputs = smollm2_llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outputs] == [9, 3, 6]


def test_bad_input_raises_and_engine_goes_on(smollm2_llm: LLM) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        smollm2_llm.generate({"prompt_token_ids": [1] * 5000}, greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="outside"):
        smollm2_llm.generate({"prompt_token_ids": [1, 10**9]}, greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="2 entries for 1 prompts"):
        smollm2_llm.generate(["a"], [greedy(), greedy()], use_tqdm=False)
    # A batch with one bad prompt submits nothing; the engine still serves the next call.
    with pytest.raises(ValueError):
        smollm2_llm.generate(["fine", {"prompt_token_ids": []}], greedy(), use_tqdm=False)
    assert smollm2_llm.get_stats()["num_waiting"] == 0
    out = smollm2_llm.generate("Hello", greedy(max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
