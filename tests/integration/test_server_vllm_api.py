"""vLLM's OpenAI API as vLLM's clients use it, on one `tokenmill serve` of SmolLM2
(max_model_len 128; one more with --max-logprobs -1 for the -1 logprobs):

- a seeded fuzz: 2,000 bodies for /v1/completions and /v1/chat/completions, made from the
  request schemas with types swapped, nulls, nesting, huge and negative numbers, unknown
  fields, broken JSON and a missing content type. Each gets an answer within a deadline (2xx,
  or a 4xx whose error names a field it was given), and afterwards the server answers a
  normal request as before;
- vLLM's fields beyond OpenAI's (truncate_prompt_tokens and truncation_side, echo in chat,
  continue_final_message on /tokenize, return_tokens_as_token_ids, min_characters, -1
  logprobs, any chat role, no model, /invocations) and the shapes vLLM's clients read (nulls
  present, the models' root, streamed text offsets);
- vLLM's own server tests as they send their requests: logit_bias with string keys (and its
  errors), /invocations' keys, min_characters at the top level, echo with token ids and both
  logprobs, token ids as logprob names that decode to the text, seeds of any sign.

The server is stopped at the end."""

from __future__ import annotations

import asyncio
import copy
import json
import math
import random

import openai
import pytest
from helpers import httpx, running_server

from tokenmill.frontend.server.protocol import ChatCompletionRequest, CompletionRequest

pytestmark = pytest.mark.slow

NUM_BODIES = 2000
CONCURRENCY = 16
DEADLINE_S = 600.0  # per request: catches a request that never ends, not a slow machine

_ODD = [
    None, "", "text", "x" * 3000, -1, 0, 1, 2, -(2**63), 2**63, 10**30, 1e308, -1e308,
    math.inf, -math.inf, math.nan, 0.5, -0.5, True, False, [], {}, [1, "a"], [[[]]],
    {"a": {"b": [1]}}, {"regex": {"a": 1}}, {"json": None}, {"type": "json_schema"},
    {"include_usage": "yes"}, ["stop", 5], {"1": "x"}, [{"role": "user"}], "<|im_end|>",
]  # fmt: skip
_BASES = {
    "/v1/completions": (
        {"model": "smollm2", "prompt": "Hello", "max_tokens": 2, "temperature": 0},
        [f for f in CompletionRequest.model_fields],
    ),
    "/v1/chat/completions": (
        {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        [f for f in ChatCompletionRequest.model_fields] + ["messages.0.content", "messages.0.role"],
    ),
}


# Other spellings of structured outputs: the core's grammar errors name the one field.
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "response_format")
_ALIASES = {name: "structured_outputs" for name in _GUIDED}


def _names(field: str) -> tuple[str, ...]:
    return (field, _ALIASES[field]) if field in _ALIASES else (field,)


def _fuzzed_body(rng: random.Random) -> tuple[str, bytes, dict[str, str], list[str]]:
    """(path, body bytes, headers, the names of the fields it changed)."""
    path = rng.choice(sorted(_BASES))
    base, fields = _BASES[path]
    body = copy.deepcopy(base)
    changed = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.random()
        value = copy.deepcopy(rng.choice(_ODD))
        if kind < 0.7:
            name = rng.choice(fields)
            if name.startswith("messages.0."):
                message = body.get("messages")
                if isinstance(message, list) and message and isinstance(message[0], dict):
                    message[0][name.rsplit(".", 1)[1]] = value
            else:
                body[name] = value
            changed.append(name.split(".")[0])
        elif kind < 0.8:
            name = f"unknown_field_{rng.randint(0, 5)}"
            body[name] = value
            changed.append(name)
        elif kind < 0.9:  # nested deeper
            name = rng.choice(["structured_outputs", "response_format", "stream_options",
                               "logit_bias", "chat_template_kwargs"])  # fmt: skip
            body[name] = {rng.choice(["regex", "json", "type", "include_usage", "1"]): value}
            changed.append(name)
        else:
            body.pop(rng.choice(sorted(body)), None)  # a field left out
            changed.append("*")
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    roll = rng.random()
    if roll < 0.03:
        data = data[: rng.randint(0, len(data) - 1)]  # truncated JSON
        changed.append("*")
    elif roll < 0.05:
        headers = {}  # no content type
        changed.append("*")
    return path, data, headers, changed


