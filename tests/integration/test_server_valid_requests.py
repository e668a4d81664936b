"""Valid requests in every shape the official `openai` client sends: none is refused.

The bodies are drawn (seeded) from the client's own request types, `CompletionCreateParams`
and `ChatCompletionCreateParams` with their nested TypedDicts, read with typing.get_type_hints:
every field of those types gets values of its declared type (each member of a union, each
literal, nested objects with their required and some optional keys), within the ranges
OpenAI's API documents; vLLM's extra fields ride along in `extra_body`. They go through the
client, streamed and not, against one `tokenmill serve` of SmolLM2. Every answer must be a
success of the shape the request asked for (its choices, finish reasons, logprobs, usage).

Fields of the client's types that tokenmill refuses on purpose are listed in REFUSED with the
reason; a field the client gains later is drawn like the others, so a new field the server
does not know fails here until it is decided on. Each refused field is checked to be refused
by name.
"""

from __future__ import annotations

import asyncio
import collections.abc
import json
import random
import types
from typing import Any, Callable, Literal, Union

import openai
import pytest
import typing_extensions as te
from helpers import running_server
from openai.types import completion_create_params as completion_types
from openai.types.chat import completion_create_params as chat_types

pytestmark = pytest.mark.slow

SEED = 20261203
NUM_REQUESTS = 500  # both endpoints, streamed and not
CONCURRENCY = 16
MAX_MODEL_LEN = 112  # max_tokens=null runs to it (the longest prompt drawn is 78 tokens)
VOCAB = 49152  # SmolLM2's

# What tokenmill refuses of the client's fields, and why (paths into the body; list items
# share their list's path). A request with any of them is answered 400 naming the field.
REFUSED: dict[str, str] = {
    "suffix": "completions: no fill-in-the-middle engine behind it",
    "functions": "the legacy function calling: tools and tool_choice are served",
    "function_call": "the legacy function calling: only 'none' is served",
    "messages.function_call": "the legacy function calling: tool_calls are served",
    "audio": "no audio output",
    "messages.audio": "no audio output",
    "modalities": "text only: ['text'] is served",
    "prediction": "no predicted outputs",
    "web_search_options": "no web search",
    "moderation": "no moderation model",
    "verbosity": "no verbosity control for these models",
    "store": "nothing is stored: false is served",
}
# Union members the server refuses (by TypedDict name): legacy function messages, custom
# (free-text) tools, their calls and choices, and content parts other than text.
REFUSED_TYPES = {
    "ChatCompletionFunctionMessageParam",
    "ChatCompletionCustomToolParam",
    "ChatCompletionMessageCustomToolCallParam",
    "ChatCompletionNamedToolChoiceCustomParam",
    "ChatCompletionAllowedToolChoiceParam",
    "ChatCompletionContentPartImageParam",
    "ChatCompletionContentPartInputAudioParam",
    "File",
}
# Valid values of the refused fields that the server does serve (the rest is refused).
SERVED_VALUES: dict[str, list[Any]] = {
    "function_call": ["none"],
    "modalities": [["text"]],
    "store": [False],
}

TEXTS = [
    "Hello", "What is the capital of France?", "Write one word.", "", " ", "Ünïcödé ☃ 🦙🚀",
    "日本語のテキスト", "line one\nline two", "<|im_end|>", "x" * 40, "Say 'Hello, world! 🎉'",
]  # fmt: skip
STOPS = [".", " the", "\n", "is", "🎉", "<|im_end|>", "Paris"]
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
    {"type": "array", "items": {"type": "integer"}},
    {"type": "string", "enum": ["yes", "no"]},
    {"type": "object", "properties": {"n": {"type": "number"}, "ok": {"type": "boolean"}}},
]
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _token(rng: random.Random) -> int:
    return rng.randrange(VOCAB)


def _uniform(low: float, high: float) -> Callable[[random.Random], float]:
    return lambda rng: round(rng.uniform(low, high), 3)


def _ints(low: int, high: int) -> Callable[[random.Random], int]:
    return lambda rng: rng.randint(low, high)


