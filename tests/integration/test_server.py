"""`tokenmill serve` over real HTTP, driven by the official `openai` client (sync and async)
and by raw HTTP: greedy outputs equal LLM.generate token for token on SmolLM2, streaming,
n > 1 with seeds, stop strings, logprobs, JSON schemas, 64 concurrent streams, aborts on
disconnect, Prometheus metrics, OpenAI-format errors, the API key, SIGTERM draining, and the
server's exit when its engine core dies. Every server started here is stopped at the end."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import jsonschema
import openai
import psutil
import pytest
from helpers import PROMPTLY_S, httpx, running_daemon, running_server, smollm2_prompts
from prometheus_client.parser import text_string_to_metric_families

from tokenmill import SamplingParams

pytestmark = pytest.mark.slow

MODEL = "smollm2"
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Write a haiku about rain."]


@pytest.fixture(scope="module")
def server(smollm2_path):
    with running_server(smollm2_path) as (_, base):
        yield base


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def aclient_factory(server):
    return lambda: openai.AsyncOpenAI(
        base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300
    )


def extra(obj, name: str):
    return obj.model_extra[name]


def metric_values(base: str) -> dict[str, float]:
    """/metrics parsed by prometheus_client's own parser: sample name -> value."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = sample.value
    return values


# ------------------------------------------------------------------------ parity
def test_greedy_completions_equal_llm_generate(client, smollm2_llm) -> None:
    prompts = smollm2_prompts(smollm2_llm.get_tokenizer())
    offline = smollm2_llm.generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False
    )
    response = client.completions.create(
        model=MODEL,
        prompt=prompts,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert len(response.choices) == len(prompts)
    for choice, ref in zip(sorted(response.choices, key=lambda c: c.index), offline):
        assert extra(choice, "token_ids") == ref.outputs[0].token_ids
        assert choice.text == ref.outputs[0].text
        assert choice.finish_reason == ref.outputs[0].finish_reason
    assert response.usage.prompt_tokens == sum(map(len, prompts))
    assert response.usage.completion_tokens == sum(len(r.outputs[0].token_ids) for r in offline)


def test_greedy_chat_equals_llm_chat(client, smollm2_llm) -> None:
    for question in QUESTIONS:
        messages = [
            {"role": "system", "content": "You are brief."},
            {"role": "user", "content": question},
        ]
        (ref,) = smollm2_llm.chat(messages, GREEDY, use_tqdm=False)
        response = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_completion_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        (choice,) = response.choices
        assert choice.message.role == "assistant"
        assert choice.message.content == ref.outputs[0].text
        assert extra(choice, "token_ids") == ref.outputs[0].token_ids
        assert extra(response, "prompt_token_ids") == ref.prompt_token_ids
        assert response.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_streams_equal_whole_answers(client) -> None:
    whole = client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=MAX_TOKENS, temperature=0
    )
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="The quick brown fox",
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens

    messages = [{"role": "user", "content": QUESTIONS[0]}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    # continuous_usage_stats: every chunk counts the completion so far.
    counts = [c.usage.completion_tokens for c in chunks[:-1]]
    assert counts == sorted(counts) and counts[-1] == chunks[-1].usage.completion_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


# ------------------------------------------------------------- sampling features
def test_n_and_seed_async(aclient_factory) -> None:
    async def main():
        client = aclient_factory()
        messages = [{"role": "user", "content": "Tell me a story."}]
        kwargs = dict(model=MODEL, messages=messages, n=2, seed=7, max_tokens=16, temperature=1,
                      extra_body={"ignore_eos": True})  # fmt: skip
        first, second = await asyncio.gather(
            client.chat.completions.create(**kwargs),
            client.chat.completions.create(**kwargs),
        )
        streamed: dict[int, str] = {0: "", 1: ""}
        async for chunk in await client.chat.completions.create(**kwargs, stream=True):
            for choice in chunk.choices:
                streamed[choice.index] += choice.delta.content or ""
        await client.close()
        return first, second, streamed

    first, second, streamed = asyncio.run(main())
    texts = [c.message.content for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(first.choices, key=lambda c: c.index)] == [0, 1]
    assert texts == [c.message.content for c in sorted(second.choices, key=lambda c: c.index)]
    assert [streamed[0], streamed[1]] == texts
    assert first.usage.completion_tokens == 32


def test_stop_strings_as_llm_generate(client, smollm2_llm) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. The dog"
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=[" the", "."])
    (ref,) = smollm2_llm.generate([prompt], params, use_tqdm=False)
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[" the", "."]
    )
    (choice,) = response.choices
    assert choice.text == ref.outputs[0].text
    assert choice.finish_reason == "stop" and extra(choice, "stop_reason") in (" the", ".")
    assert " the" not in choice.text and "." not in choice.text


