"""The server's error bodies: every failure a route meets is answered as an OpenAI error JSON
(ServingError's body) with its status.

build_app (server/app.py) hands `ERROR_HANDLERS` to FastAPI: a ServingError keeps its status,
a body that does not validate and a ValueError are a 400 naming the field, Starlette's HTTP
errors (404, 405) keep theirs, and anything else is a 500, or a 503 once the engine is dead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

import pydantic
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from tokenmill.frontend.server.serving import ServingError
from tokenmill.frontend.server.state import ServerState
from tokenmill.protocol.utils import short_repr

# The server's own logger name (serving.py's too), as its log lines have always shown it.
logger = logging.getLogger("tokenmill.server")


async def serving_error(_: Request, e: ServingError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
    return JSONResponse(_validation_error(e).body(), status_code=400)


async def http_error(_: Request, e: HTTPException) -> JSONResponse:
    return JSONResponse(ServingError(str(e.detail), e.status_code).body(), e.status_code)


async def value_error(_: Request, e: ValueError) -> JSONResponse:
    return JSONResponse(ServingError(str(e), 400).body(), status_code=400)


async def internal_error(request: Request, e: Exception) -> JSONResponse:
    logger.exception("request failed")
    state: ServerState = request.app.state.server
    status = 503 if state.engine.dead is not None else 500
    return JSONResponse(ServingError(f"{type(e).__name__}: {e}", status).body(), status_code=status)


async def json_object(raw: Request) -> dict[str, Any]:
    """A route's body read by hand (one that picks its request type from the fields)."""
    try:
        data = await raw.json()
    except ValueError as e:
        raise ServingError(f"the request body is not valid JSON: {e}", 400) from None
    if not isinstance(data, dict):
        raise ServingError("the request body must be a JSON object", 400)
    return data


def validated(kind: type[BaseModel], data: dict[str, Any]) -> Any:
    """`data` as a `kind`; what does not validate is answered as FastAPI answers a body."""
    try:
        return kind.model_validate(data)
    except pydantic.ValidationError as e:
        raise RequestValidationError(
            [{**err, "loc": ("body", *err["loc"])} for err in e.errors()]
        ) from None


def _validation_error(e: RequestValidationError) -> ServingError:
    """The first problem of a body that does not validate, naming the field and value."""
    errors = e.errors()
    if not errors:
        return ServingError("the request body is not valid", 400)
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # A union type reports each alternative; the field is the first part of the location.
    field = ".".join(p for p in loc if not _is_type_name(p)) or None
    if first.get("type") == "json_invalid":
        return ServingError(f"the request body is not valid JSON: {first.get('msg')}", 400)
    if first.get("type") == "missing":
        return ServingError(f"{field} is required", 400, field)
    if first.get("type") == "extra_forbidden":
        return ServingError(f"{field} is not a field of this request", 400, field)
    value = first.get("input")
    if field is None:  # the body as a whole: not a JSON object (or sent without its type)
        return ServingError(
            f"the request body must be a JSON object sent with Content-Type: "
            f"application/json ({first.get('msg')}; got {short_repr(value)})",
            400,
        )
    return ServingError(f"{field}: {first.get('msg')} (got {short_repr(value)})", 400, field)


def _is_type_name(part: str) -> bool:
    return any(c in part for c in "[]()") or part in ("str", "int", "float", "bool", "list")


# FastAPI's type for a handler: the exception is Any, as each handler takes its own class.
ErrorHandler = Callable[[Request, Any], Coroutine[Any, Any, Response]]

# They take the place of FastAPI's own handlers for validation and HTTP errors.
ERROR_HANDLERS: dict[int | type[Exception], ErrorHandler] = {
    ServingError: serving_error,
    RequestValidationError: validation_error,
    HTTPException: http_error,
    ValueError: value_error,
    Exception: internal_error,
}
