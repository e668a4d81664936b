"""The API-key check: with a key, every route but /health asks for `Authorization: Bearer KEY`.

build_app (server/app.py) adds it as HTTP middleware when the server has a key; a request
without the right one gets a 401 error body and never reaches a route.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.frontend.server.serving import ServingError


def add_api_key_check(app: FastAPI, api_key: str) -> None:
    @app.middleware("http")
    async def authenticate(request: Request, call_next: Any) -> Response:
        if request.url.path != "/health" and not _authorized(request, api_key):
            error = ServingError("a valid API key is required (Authorization: Bearer)", 401)
            return JSONResponse(error.body(), status_code=401)
        return await call_next(request)


def _authorized(request: Request, api_key: str) -> bool:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    given = token.strip().encode("utf-8", "surrogateescape")
    return scheme.lower() == "bearer" and hmac.compare_digest(given, api_key.encode())