async def _send_all(base: str, bodies: list) -> list[tuple[int, object]]:
    semaphore = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=base, timeout=DEADLINE_S) as client:

        async def send(path: str, data: bytes, headers: dict) -> tuple[int, object]:
            async with semaphore:
                response = await client.post(path, content=data, headers=headers)
                text = response.text
                try:
                    return response.status_code, json.loads(text)
                except ValueError:
                    return response.status_code, text  # a stream

        return await asyncio.gather(*(send(p, d, h) for p, d, h, _ in bodies))


@pytest.fixture(scope="module")
def server(smollm2_path):
    with running_server(smollm2_path, "--max-model-len", "128") as (_, base):
        yield base


def test_an_ill_typed_nested_field_is_a_400_naming_it(server) -> None:
    """The report: a JSON object where the regex string belongs used to reach the core, fail
    to decode there and leave its client waiting for ever."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model="smollm2", prompt="Hi", max_tokens=2,
            extra_body={"structured_outputs": {"regex": {"a": 1}}},
        )  # fmt: skip
    error = caught.value.body
    assert "structured_outputs" in error["message"] and "regex" in error["message"]
    assert "{'a': 1}" in error["message"] and error["param"] == "structured_outputs"


def test_fuzzed_http_bodies_all_get_an_answer(server) -> None:
    rng = random.Random(7)
    bodies = [_fuzzed_body(rng) for _ in range(NUM_BODIES)]
    answers = asyncio.run(_send_all(server, bodies))
    statuses = [status for status, _ in answers]
    assert all(status < 500 for status in statuses), sorted(set(statuses))
    unnamed = []
    for (path, data, _, changed), (status, answer) in zip(bodies, answers):
        if status < 400:
            continue
        error = answer["error"] if isinstance(answer, dict) else {}
        message, param = str(error.get("message", "")), str(error.get("param"))
        assert message, (data, answer)
        names = [n for field in changed for n in _names(field)]
        if "*" not in changed and not any(n in message or n == param for n in names):
            unnamed.append((data[:200], message))
    assert not unnamed, f"{len(unnamed)} errors name no field they were given: {unnamed[:5]}"
    counts = {status: statuses.count(status) for status in set(statuses)}
    assert counts.get(200, 0) > 50 and counts.get(400, 0) > 500, counts
    # The server still answers as before.
    response = httpx.post(
        f"{server}/v1/completions",
        json={"model": "smollm2", "prompt": "Hello", "max_tokens": 4, "temperature": 0},
        timeout=60,
    )
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 4


# ------------------------------------------------------------------ vLLM's fields
@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def _post(server: str, path: str, body: dict) -> dict:
    response = httpx.post(f"{server}{path}", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _sse(server: str, path: str, body: dict) -> list[dict]:
    response = httpx.post(f"{server}{path}", json={**body, "stream": True}, timeout=120)
    assert response.status_code == 200, response.text
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


GREEDY = {"model": "smollm2", "temperature": 0, "max_tokens": 8}
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_truncate_prompt_tokens_keeps_the_last_k(server) -> None:
    ids = list(range(1000, 1050))
    whole = _post(server, "/v1/completions", {**GREEDY, "prompt": ids[-10:],
                                              "return_token_ids": True})  # fmt: skip
    cut = _post(server, "/v1/completions", {**GREEDY, "prompt": ids, "truncate_prompt_tokens": 10,
                                            "return_token_ids": True})  # fmt: skip
    assert cut["usage"]["prompt_tokens"] == 10
    assert cut["choices"][0]["prompt_token_ids"] == ids[-10:]
    assert cut["choices"][0]["token_ids"] == whole["choices"][0]["token_ids"]
    chat = _post(server, "/v1/chat/completions", {**GREEDY, "messages": CHAT,
                                                  "truncate_prompt_tokens": 5})  # fmt: skip
    assert chat["usage"]["prompt_tokens"] == 5


def test_chat_echo_prepends_the_continued_message(server) -> None:
    start = "The capital of France is"
    body = {**GREEDY, "messages": [*CHAT, {"role": "assistant", "content": start}],
            "add_generation_prompt": False, "continue_final_message": True}  # fmt: skip
    plain = _post(server, "/v1/chat/completions", body)["choices"][0]["message"]
    echoed = _post(server, "/v1/chat/completions", {**body, "echo": True})["choices"][0]["message"]
    assert echoed["role"] == plain["role"] == "assistant"
    assert echoed["content"] == start + plain["content"]
    chunks = _sse(server, "/v1/chat/completions", {**body, "echo": True})
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert streamed == echoed["content"]
    # A new assistant turn (generation prompt) has nothing of the user's to echo.
    fresh = _post(server, "/v1/chat/completions", {**GREEDY, "messages": CHAT, "echo": True})
    assert not fresh["choices"][0]["message"]["content"].startswith(CHAT[0]["content"])


def test_tokenize_continue_final_message(server, tokenizer) -> None:
    messages = [*CHAT, {"role": "assistant", "content": "Paris is"}]
    expected = tokenizer.apply_chat_template(
        messages, continue_final_message=True, add_generation_prompt=False, tokenize=False
    )
    ids = tokenizer.encode(expected, add_special_tokens=False)
    got = _post(server, "/tokenize", {"messages": messages, "continue_final_message": True,
                                      "add_generation_prompt": False})  # fmt: skip
    assert got["tokens"] == ids and got["token_strs"] is None
    plain = _post(server, "/tokenize", {"messages": messages})
    assert plain["tokens"] != ids


def test_return_tokens_as_token_ids(server) -> None:
    out = _post(server, "/v1/completions", {**GREEDY, "prompt": "Hello", "logprobs": 2,
                                            "return_tokens_as_token_ids": True,
                                            "return_token_ids": True})  # fmt: skip
    choice = out["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(k.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"] for k in top)
    chat = _post(server, "/v1/chat/completions", {**GREEDY, "messages": CHAT, "logprobs": True,
                                                  "top_logprobs": 2, "return_token_ids": True,
                                                  "return_tokens_as_token_ids": True})  # fmt: skip
    choice = chat["choices"][0]
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(t["token"].startswith("token_id:") for c in content for t in c["top_logprobs"])


def test_stream_options_min_characters(server) -> None:
    body = {**GREEDY, "max_tokens": 24, "prompt": "The history of the printing press"}
    whole = _post(server, "/v1/completions", body)["choices"][0]["text"]
    chunks = _sse(server, "/v1/completions", {**body, "stream_options": {"min_characters": 12}})
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(texts) == whole
    assert all(len(t) >= 12 for t in texts[:-1]) and len(texts) < 24


def test_minus_one_logprobs_give_the_whole_vocabulary(smollm2_path, server, tokenizer) -> None:
    response = httpx.post(f"{server}/v1/completions", timeout=30,
                          json={**GREEDY, "prompt": "Hi", "logprobs": -1})  # fmt: skip
    assert response.status_code == 400 and "--max-logprobs -1" in response.text
    with running_server(smollm2_path, "--max-model-len", "128", "--max-logprobs", "-1") as (
        _,
        server,
    ):
        _check_whole_vocabulary(server, len(tokenizer))


def _check_whole_vocabulary(server: str, vocab: int) -> None:
    body = {**GREEDY, "max_tokens": 1, "messages": CHAT, "logprobs": True, "top_logprobs": -1}
    chat = _post(server, "/v1/chat/completions", body)
    assert len(chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) >= vocab - 1
    out = _post(server, "/v1/completions", {**GREEDY, "max_tokens": 1, "prompt": "Hi there",
                                            "prompt_logprobs": -1})  # fmt: skip
    positions = out["choices"][0]["prompt_logprobs"]
    assert positions[0] is None and all(len(p) >= vocab - 1 for p in positions[1:])


def test_any_role_and_no_model(server) -> None:
    messages = [{"role": "narrator", "content": "A quiet room."}, *CHAT]
    body = {"messages": messages, "max_tokens": 4, "temperature": 0}
    named = _post(server, "/v1/chat/completions", {**body, "model": "smollm2"})
    for model in (None, ""):
        unnamed = _post(server, "/v1/chat/completions", {**body, "model": model})
        assert unnamed["choices"][0]["message"] == named["choices"][0]["message"]


def test_invocations_dispatch_on_the_body(server) -> None:
    chat = {**GREEDY, "messages": CHAT}
    completion = {**GREEDY, "prompt": "Hello"}
    for body, path, key in ((chat, "/v1/chat/completions", "message"),
                            (completion, "/v1/completions", "text")):  # fmt: skip
        direct = _post(server, path, body)["choices"][0][key]
        assert _post(server, "/invocations", body)["choices"][0][key] == direct
    response = httpx.post(f"{server}/invocations", json={"model": "smollm2"}, timeout=30)
    assert response.status_code == 400 and "messages" in response.json()["error"]["message"]


def test_shapes_vllm_clients_read(server, client) -> None:
    completion = client.completions.create(model="smollm2", prompt="Hi", max_tokens=2)
    assert completion.choices[0].prompt_logprobs is None  # present, as null
    chat = _post(server, "/v1/chat/completions", {**GREEDY, "messages": CHAT})
    assert "prompt_logprobs" in chat and chat["prompt_logprobs"] is None
    (card,) = client.models.list().data
    assert card.id == "smollm2" and card.root == "SmolLM2-135M-Instruct"
    response = httpx.post(f"{server}/v1/completions", content=b"{}", timeout=30)
    error = response.json()["error"]["message"]
    assert response.status_code == 400 and not error.startswith("None")


def test_streamed_text_offsets_equal_the_whole_answer(server) -> None:
    # " the end" holds text back each time " the" comes: chunk texts lag their tokens.
    body = {**GREEDY, "max_tokens": 32, "prompt": "The history of the printing press",
            "logprobs": 1, "stop": [" the end of time"]}  # fmt: skip
    whole = _post(server, "/v1/completions", body)["choices"][0]["logprobs"]
    chunks = _sse(server, "/v1/completions", body)
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    held = [c["text"] != "".join(c["logprobs"]["tokens"]) for c in choices]
    assert any(held), "no chunk's text lagged its tokens: the case is not exercised"
    offsets = [o for c in choices for o in c["logprobs"]["text_offset"]]
    tokens = [t for c in choices for t in c["logprobs"]["tokens"]]
    assert tokens == whole["tokens"] and offsets == whole["text_offset"]


def test_use_beam_search_gives_hf_beams(server, smollm2_path, tokenizer) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    ids = tokenizer("The three primary colours are").input_ids
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    with torch.no_grad():
        hf = model.generate(torch.tensor([ids]), do_sample=False, num_beams=3,
                            num_return_sequences=3, max_new_tokens=12,
                            pad_token_id=tokenizer.eos_token_id)  # fmt: skip
    out = _post(server, "/v1/completions", {**GREEDY, "prompt": ids, "max_tokens": 12, "n": 3,
                                            "use_beam_search": True,
                                            "return_token_ids": True})  # fmt: skip
    assert [c["token_ids"] for c in out["choices"]] == [row[len(ids) :] for row in hf.tolist()]
    assert out["choices"][0]["text"] == tokenizer.decode(hf[0, len(ids) :])
    chat = _post(server, "/v1/chat/completions", {**GREEDY, "messages": CHAT, "n": 2,
                                                  "use_beam_search": True})  # fmt: skip
    assert len(chat["choices"]) == 2 and chat["choices"][0]["message"]["content"]
    streamed = {**GREEDY, "prompt": "Hi", "use_beam_search": True, "stream": True}
    response = httpx.post(f"{server}/v1/completions", json=streamed, timeout=30)
    assert response.status_code == 400 and "use_beam_search" in response.text


def _metrics(server: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(httpx.get(f"{server}/metrics").text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                              if k != "model_name")  # fmt: skip
            values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return values


def test_vllms_request_metrics(server) -> None:
    before = _metrics(server)
    sampled = {"max_tokens": 5, "n": 2, "temperature": 0.8, "seed": 1, "ignore_eos": True}
    _post(server, "/v1/completions", {**GREEDY, "prompt": "Hello", **sampled})
    _post(server, "/v1/completions", {**GREEDY, "prompt": "Hi", "max_tokens": 3,
                                      "ignore_eos": True})  # fmt: skip
    after = _metrics(server)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    p = "tokenmill:"
    assert grew(p + "request_params_n_count") == 2 and grew(p + "request_params_n_sum") == 3
    assert grew(p + "request_params_max_tokens_sum") == 8
    for phase in ("prefill", "decode", "inference"):  # one per sample: 2 + 1
        assert grew(f"{p}request_{phase}_time_seconds_count") == 3
    assert grew(p + "request_inference_time_seconds_sum") >= grew(
        p + "request_decode_time_seconds_sum"
    )
    # Every generated token (2 x 5 + 3) and both prompts' tokens pass through some step.
    assert grew(p + "iteration_tokens_total_sum") >= 13 + 2
    info = [k for k in after if k.startswith(p + "cache_config_info")]
    assert len(info) == 1 and "block_size=16" in info[0] and after[info[0]] == 1


# ------------------------------------------------------------- as vLLM's tests send them
def test_logit_bias_with_string_keys_as_clients_send_it(client) -> None:
    """JSON keys are strings: the openai client's logit_bias={"1000": 100} makes token 1000
    every token (vLLM's test_logits_bias), on both endpoints, streamed and not; -100 bans."""
    bias = {"logit_bias": {"1000": 100}, "max_tokens": 5, "temperature": 0,
            "extra_body": {"return_token_ids": True}}  # fmt: skip
    completion = client.completions.create(model="smollm2", prompt="Hello, my name is", **bias)
    assert completion.choices[0].token_ids == [1000] * 5
    chat = client.chat.completions.create(model="smollm2", messages=CHAT, **bias)
    assert chat.choices[0].token_ids == [1000] * 5
    for streamed in (
        client.completions.create(model="smollm2", prompt="Hello, my name is", stream=True,
                                  **bias),
        client.chat.completions.create(model="smollm2", messages=CHAT, stream=True, **bias),
    ):  # fmt: skip
        tokens = [t for chunk in streamed for c in chunk.choices for t in _extra(c, "token_ids")]
        assert tokens == [1000] * 5
    # A ban: the greedy answer's tokens at -100 never come back.
    greedy = client.completions.create(model="smollm2", prompt="Hello, my name is",
                                       max_tokens=5, temperature=0,
                                       extra_body={"return_token_ids": True})  # fmt: skip
    first = greedy.choices[0].token_ids
    banned = client.completions.create(
        model="smollm2", prompt="Hello, my name is", max_tokens=5, temperature=0,
        logit_bias={str(t): -100 for t in first}, extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert not set(banned.choices[0].token_ids) & set(first)


def _extra(obj, name: str) -> list:
    """A vLLM field of a client object (chat's first chunk, the role, has no token ids)."""
    return (obj.model_extra or {}).get(name) or []


def test_logit_bias_outside_the_vocabulary_names_its_size(client, tokenizer) -> None:
    vocab = len(tokenizer)
    for key in (str(vocab + 1), "-3"):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=2,
                                           logit_bias={key: 1})  # fmt: skip
        error = caught.value.body
        assert key in error["message"] and str(vocab) in error["message"], error
        assert error["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="smollm2", prompt="Hi", max_tokens=2,
                                  logit_bias={"not_a_token_id": 50})  # fmt: skip
    error = caught.value.body
    assert "not_a_token_id" in error["message"] and error["param"] == "logit_bias"
    # The largest id in the vocabulary is a token like any other.
    client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=2,
                                   logit_bias={str(vocab - 1): 1.0})  # fmt: skip