def test_logprobs_as_llm_generate(client, smollm2_llm) -> None:
    prompt = "def fibonacci(n):\n    "
    (ref,) = smollm2_llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=8, logprobs=3), use_tqdm=False
    )
    ref_out = ref.outputs[0]
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3
    )
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(ref_out.token_ids) == 8
    for i, (token_id, entry) in enumerate(zip(ref_out.token_ids, ref_out.logprobs)):
        assert logprobs.token_logprobs[i] == pytest.approx(entry[token_id].logprob, abs=1e-4)
        assert logprobs.tokens[i] == entry[token_id].decoded_token
        assert 3 <= len(logprobs.top_logprobs[i]) <= 4
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)

    messages = [{"role": "user", "content": QUESTIONS[1]}]
    (chat_ref,) = smollm2_llm.chat(
        messages, SamplingParams(temperature=0.0, max_tokens=8, logprobs=2), use_tqdm=False
    )
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    ref_out = chat_ref.outputs[0]
    assert len(content) == len(ref_out.token_ids)
    for item, token_id, entry in zip(content, ref_out.token_ids, ref_out.logprobs):
        assert item.logprob == pytest.approx(entry[token_id].logprob, abs=1e-4)
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.bytes == list(item.token.encode())

    echoed = client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=2, temperature=0, echo=True, logprobs=1
    )
    assert echoed.choices[0].text.startswith("Hello there")
    assert echoed.choices[0].logprobs.token_logprobs[0] is None
    assert len(echoed.choices[0].logprobs.tokens) == echoed.usage.total_tokens

    # Echo of a token prompt, streamed with n=2: each choice starts with the prompt's text and
    # the prompt's logprobs (the first position has none).
    tokenizer = smollm2_llm.get_tokenizer()
    ids = tokenizer.encode("The sea is")
    (scored,) = smollm2_llm.generate(
        [{"prompt_token_ids": ids}],
        SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0),
        use_tqdm=False,
    )
    firsts: dict[int, object] = {}
    for chunk in client.completions.create(
        model=MODEL, prompt=ids, max_tokens=3, n=2, temperature=1, seed=3, echo=True,
        logprobs=1, stream=True,
    ):  # fmt: skip
        for choice in chunk.choices:
            firsts.setdefault(choice.index, choice)
    assert sorted(firsts) == [0, 1]
    for choice in firsts.values():
        assert choice.text.startswith(tokenizer.decode(ids))
        lps = choice.logprobs.token_logprobs
        assert lps[0] is None and len(lps) >= len(ids)
        for position in range(1, len(ids)):
            expected = scored.prompt_logprobs[position][ids[position]].logprob
            assert lps[position] == pytest.approx(expected, abs=1e-4)


def test_response_format_json_schema(client) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give the largest city of Japan as JSON."}],
        max_tokens=120,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": schema},
        },
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), schema)


# ------------------------------------------------------------------ concurrency
def test_64_concurrent_streams_equal_offline(aclient_factory, smollm2_llm) -> None:
    tokenizer = smollm2_llm.get_tokenizer()
    texts = [f"Item {i}: the number {i * 7} written in words is" for i in range(56)]
    prompts = smollm2_prompts(tokenizer) + [tokenizer.encode(t) for t in texts]
    assert len(prompts) == 64
    params = SamplingParams(temperature=0.0, max_tokens=16)
    offline = smollm2_llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                   use_tqdm=False)  # fmt: skip

    async def one(client, prompt: list[int]) -> tuple[list[int], str]:
        ids: list[int] = []
        text = ""
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=16,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True},
        )
        async for chunk in stream:
            for choice in chunk.choices:
                ids += extra(choice, "token_ids")
                text += choice.text
        return ids, text

    async def main():
        client = aclient_factory()
        try:
            return await asyncio.gather(*(one(client, p) for p in prompts))
        finally:
            await client.close()

    results = asyncio.run(main())
    for (ids, text), ref in zip(results, offline):
        assert ids == ref.outputs[0].token_ids
        assert text == ref.outputs[0].text


