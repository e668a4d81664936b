"""The generating routes: /v1/completions, /v1/chat/completions and /invocations (SageMaker's,
either body).

Included by build_app (server/app.py); the OpenAI servings in ServerState do the work
(server/serving_completion.py, server/serving_chat.py). A serving's answer is a JSON body, or
an async iterator of server-sent events streamed back as text/event-stream.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.frontend.server.errors import json_object, validated
from tokenmill.frontend.server.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.frontend.server.serving import ServingError
from tokenmill.frontend.server.state import State

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, raw: Request, state: State) -> Response:
    return _respond(await state.completion.completions(body, raw))


@router.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, raw: Request, state: State) -> Response:
    return _respond(await state.chat.chat(body, raw))


@router.post("/invocations")
async def invocations(raw: Request, state: State) -> Response:
    """SageMaker's route: a chat body (with messages) or a completions body (with a
    prompt), told apart by its fields as vLLM does."""
    data = await json_object(raw)
    if not ({"messages", "prompt"} & data.keys()):
        raise ServingError(
            "an /invocations body needs messages (chat) or prompt (completions)", 400
        )
    body = validated(ChatCompletionRequest if "messages" in data else CompletionRequest, data)
    if isinstance(body, ChatCompletionRequest):
        return _respond(await state.chat.chat(body, raw))
    return _respond(await state.completion.completions(body, raw))


def _respond(result: Any) -> Response:
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(
        result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
