"""LoRA adapters in `tokenmill serve`, as vLLM serves them, driven by the official `openai`
client and raw HTTP: --lora-modules in both forms, /v1/models listing each adapter (root its
folder, parent the base model), a request's `model` choosing its adapter (greedy text unlike
the base model's and the other adapter's, the same whether sent alone or among others),
/v1/load_lora_adapter and /v1/unload_lora_adapter with vLLM's answers and errors, and the
routes' absence without TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING.

The base model is a small random Llama with SmolLM2's tokenizer (text prompts, a chat
template); the adapters are made here with `peft`, every projection targeted and B drawn
large enough to change the output. Whether an adapter's output is *right* is the engine's
tests' concern (against HF with peft); here, that the server routes each name to its
adapter. Every server started here is stopped at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys

import openai
import pytest
import torch
from helpers import httpx, running_server
from prometheus_client.parser import text_string_to_metric_families

peft = pytest.importorskip("peft")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "smollm2"  # running_server's --served-model-name
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_TOKENS = 16
PROMPTS = ["The sea is", "Once upon a time", "My favourite colour is"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
ENV = "TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING"


def tiny_config() -> LlamaConfig:
    # SmolLM2's vocabulary (its tokenizer serves the text), the rest in miniature.
    return LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        initializer_range=0.2,  # well-separated logits: few greedy near-ties
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


def make_adapter(folder, rank: int, seed: int) -> str:
    """A PEFT adapter folder for the tiny Llama; B ~ N(0, 0.5^2) (PEFT's zeros would leave
    the output unchanged)."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=MODULES)
    model = peft.get_peft_model(LlamaForCausalLM(tiny_config()), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn_like(param) * 0.5)
    model.save_pretrained(str(folder), safe_serialization=True)
    return str(folder)


@pytest.fixture(scope="module")
def paths(tmp_path_factory, smollm2_path) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora")
    base = root / "base"
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config()).float().save_pretrained(str(base), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(smollm2_path, name)):
            shutil.copy(os.path.join(smollm2_path, name), base / name)
    no_weights = make_adapter(root / "no_weights", 8, seed=4)
    os.remove(os.path.join(no_weights, "adapter_model.safetensors"))
    (root / "not_peft").mkdir()
    bad_config = make_adapter(root / "bad_config", 8, seed=5)
    with open(os.path.join(bad_config, "adapter_config.json"), "w") as f:
        f.write("this is not json")  # vLLM's test_dynamic_lora_invalid_files
    return {
        "base": str(base),
        "a8": make_adapter(root / "a8", 8, seed=1),
        "a16": make_adapter(root / "a16", 16, seed=2),
        "r32": make_adapter(root / "r32", 32, seed=3),
        "no_weights": no_weights,
        "not_peft": str(root / "not_peft"),
        "bad_config": bad_config,
    }


@pytest.fixture(scope="module")
def server(paths):
    """Both adapters served from the start (a16 in vLLM's JSON form), runtime updating on."""
    a16 = json.dumps({"name": "a16", "path": paths["a16"], "base_model_name": MODEL})
    flags = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
             "--max-cpu-loras", "8", "--lora-modules", f"a8={paths['a8']}", a16)  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, "1")  # read by the server at start-up
        with running_server(paths["base"], *flags) as (_, base):
            mp.delenv(ENV)
            yield base


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)


def complete(client: openai.OpenAI, model: str, prompt: str = PROMPTS[0]) -> str:
    out = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0
    )
    assert out.model == (model or MODEL)  # the name the request gave (else the base's)
    return out.choices[0].text


def post(server: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server}/v1/{route}", json=body, timeout=120)


def error_of(response: httpx.Response) -> dict:
    return response.json()["error"]


# ------------------------------------------------------------------------ serving
def test_models_lists_each_adapter_with_its_folder_and_base(client, paths) -> None:
    cards = client.models.list().data
    assert [c.id for c in cards] == [MODEL, "a8", "a16"]
    base, a8, a16 = cards
    assert base.root == "base" and base.parent is None
    assert base.model_extra["max_model_len"] == 1024
    assert (a8.root, a8.parent) == (paths["a8"], MODEL)
    assert (a16.root, a16.parent) == (paths["a16"], MODEL)