def test_closed_stream_is_aborted_in_the_core(server) -> None:
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 800,
        "ignore_eos": True,
        "stream": True,
    }
    generated_before = metric_values(server)["tokenmill:generation_tokens_total"]
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server}/v1/completions", json=body) as response:
            assert response.status_code == 200
            chunks = 0
            for line in response.iter_lines():
                chunks += line.startswith("data: ")
                if chunks == 3:
                    break
    _wait_until_idle(server, "the streamed request still runs after the close")
    values = metric_values(server)
    # Stopped where it was, before its 800 tokens.
    assert 3 <= values["tokenmill:generation_tokens_total"] - generated_before < 800
    assert values["tokenmill:time_to_first_token_seconds_count"] > 0
    assert values["tokenmill:kv_cache_usage_perc"] >= 0.0

    # A whole (not streamed) answer whose client goes away while it runs is aborted too: the
    # connection closes once the request is seen running (not after a time, which a fast
    # machine could outrun).
    generated_before = values["tokenmill:generation_tokens_total"]
    payload = json.dumps({**body, "stream": False}).encode()
    host, port = server.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        started = time.monotonic()
        while metric_values(server)["tokenmill:num_requests_running"] == 0:
            assert time.monotonic() - started < PROMPTLY_S, "the request never ran"
            time.sleep(0.01)
    _wait_until_idle(server, "the whole-answer request still runs after the close")
    assert metric_values(server)["tokenmill:generation_tokens_total"] - generated_before < 800


def _wait_until_idle(server: str, why: str) -> None:
    closed = time.monotonic()
    while metric_values(server)["tokenmill:num_requests_running"] != 0:
        assert time.monotonic() - closed < PROMPTLY_S, why
        time.sleep(0.05)


# ------------------------------------------------------------------- raw HTTP
def test_sse_framing_over_raw_http(server) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 5, "temperature": 0, "stream": True}
    response = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    raw = response.text
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(event.startswith("data: ") and "\n" not in event for event in events)
    payloads = [json.loads(event[6:]) for event in events[:-1]]
    assert all(p["object"] == "text_completion" and p["id"] == payloads[0]["id"] for p in payloads)
    assert sum(len(p["choices"]) for p in payloads) == len(payloads)


def test_tokenize_detokenize_models_version(server, smollm2_llm) -> None:
    tokenizer = smollm2_llm.get_tokenizer()
    tokens = httpx.post(f"{server}/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["tokens"] == tokenizer.encode("Hello world")
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 1024
    text = httpx.post(f"{server}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "Hello world"}
    chat = httpx.post(
        f"{server}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}
    ).json()
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True
    )
    assert chat["tokens"] == list(getattr(expected, "input_ids", expected))
    models = httpx.get(f"{server}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    import tokenmill

    assert httpx.get(f"{server}/version").json() == {"version": tokenmill.__version__}


BAD_BODIES = [
    ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": 12.5}, 400, "prompt"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "gpt-4"),
    ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": [5] * 1100}, 400, "maximum context length is 1024"),
    ({"prompt": "hi", "max_tokens": 1024, "model": MODEL}, 400, "maximum context length"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "n": 0}, 400, "n must be"),
    ({"prompt": "hi", "logprobs": 99}, 400, "logprobs"),
    ({"prompt": "hi", "frobnicate": True}, 400, "frobnicate"),
    ({"prompt": "hi", "suffix": "!"}, 400, "suffix"),
    ({"prompt": [[1, 2], [99999999]]}, 400, "outside"),
    ({"prompt": [[1, 2], [99999999]], "stream": True}, 400, "outside"),  # before the stream
    ({"prompt": "hi", "logit_bias": {"99999999": 1}, "stream": True}, 400, "logit_bias"),
    ({"prompt": [[]]}, 400, "prompt"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
]


def test_bad_bodies_get_clear_errors_and_the_server_goes_on(server, client) -> None:
    for body, status, words in BAD_BODIES:
        response = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]
        assert words in error["message"], (body, error)
        assert error["code"] == status
    malformed = httpx.post(
        f"{server}/v1/completions",
        content=b'{"prompt": "hi",',
        headers={"content-type": "application/json"},
    )
    assert malformed.status_code == 400 and "JSON" in malformed.json()["error"]["message"]
    chat = httpx.post(
        f"{server}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "tools[0].function"
    template = httpx.post(
        f"{server}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 1 }}"},
    )
    assert template.status_code == 400 and "trust-request-chat-template" in template.text
    # A generating model has no embeddings route (a pooling model has no generating ones).
    assert httpx.post(f"{server}/v1/embeddings", json={"input": "hi"}).status_code == 404
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-5)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    # Still serving.
    ok = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens == 2