def test_truncation_side_chooses_the_tokens_kept(client) -> None:
    ids = list(range(1000, 1008))
    for side, kept in (("right", ids[:4]), ("left", ids[-4:]), (None, ids[-4:])):
        out = client.completions.create(
            model="smollm2", prompt=ids, max_tokens=1, temperature=0,
            extra_body={"return_token_ids": True, "truncate_prompt_tokens": 4,
                        "truncation_side": side},
        )  # fmt: skip
        assert out.choices[0].prompt_token_ids == kept, side
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="smollm2", prompt=ids, max_tokens=1,
                                  extra_body={"truncation_side": "middle"})  # fmt: skip
    assert caught.value.body["param"] == "truncation_side"


@pytest.mark.parametrize("chat", [True, False])
def test_invocations_answer_with_the_keys_of_the_endpoint(server, client, chat) -> None:
    """vLLM's test: the client's object of the direct answer and /invocations' JSON have
    the same keys, and the same choices."""
    if chat:
        args = {"model": "smollm2", "messages": CHAT, "max_completion_tokens": 5,
                "temperature": 0.0, "logprobs": False}  # fmt: skip
        direct = client.chat.completions.create(**args).model_dump()
    else:
        args = {"model": "smollm2", "prompt": "Hello", "max_tokens": 5, "temperature": 0.0}
        direct = client.completions.create(**args).model_dump()
    invoked = _post(server, "/invocations", args)
    assert direct.keys() == invoked.keys()
    assert direct["choices"] == invoked["choices"]


