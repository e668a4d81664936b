"""Structured outputs through xgrammar on SmolLM2, sampled (temperature 0.8) and mixed with
unconstrained requests in one batch: every JSON output parses and validates against its schema
(jsonschema), every regex output matches in full, every choice is one of the choices, each
ending because its structure completed; the same prompts unconstrained fail at least once;
a schema that does not compile fails its own request only."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tokenmill import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "artist", "doctor"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "skills": {
            "type": "array",
            "items": {"enum": ["python", "c", "go"]},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "role", "address", "skills"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 2,
        },
        "express": {"type": "boolean"},
    },
    "required": ["items", "express"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[A-Z]{2}-[a-z]{4}"
CHOICES = ["red", "green", "blue", "purple"]


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_structured_outputs_on_smollm2(smollm2_llm: LLM) -> None:
    def params(i: int, **structured) -> SamplingParams:
        constraint = StructuredOutputsParams(**structured) if structured else None
        return SamplingParams(
            temperature=0.8, seed=i, max_tokens=160, structured_outputs=constraint
        )

    cases: list[tuple[str, list[dict], SamplingParams]] = []
    compact = dict(disable_any_whitespace=True)
    for i in range(6):
        cases.append(
            ("person", chat("Describe a person as JSON."), params(i, json=PERSON, **compact))
        )
    for i in range(4):
        cases.append(("order", chat("Write an order as JSON."), params(i, json=ORDER, **compact)))
    for i in range(5):
        cases.append(("regex", chat("Give me a code."), params(i, regex=REGEX)))
    for i in range(5):
        cases.append(("choice", chat("Name a color."), params(i, choice=CHOICES)))
    for i in range(3):
        cases.append(("free", chat("Say something."), params(i)))
    cases.append(("bad", chat("Hi."), params(0, json={"type": "no-such-type"})))
    outputs = smollm2_llm.chat([c[1] for c in cases], [c[2] for c in cases], use_tqdm=False)

    for (kind, _, _), out in zip(cases, outputs):
        completion = out.outputs[0]
        text = completion.text
        if kind == "bad":
            assert completion.finish_reason == "error" and "could not be compiled" in out.error
            continue
        if kind == "free":
            assert completion.token_ids  # ran beside the constrained ones
            continue
        assert completion.finish_reason == "stop", (kind, text)
        if kind in ("person", "order"):
            jsonschema.validate(json.loads(text), PERSON if kind == "person" else ORDER)
        elif kind == "regex":
            assert re.fullmatch(REGEX, text), text
        else:
            assert text in CHOICES, text

    # Without constraints the same JSON prompts do not all come out valid.
    free = smollm2_llm.chat(
        [c[1] for c in cases[:10]], [params(i) for i in range(10)], use_tqdm=False
    )
    failures = 0
    for (kind, _, _), out in zip(cases[:10], free):
        try:
            jsonschema.validate(
                json.loads(out.outputs[0].text), PERSON if kind == "person" else ORDER
            )
        except (ValueError, jsonschema.ValidationError):
            failures += 1
    assert failures > 0


def test_structured_outputs_params_are_checked() -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice must be a list of strings"):
        StructuredOutputsParams(choice=[1, 2])


def test_constrained_requests_survive_preemption(smollm2_path: str) -> None:
    """A preempted constrained request keeps its matcher with its output tokens: greedy JSON
    under heavy preemption equals the same requests with ample KV, and validates."""
    prompts = [chat(f"Describe person number {i} as JSON.") for i in range(6)]
    params = SamplingParams(
        temperature=0,
        max_tokens=200,
        structured_outputs=StructuredOutputsParams(json=PERSON, disable_any_whitespace=True),
    )
    results = []
    for blocks in (None, 24):  # ample; then 23 usable blocks for 6 requests of ~5-10 blocks
        llm = LLM(smollm2_path, max_model_len=256, kv_cache_memory_bytes=64 << 20,
                  num_gpu_blocks_override=blocks, dtype="float32")  # fmt: skip
        try:
            outputs = llm.chat(prompts, params, use_tqdm=False)
            results.append(([o.outputs[0].text for o in outputs], llm.get_stats()))
        finally:
            llm.shutdown()
    (ample, ample_stats), (tight, tight_stats) = results
    assert ample_stats["num_preemptions"] == 0 and tight_stats["num_preemptions"] > 0
    assert tight == ample
    for text in tight:
        jsonschema.validate(json.loads(text), PERSON)


def test_stop_strings_end_n_children_and_dead_end_grammars_fail(smollm2_llm: LLM) -> None:
    # Every child stops at its first space, although the core runs ahead of the frontend.
    params = SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=30, stop=[" "])
    out = smollm2_llm.generate("Once upon a time", params, use_tqdm=False)[0]
    for completion in out.outputs:
        assert " " not in completion.text and completion.finish_reason == "stop", completion
    # allowed_token_ids that leave the grammar nothing: the request fails, alone.
    dead_end = SamplingParams(
        max_tokens=5,
        allowed_token_ids=[0],
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
    )
    failed, fine = smollm2_llm.generate(
        ["Answer:", "Answer:"], [dead_end, SamplingParams(temperature=0, max_tokens=3)],
        use_tqdm=False,
    )  # fmt: skip
    assert failed.outputs[0].finish_reason == "error" and "could not continue" in failed.error
    assert fine.outputs[0].token_ids


LARK_SUM = """
// a sum of up to three small numbers, in Lark as vLLM accepts it
?start: sum "="
sum: number [" + " number [" + " number]]
number: DIGIT [DIGIT]
DIGIT: "0" | "1" | "2" | "3" | "4" | "5" | "6" | "7" | "8" | "9"
"""


def test_lark_grammars_constrain_like_their_ebnf(smollm2_llm: LLM) -> None:
    constraint = StructuredOutputsParams(grammar=LARK_SUM)
    params = SamplingParams(
        temperature=0.8, seed=3, max_tokens=40, n=4, structured_outputs=constraint
    )
    (out,) = smollm2_llm.generate(["Add some numbers: "], params, use_tqdm=False)
    for c in out.outputs:
        assert re.fullmatch(r"[0-9]{1,2}( \+ [0-9]{1,2}){0,2}=", c.text), c.text
        assert c.finish_reason == "stop"
    with pytest.raises(ValueError, match=r"grammar \(Lark\).*%import"):
        StructuredOutputsParams(grammar="%import common.NUMBER\nstart: NUMBER")
    with pytest.raises(ValueError, match=r"/regex/ terminals"):
        StructuredOutputsParams(grammar="start: /[a-z]+/")