def test_each_adapter_changes_the_greedy_text(client) -> None:
    texts = {model: complete(client, model) for model in (MODEL, "a8", "a16")}
    assert len(set(texts.values())) == 3, texts
    assert complete(client, "") == texts[MODEL]  # no model: the base one, as in vLLM
    # Chat, whole and streamed, runs the adapter too.
    messages = [{"role": "user", "content": "Name a colour."}]
    chats = {}
    for model in (MODEL, "a8"):
        chat = client.chat.completions.create(
            model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0
        )
        assert chat.model == model
        chats[model] = chat.choices[0].message.content
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0, stream=True
        )
        streamed = "".join(
            chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices
        )
        assert streamed == chats[model]
    assert chats[MODEL] != chats["a8"]


def test_concurrent_requests_equal_each_sent_alone(client, server) -> None:
    alone = {(m, p): complete(client, m, p) for m in (MODEL, "a8", "a16") for p in PROMPTS}

    async def together() -> dict:
        aclient = openai.AsyncOpenAI(
            base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300
        )

        async def one(model: str, prompt: str) -> str:
            out = await aclient.completions.create(
                model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0
            )
            assert out.model == model
            return out.choices[0].text

        keys = list(alone) * 2  # each twice: base and both adapters in the same steps
        texts = await asyncio.gather(*(one(m, p) for m, p in keys))
        await aclient.close()
        return list(zip(keys, texts))

    for key, text in asyncio.run(together()):
        assert text == alone[key], key


def test_tokenize_and_metrics_know_the_adapters(server, client) -> None:
    # An adapter shares the base model's tokenizer.
    tokenized = httpx.post(f"{server}/tokenize", json={"model": "a8", "prompt": "Hello"})
    assert tokenized.status_code == 200 and tokenized.json()["count"] >= 1
    complete(client, "a16")
    text = httpx.get(f"{server}/metrics", timeout=10).text
    samples = [
        s
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "tokenmill:lora_requests_info"
    ]
    assert samples and all(s.labels["max_lora"] == "2" for s in samples)
    seen = {s.labels["running_lora_adapters"] for s in samples}
    assert any("a16" in names.split(",") for names in seen), seen


# ------------------------------------------------------------ load and unload
def test_load_use_unload_then_unknown(server, client, paths) -> None:
    a8_text = complete(client, "a8")
    loaded = client.post(
        "load_lora_adapter", cast_to=str, body={"lora_name": "dyn", "lora_path": paths["a8"]}
    )
    assert loaded == "Success: LoRA adapter 'dyn' added successfully."
    last = client.models.list().data[-1]
    assert (last.id, last.root, last.parent) == ("dyn", paths["a8"], MODEL)
    assert complete(client, "dyn") == a8_text  # the same weights under another name and id
    removed = client.post("unload_lora_adapter", cast_to=str, body={"lora_name": "dyn"})
    assert removed == "Success: LoRA adapter 'dyn' removed successfully."
    assert "dyn" not in [c.id for c in client.models.list().data]
    with pytest.raises(openai.NotFoundError, match="dyn"):
        complete(client, "dyn")
    # Loaded again (a new id), it serves again.
    post(server, "load_lora_adapter", {"lora_name": "dyn", "lora_path": paths["a16"]})
    assert complete(client, "dyn") == complete(client, "a16")
    # Loaded in place (vLLM's load_inplace): the name now serves the other adapter's weights.
    inplace = {"lora_name": "dyn", "lora_path": paths["a8"], "load_inplace": True}
    assert post(server, "load_lora_adapter", inplace).status_code == 200
    assert complete(client, "dyn") == a8_text
    assert [c.id for c in client.models.list().data].count("dyn") == 1
    assert post(server, "unload_lora_adapter", {"lora_name": "dyn"}).status_code == 200