def _pick(values: list[Any]) -> Callable[[random.Random], Any]:
    return lambda rng: rng.choice(values)


# Whole values for fields whose type admits more than the API does (paths as in REFUSED).
VALUES: dict[str, Callable[[random.Random], Any]] = {
    "model": _pick(["smollm2"]),
    "response_format.json_schema.schema": _pick(SCHEMAS),
    "response_format.json_schema.name": _pick(["answer", "Result_1", "a-b"]),
    # Tools with schemas an answer can follow (a named choice is made to name one of them).
    "tools.function.name": _pick(["get_weather", "lookup"]),
    "tools.function.parameters": _pick([SCHEMAS[0], SCHEMAS[3]]),
    **{name: _pick(values) for name, values in SERVED_VALUES.items()},
}
# Numbers (and some strings) by "path:type", in the ranges OpenAI's API documents (vLLM's
# where narrower: top_p > 0, top_logprobs <= 20); `.<key>` and `.<value>` are a dict's keys
# and values. A string leaf without an entry is one of TEXTS; a number without one fails.
LEAVES: dict[str, Callable[[random.Random], Any]] = {
    "prompt:int": _token,
    "prompt:str": _pick([t for t in TEXTS if t.strip()] + ["The sea is"]),
    "n:int": _ints(1, 3),
    "best_of:int": _ints(1, 3),  # made equal to n below: n samples are drawn, no more
    "max_tokens:int": _ints(1, 6),
    "max_completion_tokens:int": _ints(1, 6),
    "temperature:float": _uniform(0.0, 2.0),
    "top_p:float": _uniform(0.05, 1.0),
    "presence_penalty:float": _uniform(-2.0, 2.0),
    "frequency_penalty:float": _uniform(-2.0, 2.0),
    "seed:int": _ints(-(2**63), 2**63 - 3),  # seed + n - 1 is a 64-bit integer too
    "logprobs:int": _ints(0, 5),  # completions' count (chat's is a bool)
    "top_logprobs:int": _ints(0, 20),
    "logit_bias.<key>:str": lambda rng: str(_token(rng)),
    "logit_bias.<value>:int": _ints(-100, 100),
    "stop:str": _pick(STOPS),
}
NOT_NULL = {"prompt"}  # null only with prompt embeddings, which the server does not take


def _unwrap(tp: Any) -> Any:
    while te.get_origin(tp) in (te.Required, te.NotRequired, te.Annotated):
        tp = te.get_args(tp)[0]
    return tp


def _is_list(origin: Any) -> bool:
    iterables = (list, collections.abc.Iterable, collections.abc.Sequence)
    return origin in iterables or getattr(origin, "__name__", "") == "SequenceNotStr"