def test_min_characters_at_the_top_level_as_vllms_test_puts_it(client) -> None:
    """vLLM's chat stream test: every chunk's delta has text (the last one "" at least), and
    min_characters (here at the body's top level) merges chunks to 10 characters or more."""
    stream = client.chat.completions.create(
        model="smollm2", messages=CHAT, max_completion_tokens=10, temperature=0.0, stream=True,
        stream_options={"include_usage": False}, extra_body={"min_characters": 10},
    )  # fmt: skip
    pieces = [chunk.choices[0].delta.content for chunk in stream]
    assert all(isinstance(p, str) for p in pieces)
    whole = client.chat.completions.create(model="smollm2", messages=CHAT,
                                           max_completion_tokens=10, temperature=0.0)  # fmt: skip
    text = [p for p in pieces if p]
    assert "".join(text) == whole.choices[0].message.content and len("".join(text)) >= 10
    assert all(len(p) >= 10 for p in text[:-1])


def test_echo_with_token_ids_and_both_logprobs(client, tokenizer) -> None:
    """vLLM's test_comparison_with_prompt_logprobs_and_logprobs: the choice's text ends with
    its decoded token ids, and the logprobs cover the prompt and then the answer. (SmolLM2
    answers this prompt with EOS at once, a special token the text leaves out as vLLM's does:
    the answer is made to go on. Unlike vLLM, whose text leaves the echoed prompt out when
    token ids are returned, the text starts with the prompt, as echo says.)"""
    prompt = "Hello, world! How are you today?"
    completion = client.completions.create(
        model="smollm2", prompt=prompt, max_tokens=20, temperature=0, echo=True, logprobs=1,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True,
                    "prompt_logprobs": 1, "ignore_eos": True},
    )  # fmt: skip
    choice = completion.choices[0]
    assert len(choice.token_ids) == 20 and choice.text.startswith(prompt)
    assert choice.prompt_logprobs is not None and choice.logprobs is not None
    logprob_ids = [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
    assert logprob_ids == choice.prompt_token_ids + choice.token_ids
    assert "Hello, world" in tokenizer.decode(choice.prompt_token_ids)
    assert choice.text.endswith(tokenizer.decode(choice.token_ids, skip_special_tokens=True))


def test_chat_token_ids_as_logprob_names_decode_to_the_text(client, tokenizer) -> None:
    """vLLM's test_return_tokens_as_ids: the "token_id:N" names decode to the message, also
    when the answer ends inside a character that spans tokens (an emoji cut by max_tokens)."""
    messages = [{"role": "system", "content": "You like to respond in only emojis, like 🎉"},
                {"role": "user", "content": "Please write some emojis: 🐱🐶🎉"}]  # fmt: skip
    cut = 0
    for max_tokens in range(4, 10):
        response = client.chat.completions.create(
            model="smollm2", messages=messages, temperature=0, max_tokens=max_tokens,
            logprobs=True, extra_body={"return_tokens_as_token_ids": True},
        )  # fmt: skip
        choice = response.choices[0]
        ids = [int(c.token.removeprefix("token_id:")) for c in choice.logprobs.content]
        assert tokenizer.decode(ids, skip_special_tokens=True) == choice.message.content
        cut += choice.message.content.endswith("\ufffd")
    assert cut, "no answer ended inside a character: the case is not exercised"


def test_negative_seeds_are_seeds(client) -> None:
    """OpenAI and vLLM take any 64-bit seed: a negative one reproduces its samples."""
    args = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 8,
            "temperature": 1.0, "n": 2, "seed": -(2**63)}  # fmt: skip
    first, again = (client.completions.create(**args) for _ in range(2))
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    other = client.completions.create(**{**args, "seed": 7})
    assert [c.text for c in other.choices] != [c.text for c in first.choices]