def test_load_and_unload_errors_as_vllm_answers_them(server, client, paths) -> None:
    duplicate = post(server, "load_lora_adapter", {"lora_name": "a8", "lora_path": paths["a16"]})
    assert duplicate.status_code == 400
    assert error_of(duplicate)["message"] == (
        "The lora adapter 'a8' has already been loaded. If you want to load the adapter in "
        "place, set 'load_inplace' to True."
    )
    assert error_of(duplicate)["type"] == "InvalidUserInput"
    for body in (
        {"lora_name": "x"},
        {"lora_path": paths["a8"]},
        {"lora_name": "", "lora_path": ""},
    ):
        missing = post(server, "load_lora_adapter", body)
        assert missing.status_code == 400
        assert error_of(missing)["message"] == "Both 'lora_name' and 'lora_path' must be provided."
    for name, words in (
        ("r32", "max_lora_rank"),
        ("no_weights", "adapter_model.safetensors"),
        ("not_peft", "adapter_config.json"),
        ("bad_config", "JSON"),
    ):
        refused = post(server, "load_lora_adapter", {"lora_name": name, "lora_path": paths[name]})
        assert refused.status_code == 400, refused.text
        assert words in error_of(refused)["message"]
        assert error_of(refused)["type"] == "BadRequestError"
    gone = post(server, "load_lora_adapter", {"lora_name": "gone", "lora_path": "/no/such/dir"})
    assert gone.status_code == 404, gone.text
    assert (
        error_of(gone)["message"] == "Loading lora gone failed: No adapter found for /no/such/dir"
    )
    assert error_of(gone)["type"] == "NotFoundError"
    unknown = post(server, "unload_lora_adapter", {"lora_name": "nope"})
    assert unknown.status_code == 404
    assert error_of(unknown)["message"] == "The lora adapter 'nope' cannot be found."
    assert error_of(unknown)["type"] == "NotFoundError"
    assert post(server, "unload_lora_adapter", {}).status_code == 400
    by_id = post(server, "unload_lora_adapter", {"lora_int_id": 999})
    assert by_id.status_code == 404
    assert error_of(by_id)["message"] == "The lora adapter with lora_int_id 999 cannot be found."
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        complete(client, "r32")  # refused adapters are not served
    # Nothing refused changed what is served.
    assert [c.id for c in client.models.list().data] == [MODEL, "a8", "a16"]


def test_concurrent_loads_and_unloads_of_one_name(server, client, paths) -> None:
    async def race(route: str, body: dict, times: int) -> list[int]:
        async with httpx.AsyncClient(base_url=f"{server}/v1", timeout=120) as http:
            answers = await asyncio.gather(*(http.post(route, json=body) for _ in range(times)))
        return sorted(a.status_code for a in answers)

    body = {"lora_name": "raced", "lora_path": paths["a16"]}
    assert asyncio.run(race("/load_lora_adapter", body, 4)) == [200, 400, 400, 400]
    assert [c.id for c in client.models.list().data].count("raced") == 1
    assert complete(client, "raced") == complete(client, "a16")
    unload = {"lora_name": "raced"}
    assert asyncio.run(race("/unload_lora_adapter", unload, 3)) == [200, 404, 404]
    assert "raced" not in [c.id for c in client.models.list().data]


# --------------------------------------------------------------- own processes
def test_routes_absent_without_the_env_var(paths) -> None:
    env_before = os.environ.pop(ENV, None)
    try:
        with running_server(paths["base"], "--enable-lora") as (_, base):
            body = {"lora_name": "x", "lora_path": paths["a8"]}
            assert post(base, "load_lora_adapter", body).status_code == 404
            assert post(base, "unload_lora_adapter", {"lora_name": "x"}).status_code == 404
    finally:
        if env_before is not None:
            os.environ[ENV] = env_before


def test_lora_modules_need_enable_lora_and_must_load(paths) -> None:
    command = [sys.executable, "-m", "tokenmill.frontend.server", paths["base"],
               "--lora-modules", f"a8={paths['a8']}"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--lora-modules (a8) needs --enable-lora" in done.stderr
    bad = subprocess.run([*command[:4], "--enable-lora", "--lora-modules", "{not json"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 2 and "Invalid JSON format for --lora-modules" in bad.stderr
    # An adapter the engine refuses stops the start-up, naming it and why.
    big = subprocess.run(
        [*command[:4], "--enable-lora", "--max-lora-rank", "16", "--dtype", "float32",
         "--kv-cache-memory-bytes", str(32 << 20), "--lora-modules", f"big={paths['r32']}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert big.returncode == 1, big.stderr[-2000:]
    assert "the LoRA adapter 'big'" in big.stderr and "max_lora_rank 16" in big.stderr