def draw(tp: Any, path: str, rng: random.Random) -> Any:
    """A value of type `tp` for the field at `path`, within its domain."""
    tp = _unwrap(tp)
    origin, args = te.get_origin(tp), te.get_args(tp)
    if origin in (Union, types.UnionType) and type(None) in args and path not in NOT_NULL:
        if rng.random() < 0.15:
            return None  # null is a value every Optional field may be sent with
    if path in VALUES:
        return VALUES[path](rng)
    if origin is Literal:
        return rng.choice(args)
    if origin in (Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        members = [a for a in members if getattr(_unwrap(a), "__name__", "") not in REFUSED_TYPES]
        return draw(rng.choice(members), path, rng)
    if _is_list(origin):
        return [draw(args[0], path, rng) for _ in range(rng.randint(1, 2))]
    if origin in (dict, collections.abc.Mapping):
        key, value = args
        return {
            draw(key, f"{path}.<key>", rng): draw(value, f"{path}.<value>", rng)
            for _ in range(rng.randint(1, 3))
        }
    if te.is_typeddict(tp):
        return _typed_dict(tp, path, rng)
    if tp is bool:
        return rng.random() < 0.5
    leaf = LEAVES.get(f"{path}:{getattr(tp, '__name__', tp)}")
    if leaf is not None:
        return leaf(rng)
    if tp in (str, object):
        return rng.choice(TEXTS)
    raise AssertionError(f"{path}: no domain for {tp!r}; add one to LEAVES")


def _typed_dict(tp: Any, path: str, rng: random.Random) -> dict[str, Any]:
    hints = te.get_type_hints(tp, include_extras=True)
    body = {}
    for name, hint in hints.items():
        child = f"{path}.{name}" if path else name
        if child in REFUSED and child not in SERVED_VALUES:
            continue
        # The client's modules defer their annotations: Required shows in the hints only.
        if te.get_origin(hint) is te.Required or rng.random() < 0.5:
            body[name] = draw(hint, child, rng)
    return body


# ------------------------------------------------------------------ vLLM's extra fields
def _structured(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["json", "regex", "choice", "grammar", "json_object"])
    spec: dict[str, Any] = {
        "json": {"json": rng.choice(SCHEMAS)},
        "regex": {"regex": rng.choice([r"[a-z]+", r"\d{1,3}", r"(yes|no)!"])},
        "choice": {"choice": rng.choice([["red", "green"], ["Paris", "London", "Rome"]])},
        "grammar": {"grammar": 'root ::= "a" | "b" root'},
        "json_object": {"json_object": True},
    }[kind]
    if kind in ("json", "json_object") and rng.random() < 0.5:
        spec["disable_any_whitespace"] = True
    return spec


VLLM_EXTRAS: dict[str, Callable[[random.Random], Any]] = {
    "top_k": _ints(-1, 50),
    "min_p": _uniform(0.0, 1.0),
    "repetition_penalty": _uniform(0.5, 2.0),
    "min_tokens": _ints(0, 3),
    "ignore_eos": _pick([True, False]),
    "stop_token_ids": lambda rng: [_token(rng) for _ in range(rng.randint(0, 3))],
    "include_stop_str_in_output": _pick([True, False]),
    "skip_special_tokens": _pick([True, False]),
    "spaces_between_special_tokens": _pick([True, False]),
    "allowed_token_ids": lambda rng: [_token(rng) for _ in range(rng.randint(1, 20))],
    "bad_words": lambda rng: rng.sample(["the", "Paris", " is", "🎉", "hello world"], 2),
    "prompt_logprobs": _ints(0, 5),
    "priority": _ints(-10, 10),
    "return_token_ids": _pick([True, False]),
    "truncate_prompt_tokens": _pick([-1, 1, 4, 16]),
    "truncation_side": _pick(["left", "right"]),
    "return_tokens_as_token_ids": _pick([True, False]),
    "use_beam_search": _pick([True]),
    "length_penalty": _uniform(0.5, 2.0),
    "structured_outputs": _structured,
    "guided_json": _pick(SCHEMAS),
    "guided_regex": _pick([r"[A-Z][a-z]*", r"\d+"]),
    "guided_choice": _pick([["yes", "no"]]),
    "guided_grammar": _pick(['root ::= "x" | "y"']),
    "min_characters": _ints(1, 20),
    "add_special_tokens": _pick([True, False]),  # completions only
    "echo": _pick([True, False]),  # chat's (completions' is OpenAI's)
    "add_generation_prompt": _pick([True, False]),
    "continue_final_message": _pick([True]),
    "chat_template": _pick([TEMPLATE]),
    "chat_template_kwargs": _pick([{}, {"enable_thinking": False}, {"custom": "x"}]),
}
CHAT_ONLY = {"echo", "add_generation_prompt", "continue_final_message", "chat_template",
             "chat_template_kwargs"}  # fmt: skip
CONSTRAINTS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar")  # fmt: skip


def _extras(rng: random.Random, chat: bool) -> dict[str, Any]:
    names = [n for n in VLLM_EXTRAS if chat or n not in CHAT_ONLY]
    if chat:
        names.remove("add_special_tokens")
    return {n: VLLM_EXTRAS[n](rng) for n in rng.sample(names, rng.randint(0, 4))}


def _make_valid(body: dict[str, Any], extra: dict[str, Any], chat: bool) -> None:
    """The rules across fields that a valid request follows (OpenAI's and vLLM's)."""
    if not body.get("stream"):
        body.pop("stream_options", None)  # only with stream=true
        extra.pop("min_characters", None)
    if body.get("best_of") is not None:
        body["best_of"] = body.get("n") or 1
    if chat and body.get("top_logprobs") is not None:
        body["logprobs"] = True  # top_logprobs needs logprobs=true
    # tool_choice names one of the tools, and comes with them.
    choice = body.get("tool_choice")
    if choice is not None and not body.get("tools"):
        body.pop("tool_choice")
    elif isinstance(choice, dict):
        choice["function"]["name"] = body["tools"][0]["function"]["name"]
    choice = body.get("tool_choice")
    constrained_tools = choice == "required" or isinstance(choice, dict)
    if extra.get("use_beam_search") and constrained_tools:
        body.pop("tool_choice")  # beams are not constrained
        constrained_tools = False
    # One structured output constraint at most (a required or named tool choice is one).
    fmt = body.get("response_format") or {}
    constraints = ["tool_choice"] if constrained_tools else []
    constraints += [n for n in CONSTRAINTS if n in extra]
    if fmt.get("type") in ("json_object", "json_schema"):
        constraints.append("response_format")
    for name in constraints[1:]:
        (body if name == "response_format" else extra).pop(name)
    if constraints:
        # A grammar with tokens it may not use, or that may not end where it ends, has no
        # answer: the request fails (an error, tested with the structured outputs).
        for name in ("allowed_token_ids", "min_tokens", "ignore_eos"):
            extra.pop(name, None)
    if extra.get("min_tokens"):
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        extra["min_tokens"] = min(extra["min_tokens"], limit or 3)
    if extra.get("use_beam_search"):  # vLLM's beam search: whole answers, no logprobs
        body["stream"] = False
        # Each of its steps is a round of requests: up to the context would take minutes.
        if not (body.get("max_tokens") or body.get("max_completion_tokens")):
            body["max_tokens"] = 4
        for name in ("stream_options", "logprobs", "top_logprobs", "echo"):
            body.pop(name, None)
        for name in ("min_characters", "prompt_logprobs"):
            extra.pop(name, None)
    if chat and extra.get("continue_final_message"):
        # It continues the last message: an assistant's text, without a new generation prompt.
        body["messages"].append({"role": "assistant", "content": "The answer is"})
        extra["add_generation_prompt"] = False


def request(rng: random.Random) -> tuple[bool, dict[str, Any], dict[str, Any]]:
    """(chat?, the client's keyword arguments, extra_body)."""
    chat = rng.random() < 0.5
    module = chat_types if chat else completion_types
    body = _typed_dict(module.CompletionCreateParamsBase, "", rng)
    body["stream"] = rng.random() < 0.5
    extra = _extras(rng, chat)
    _make_valid(body, extra, chat)
    return chat, body, extra


# ------------------------------------------------------------------ the expected shape
def _num_prompts(prompt: Any) -> int:
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)  # a list of texts or of token lists
    return 1


