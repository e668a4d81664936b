"""/v1/embeddings from `tokenmill serve --runner pooling` on SmolLM2, with the official `openai`
client and raw HTTP, against HF's AutoModel (fp32, the last hidden state of each text alone,
its last token's, L2-normalized: vLLM's default for a decoder converted to an embedder).

Strings, token ids, a chat, batches of mixed lengths, a prompt longer than the token budget
(chunked prefill), the same texts again (prefix-cache hits), truncate_prompt_tokens; base64
equals float; usage; vLLM's errors; a pooling server has no generating routes.
"""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import torch
from helpers import httpx, running_server
from transformers import AutoModel, AutoTokenizer

pytestmark = pytest.mark.slow

MODEL = "smollm2"
BUDGET = 128  # --max-num-batched-tokens: the long text runs in several chunks
SHORT = ["Hello", "The quick brown fox jumps over the lazy dog.", "Ünïcödé ☃ and 日本語"]
LONG = " ".join(f"Sentence number {i} says something about the sea and the sky." for i in range(40))
TEXTS = [*SHORT, LONG, "A mid-length text " * 12]


@pytest.fixture(scope="module")
def server(smollm2_path):
    flags = ("--runner", "pooling", "--max-num-batched-tokens", str(BUDGET))
    with running_server(smollm2_path, *flags) as (_, base):
        yield base


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def hf(smollm2_path):
    model = AutoModel.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)

    def embed(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
        return torch.nn.functional.normalize(hidden, dim=-1).numpy()

    return embed, tokenizer


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def assert_close(ours, reference) -> None:
    assert len(ours) == len(reference)
    assert cosine(ours, reference) >= 0.999
    assert abs(np.linalg.norm(ours) - 1.0) < 1e-4  # normalized


def metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(f"tokenmill:{name}") and not line.startswith("#")
    )


def test_texts_and_mixed_batches_equal_hf(server, client, hf) -> None:
    embed, tokenizer = hf
    assert len(tokenizer.encode(LONG)) > 3 * BUDGET  # chunked prefill
    response = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [d.index for d in response.data] == list(range(len(TEXTS)))
    lengths = [len(tokenizer.encode(t)) for t in TEXTS]
    for text, data in zip(TEXTS, response.data):
        assert_close(data.embedding, embed(tokenizer.encode(text)))
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(lengths)
    (one,) = client.embeddings.create(model=MODEL, input=SHORT[1]).data  # (base64 by default)
    assert_close(one.embedding, embed(tokenizer.encode(SHORT[1])))


def test_token_ids_and_prefix_hits_equal_hf(server, client, hf) -> None:
    embed, tokenizer = hf
    ids = [tokenizer.encode(t) for t in TEXTS]
    (single,) = client.embeddings.create(model=MODEL, input=ids[1]).data
    assert_close(single.embedding, embed(ids[1]))
    hits_before = metric(server, "prefix_cache_hits")
    # The same prompts again: their full blocks come from the prefix cache.
    for _ in range(2):
        batch = client.embeddings.create(model=MODEL, input=ids, encoding_format="float").data
        for row, data in zip(ids, batch):
            assert_close(data.embedding, embed(row))
    assert metric(server, "prefix_cache_hits") - hits_before >= len(ids[3]) // 2


def test_chat_messages_equal_hf_on_the_rendered_chat(server, hf) -> None:
    embed, tokenizer = hf
    messages = [{"role": "user", "content": "Embed this question, please."}]
    answer = httpx.post(f"{server}/v1/embeddings", json={"model": MODEL, "messages": messages})
    assert answer.status_code == 200, answer.text
    # vLLM's defaults for a chat to embed: no generation prompt, no tokenizer specials.
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    ids = tokenizer.encode(ids, add_special_tokens=False)
    body = answer.json()
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert_close(body["data"][0]["embedding"], embed(ids))


def test_base64_equals_float_and_the_response_shape(server) -> None:
    def post(encoding: str) -> dict:
        body = {"model": MODEL, "input": SHORT, "encoding_format": encoding}
        answer = httpx.post(f"{server}/v1/embeddings", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        return answer.json()

    floats, packed = post("float"), post("base64")
    for a, b in zip(floats["data"], packed["data"]):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        assert decoded.tolist() == np.asarray(a["embedding"], dtype=np.float32).tolist()
        assert a["object"] == "embedding"
    assert floats["object"] == "list" and floats["model"] == MODEL
    assert floats["id"].startswith("embd-")


def test_truncate_prompt_tokens_keeps_the_last_tokens(server, client, hf) -> None:
    embed, tokenizer = hf
    ids = tokenizer.encode(LONG)
    response = client.embeddings.create(
        model=MODEL, input=LONG, encoding_format="float",
        extra_body={"truncate_prompt_tokens": 50},
    )  # fmt: skip
    assert response.usage.prompt_tokens == 50
    assert_close(response.data[0].embedding, embed(ids[-50:]))


def test_errors_and_routes_of_a_pooling_server(server, client) -> None:
    with pytest.raises(openai.BadRequestError) as caught:  # not a Matryoshka model
        client.embeddings.create(model=MODEL, input="hi", dimensions=8)
    assert "matryoshka" in caught.value.body["message"]  # type: ignore[index]
    assert caught.value.body["param"] == "dimensions"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=MODEL, input="word " * 1100)
    assert "maximum context length" in caught.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=MODEL, input=[])
    assert caught.value.body["param"] == "input"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="hi")
    bad = httpx.post(f"{server}/v1/embeddings", json={"input": "hi", "encoding_format": "hex"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "encoding_format"
    # No generating routes on a pooling model; the model routes stay.
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(f"{server}/v1/chat/completions", json=chat).status_code == 404
    assert httpx.post(f"{server}/v1/completions", json={"prompt": "hi"}).status_code == 404
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.post(f"{server}/tokenize", json={"prompt": "hi"}).status_code == 200
