"""/v1/embeddings, served by a pooling model (`--runner pooling`): a body with `input`
(vLLM's EmbeddingCompletionRequest) or with `messages` (EmbeddingChatRequest), told apart by
its fields as vLLM does. Included by build_app only for a pooling model, which has no
generating routes."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tokenmill.frontend.server.errors import json_object, validated
from tokenmill.frontend.server.protocol import EmbeddingChatRequest, EmbeddingCompletionRequest
from tokenmill.frontend.server.state import State

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(raw: Request, state: State) -> JSONResponse:
    data = await json_object(raw)
    body = validated(
        EmbeddingChatRequest if "messages" in data else EmbeddingCompletionRequest, data
    )
    assert state.embedding is not None  # (the route exists only for a pooling model)
    return JSONResponse(await state.embedding.embeddings(body, raw))