def _check_answer(chat: bool, body: dict, extra: dict, choices: list, usage: Any) -> None:
    n = body.get("n") or 1
    expected = n * (1 if chat else _num_prompts(body["prompt"]))
    assert sorted(c.index for c in choices) == list(range(expected))
    assert all(c.finish_reason in ("stop", "length", "tool_calls") for c in choices)
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    if usage is not None and limit is not None and not extra.get("use_beam_search"):
        assert usage.completion_tokens <= limit * expected
    wants_logprobs = body.get("logprobs") not in (None, False)
    if wants_logprobs and not extra.get("use_beam_search"):
        assert all(c.logprobs is not None for c in choices)


async def _send(client: openai.AsyncOpenAI, chat: bool, body: dict, extra: dict) -> None:
    create = client.chat.completions.create if chat else client.completions.create
    if not body["stream"]:
        answer = await create(**body, extra_body=extra)
        _check_answer(chat, body, extra, answer.choices, answer.usage)
        return
    merged: dict[int, Any] = {}
    usage = None
    async for chunk in await create(**body, extra_body=extra):
        usage = chunk.usage or usage
        for c in chunk.choices:
            if c.finish_reason is not None or c.index not in merged:
                merged[c.index] = c
    include_usage = (body.get("stream_options") or {}).get("include_usage")
    assert (usage is not None) == bool(include_usage)
    _check_answer(chat, body, extra, list(merged.values()), usage)


