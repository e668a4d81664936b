"""A request resubmitted with the tokens it already produced (`resumed_token_ids`, what a
client sends when its engine core went away) continues exactly where it stopped: greedy
tokens, finish reasons and lengths equal an uninterrupted run's, with penalties and
min_tokens counting the resumed tokens as outputs, and a JSON-schema request's grammar
advanced through them."""

from __future__ import annotations

import msgspec
import pytest
from helpers import PERSON
from transformers import AutoTokenizer

from tokenmill import LLM
from tokenmill.protocol.messages import (
    EngineCoreRequest,
    SamplingParams,
    StructuredOutputsParams,
)


def run_core(core, requests: list[EngineCoreRequest]) -> dict[str, tuple[list[int], str]]:
    """Every request's new tokens and finish reason, stepping the core directly."""
    for request in requests:
        core.add_request(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    reasons: dict[str, str] = {}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                assert out.error is None, out.error
                reasons[out.request_id] = str(out.finish_reason)
    return {r: (tokens[r], reasons[r]) for r in tokens}


def resumed(request: EngineCoreRequest, produced: list[int]) -> EngineCoreRequest:
    return msgspec.structs.replace(request, resumed_token_ids=produced)


def core_of(llm: LLM):
    return llm.llm_engine.client.engine_core


def test_resumed_requests_continue_where_they_stopped(tiny_model) -> None:
    llm = LLM(str(tiny_model("llama-gqa")), skip_tokenizer_init=True, multiprocess=False,
              dtype="float32", max_model_len=256)  # fmt: skip
    try:
        params = [
            SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
            SamplingParams(
                temperature=0.0,
                max_tokens=40,
                ignore_eos=True,
                frequency_penalty=0.8,
                presence_penalty=0.3,
            ),  # fmt: skip
            SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.4),
            # EOS banned until 25 outputs; then the request may end at EOS (token 2)
            SamplingParams(temperature=0.0, max_tokens=60, min_tokens=25),
        ]
        requests = [
            EngineCoreRequest(
                f"r{i}", [(7 * i + 3 * j) % 500 + 3 for j in range(9 + 5 * i)], p, [2], 0.0
            )  # fmt: skip
            for i, p in enumerate(params)
        ]
        whole = run_core(core_of(llm), requests)
        for cut in (1, 12):
            again = [resumed(r, whole[r.request_id][0][:cut]) for r in requests]
            rest = run_core(core_of(llm), again)
            for r in requests:
                tokens, reason = whole[r.request_id]
                assert rest[r.request_id] == (tokens[cut:], reason), (r.request_id, cut)
        # The penalties changed the output (they were in effect, counting resumed tokens).
        assert whole["r0"][0] != whole["r1"][0]
    finally:
        llm.shutdown()


def test_resumed_token_ids_are_validated(tiny_model) -> None:
    llm = LLM(str(tiny_model("llama-gqa")), skip_tokenizer_init=True, multiprocess=False,
              max_model_len=64)  # fmt: skip
    try:
        core = core_of(llm)
        params = SamplingParams(temperature=0.0, max_tokens=4)
        bad = EngineCoreRequest("bad", [5, 6], params, [2], 0.0, resumed_token_ids=[3, 9999])
        long = EngineCoreRequest("long", [5] * 40, params, [2], 0.0, resumed_token_ids=[3] * 30)
        for request in (bad, long):
            core.add_request(request)
        errors = {out.request_id: out.error for out in core.step().outputs}
        assert "resumed_token_ids holds ids outside [0, 512): [9999]" in errors["bad"]
        assert "70 tokens, more than max_model_len=64" in errors["long"]
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_smollm2_resumed_json_request_keeps_its_grammar(smollm2_path: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe a famous scientist as JSON."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt = tokenizer.encode(text, add_special_tokens=False)
    schema = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=schema,
                            frequency_penalty=0.2)  # fmt: skip
    llm = LLM(smollm2_path, multiprocess=False, dtype="float32", max_model_len=512)
    try:
        request = EngineCoreRequest("json", prompt, params, [tokenizer.eos_token_id], 0.0)
        tokens, reason = run_core(core_of(llm), [request])["json"]
        assert reason == "stop" and len(tokens) > 8
        cut = len(tokens) // 2
        rest = run_core(core_of(llm), [resumed(request, tokens[:cut])])["json"]
        assert rest == (tokens[cut:], reason)
        # A resumed output the grammar cannot have produced fails that request alone.
        wrong = resumed(request, tokenizer.encode("not json", add_special_tokens=False))
        core = core_of(llm)
        core.add_request(wrong)
        outputs = []
        while core.has_unfinished_requests():
            outputs += core.step().outputs
        assert "does not follow the grammar" in (outputs[-1].error or "")
    finally:
        llm.shutdown()