# --------------------------------------------------------- lifetimes, own servers
def test_api_key_and_sigterm_drain(smollm2_path) -> None:
    with running_server(smollm2_path, "--shutdown-timeout", "60", api_key="s3cret") as (
        proc,
        base,
    ):
        assert httpx.get(f"{base}/health").status_code == 200  # open to probes
        denied = httpx.get(f"{base}/v1/models")
        assert denied.status_code == 401 and "API key" in denied.json()["error"]["message"]
        wrong = httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="s3cret", max_retries=0)
        assert client.models.list().data[0].id == MODEL
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="bad", max_retries=0).models.list()

        latin = httpx.get(
            f"{base}/v1/models", headers={"Authorization": "Bearer caf\u00e9".encode("latin-1")}
        )
        assert latin.status_code == 401

        # SIGTERM while a stream runs: it finishes, then the server exits cleanly.
        body = {"model": MODEL, "prompt": "Once", "max_tokens": 40, "ignore_eos": True,
                "stream": True}  # fmt: skip
        headers = {"Authorization": "Bearer s3cret"}
        with httpx.Client(timeout=120) as http:
            with http.stream(
                "POST", f"{base}/v1/completions", json=body, headers=headers
            ) as response:
                lines = response.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                assert json.loads(first[6:])["choices"]
                proc.send_signal(signal.SIGTERM)
                rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        events = [json.loads(line[6:]) for line in [first, *rest[:-1]]]
        assert not [e for e in events if "error" in e], "the stream was cut, not drained"
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0


def test_killed_engine_core_fails_health_and_ends_the_server(smollm2_path) -> None:
    with running_server(smollm2_path) as (proc, base):
        server = psutil.Process(proc.pid)
        (core,) = [p for p in server.children() if "engine_core_proc" in " ".join(p.cmdline())]
        core.kill()
        deadline = time.monotonic() + PROMPTLY_S
        saw_503 = False
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                saw_503 |= httpx.get(f"{base}/health", timeout=2).status_code == 503
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        assert proc.poll() is not None, f"the server outlived its engine core by {PROMPTLY_S} s"
        assert proc.returncode != 0
        assert saw_503, "/health never answered 503 while the server went down"


def test_public_host_without_api_key_is_refused() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TOKENMILL_API_KEY"}
    result = subprocess.run(
        [sys.executable, "-m", "tokenmill.frontend.server", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode != 0
    assert "refusing to listen on 0.0.0.0 without an API key" in result.stderr


def test_server_attached_to_an_engine_core_daemon(smollm2_path) -> None:
    with running_daemon(smollm2_path, "--skip-tokenizer-init", "false", "--max-model-len",
                        "1024", kv_cache_bytes=256 << 20) as (daemon, address):  # fmt: skip
        with running_server(smollm2_path, "--engine-address", address) as (proc, base):
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
            response = client.completions.create(
                model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0
            )
            assert response.usage.completion_tokens == 4 and response.choices[0].text
        assert daemon.poll() is None, "the daemon must outlive a server attached to it"
