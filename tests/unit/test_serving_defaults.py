"""The server's sampling defaults (--generation-config): fields a body leaves out come from
the model's generation config, fields it sets win. Checked on OpenAIServing itself with a
stand-in engine (no model, no server)."""

from __future__ import annotations

from types import SimpleNamespace

from tokenmill.frontend.server.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.frontend.server.serving import OpenAIServing


def _serving(defaults: dict) -> OpenAIServing:
    config = SimpleNamespace(max_model_len=128, max_logprobs=20, vocab_size=100,
                             sampling_defaults=defaults)  # fmt: skip
    return OpenAIServing(SimpleNamespace(model_config=config), "m")  # type: ignore[arg-type]


def test_left_out_fields_come_from_the_generation_config() -> None:
    serving = _serving({"temperature": 0.3, "top_k": 7, "max_tokens": 9})
    body = CompletionRequest(prompt="x")
    params = serving.sampling_params(body, body.max_tokens, None, None)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.3, 7, 16)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_k=2)
    params = serving.sampling_params(chat, None, None, None)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.3, 2, 9)


def test_without_a_generation_config_the_engine_defaults_hold() -> None:
    body = CompletionRequest(prompt="x")
    params = _serving({}).sampling_params(body, body.max_tokens, None, None)
    assert (params.temperature, params.top_k, params.max_tokens) == (1.0, 0, 16)
