"""/v1/embeddings, served by a pooling model (`--runner pooling`): a body with `input`
(vLLM's EmbeddingCompletionRequest) or with `messages` (EmbeddingChatRequest), told apart by
its fields as vLLM does. Included by build_app only for a pooling model, which has no
generating routes."""

from __future__ import annotations

import pydantic
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from tokenmill.frontend.server.protocol import EmbeddingChatRequest, EmbeddingCompletionRequest
from tokenmill.frontend.server.serving import ServingError
from tokenmill.frontend.server.state import State

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(raw: Request, state: State) -> JSONResponse:
    try:
        data = await raw.json()
    except ValueError as e:
        raise ServingError(f"the request body is not valid JSON: {e}", 400) from None
    if not isinstance(data, dict):
        raise ServingError("the request body must be a JSON object", 400)
    kind = EmbeddingChatRequest if "messages" in data else EmbeddingCompletionRequest
    try:
        body = kind.model_validate(data)
    except pydantic.ValidationError as e:
        raise RequestValidationError(
            [{**err, "loc": ("body", *err["loc"])} for err in e.errors()]
        ) from None
    assert state.embedding is not None  # (the route exists only for a pooling model)
    return JSONResponse(await state.embedding.embeddings(body, raw))