@pytest.fixture(scope="module")
def server(smollm2_path):
    args = ("--max-model-len", str(MAX_MODEL_LEN), "--trust-request-chat-template",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes")  # fmt: skip
    with running_server(smollm2_path, *args) as (_, base):
        yield base


def test_valid_requests_in_every_client_shape_are_served(server) -> None:
    rng = random.Random(SEED)
    requests = [request(rng) for _ in range(NUM_REQUESTS)]
    assert sum(chat for chat, _, _ in requests) > NUM_REQUESTS // 3
    assert sum(body["stream"] for _, body, _ in requests) > NUM_REQUESTS // 4

    async def run_all() -> list[tuple[dict, dict, BaseException]]:
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0,
                                    timeout=600)  # fmt: skip
        semaphore = asyncio.Semaphore(CONCURRENCY)
        failures = []

        async def one(chat: bool, body: dict, extra: dict) -> None:
            async with semaphore:
                try:
                    await _send(client, chat, body, extra)
                except Exception as e:  # collected: every failing shape is reported
                    failures.append((body, extra, e))

        await asyncio.gather(*(one(*r) for r in requests))
        await client.close()
        return failures

    failures = asyncio.run(run_all())
    shown = [(json.dumps(b, default=str)[:600], json.dumps(x)[:300], repr(e)[:400])
             for b, x, e in failures[:5]]  # fmt: skip
    assert not failures, f"{len(failures)} of {NUM_REQUESTS} valid requests failed: {shown}"


def test_every_refused_field_is_refused_by_name(server) -> None:
    """REFUSED holds only fields the client has, and each (in an otherwise valid body) is a
    400 naming it, not an answer that ignores what was asked."""
    rng = random.Random(SEED + 1)
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)
    for path in REFUSED:
        chat = path != "suffix"
        module = chat_types if chat else completion_types
        hints = te.get_type_hints(module.CompletionCreateParamsBase, include_extras=True)
        field, _, inner = path.partition(".")
        assert field in hints, f"REFUSED names {path}, which the client does not have"
        body: dict[str, Any] = {"model": "smollm2", "max_tokens": 2}
        if not chat:
            body["prompt"] = "Hi"
        elif inner:  # a field of an (assistant) message
            body["messages"] = [{"role": "user", "content": "Hi"},
                                _message_with(hints["messages"], inner, rng)]  # fmt: skip
        else:
            body["messages"] = [{"role": "user", "content": "Hi"}]
        if not inner:
            served = SERVED_VALUES.get(path, [])
            body[field] = next(v for v in iter(lambda: draw(hints[field], "", rng), object())
                               if v is not None and v not in served)  # fmt: skip
        create = client.chat.completions.create if chat else client.completions.create
        with pytest.raises(openai.BadRequestError) as caught:
            create(**body)
        error = caught.value.body
        assert (error["param"] or "").split("[")[0] == field, (path, error)


def _message_with(messages_hint: Any, field: str, rng: random.Random) -> dict[str, Any]:
    """A message of a kind that has `field`, with it set."""
    kinds = te.get_args(_unwrap(te.get_args(_unwrap(messages_hint))[0]))
    kind = next(k for k in kinds if field in te.get_type_hints(k))
    message = {"role": te.get_args(_unwrap(te.get_type_hints(kind)["role"]))[0]}
    value = None
    while value is None:
        value = draw(te.get_type_hints(kind, include_extras=True)[field], "", rng)
    message[field] = value
    return message
