"""What every route of the server shares: the engine, the served models (the base model and
its LoRA adapters) and the OpenAI servings, in one `ServerState` that build_app
(server/app.py) puts on `app.state.server`. Routes (server/routes/) take it as a `State`
parameter; what it holds is fixed when the app is built, but for the adapters in `models`,
which /v1/load_lora_adapter and /v1/unload_lora_adapter change. A pooling model is served by
`embedding`; a generating one by `completion` and `chat` (/tokenize reads those for either).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from tokenmill.frontend.async_llm import AsyncLLM
from tokenmill.frontend.metrics import PrometheusStatLogger
from tokenmill.frontend.server.serving_chat import OpenAIServingChat
from tokenmill.frontend.server.serving_completion import OpenAIServingCompletion
from tokenmill.frontend.server.serving_embedding import OpenAIServingEmbedding
from tokenmill.frontend.server.serving_models import OpenAIServingModels


@dataclass(frozen=True)
class ServerState:
    engine: AsyncLLM
    models: OpenAIServingModels  # the names a request's `model` may give
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    embedding: OpenAIServingEmbedding | None  # a pooling model's (and then no chat, no completions)
    stat_logger: PrometheusStatLogger | None
    started: float  # when the app was built: the model's "created" in /v1/models


async def server_state(request: Request) -> ServerState:
    # A coroutine: FastAPI runs a plain function dependency on its thread pool, a thread hop
    # on every request.
    return request.app.state.server


State = Annotated[ServerState, Depends(server_state)]
