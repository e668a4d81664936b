"""`tokenmill serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn).

    tokenmill serve [MODEL] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [engine args]
    python -m tokenmill.frontend.server [MODEL] ...

Runs AsyncLLM in the server's own event loop: the engine core is spawned (or, with
`--engine-address`, an `engine-core` daemon is attached). Endpoints: /v1/models,
/v1/completions, /v1/chat/completions (streamed as server-sent events with `stream=true`),
/invocations (SageMaker's: either body), /tokenize, /detokenize, /health, /version, /metrics
(Prometheus). With an API key (or
TOKENMILL_API_KEY), every endpoint but /health asks for `Authorization: Bearer KEY`; a host
other than loopback is refused without one. If the engine dies, /health answers 503 and the
server exits with code 1 within seconds; SIGTERM stops new connections and lets requests in
flight finish for up to --shutdown-timeout seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import hmac
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

import tokenmill
from tokenmill.frontend.async_llm import AsyncLLM
from tokenmill.frontend.metrics import PrometheusStatLogger
from tokenmill.frontend.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tokenmill.frontend.server.serving import ServingError, _message_dict
from tokenmill.frontend.server.serving_chat import OpenAIServingChat
from tokenmill.frontend.server.serving_completion import OpenAIServingCompletion
from tokenmill.protocol import envs
from tokenmill.protocol.config import add_engine_args, engine_args_from
from tokenmill.protocol.default_model import DEFAULT_MODEL
from tokenmill.protocol.sockets import is_loopback_host
from tokenmill.protocol.utils import short_repr

logger = logging.getLogger("tokenmill.server")

HEALTH_TIMEOUT_S = 5.0  # a core that cannot answer a health check this fast is unhealthy
_LAG_PROBE_S = 0.01  # the event-loop lag probe's timer


def build_app(
    engine: AsyncLLM,
    model_name: str,
    api_key: str = "",
    stat_logger: PrometheusStatLogger | None = None,
    trust_request_chat_template: bool = False,
    model_root: str | None = None,
) -> FastAPI:
    """model_root: what /v1/models reports as the served model's root (the model as the
    user named it; by default its folder's name, never a path on this machine)."""
    root = model_root or os.path.basename(engine.model_config.model.rstrip("/"))
    completion = OpenAIServingCompletion(engine, model_name)
    chat_serving = OpenAIServingChat(engine, model_name, trust_request_chat_template)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        # Everything made so far (the tokenizer, the app, imported modules) lives as long as
        # the server: out of the collector's sight, a full collection no longer stalls the
        # loop for a fifth of a second under load.
        gc.collect()
        gc.freeze()
        probe = asyncio.ensure_future(_probe_loop_lag(stat_logger)) if stat_logger else None
        yield
        if probe is not None:
            probe.cancel()

    app = FastAPI(title="tokenmill", version=tokenmill.__version__, lifespan=lifespan)

    # ------------------------------------------------------------------ errors
    @app.exception_handler(ServingError)
    async def serving_error(_: Request, e: ServingError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(_validation_error(e).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:
        return JSONResponse(ServingError(str(e.detail), e.status_code).body(), e.status_code)

    @app.exception_handler(ValueError)
    async def value_error(_: Request, e: ValueError) -> JSONResponse:
        return JSONResponse(ServingError(str(e), 400).body(), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> JSONResponse:
        logger.exception("request failed")
        status = 503 if engine.dead is not None else 500
        return JSONResponse(
            ServingError(f"{type(e).__name__}: {e}", status).body(), status_code=status
        )

    if api_key:

        @app.middleware("http")
        async def authenticate(request: Request, call_next: Any) -> Response:
            if request.url.path != "/health" and not _authorized(request, api_key):
                error = ServingError("a valid API key is required (Authorization: Bearer)", 401)
                return JSONResponse(error.body(), status_code=401)
            return await call_next(request)

    # --------------------------------------------------------------- endpoints
    @app.get("/health")
    async def health() -> Response:
        """200 while the engine serves (empty, as vLLM's), 503 once it cannot. With data
        parallelism the body lists every rank's state, and says "degraded" while some rank
        is down (the others still serve)."""
        if engine.dead is not None:
            return Response(status_code=503)
        try:
            await asyncio.wait_for(engine.check_health(), HEALTH_TIMEOUT_S)
        except Exception:
            return Response(status_code=503)
        status = engine.data_parallel_status()
        if status is None:
            return Response(status_code=200)
        state = "ok" if status["ranks_up"] == status["size"] else "degraded"
        return JSONResponse({"status": state, "data_parallel": status})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": tokenmill.__version__}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": int(started),
                    "owned_by": "tokenmill",
                    "root": root,
                    "parent": None,
                    "max_model_len": engine.model_config.max_model_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return _respond(await completion.completions(body, raw))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request) -> Response:
        return _respond(await chat_serving.chat(body, raw))

    @app.post("/invocations")
    async def invocations(raw: Request) -> Response:
        """SageMaker's route: a chat body (with messages) or a completions body (with a
        prompt), told apart by its fields as vLLM does."""
        try:
            data = await raw.json()
        except ValueError as e:
            raise ServingError(f"the request body is not valid JSON: {e}", 400) from None
        if not isinstance(data, dict) or not ({"messages", "prompt"} & data.keys()):
            raise ServingError(
                "an /invocations body needs messages (chat) or prompt (completions)", 400
            )
        kind = ChatCompletionRequest if "messages" in data else CompletionRequest
        try:
            body = kind.model_validate(data)
        except pydantic.ValidationError as e:
            raise RequestValidationError(
                [{**err, "loc": ("body", *err["loc"])} for err in e.errors()]
            ) from None
        if isinstance(body, ChatCompletionRequest):
            return _respond(await chat_serving.chat(body, raw))
        return _respond(await completion.completions(body, raw))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        completion.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ServingError("give either prompt or messages", 400, "prompt")
        if body.messages is not None:
            messages = [_message_dict(m, i) for i, m in enumerate(body.messages)]
            prompt = await engine.encode_chat(
                messages,
                None,
                body.add_generation_prompt and not body.continue_final_message,
                continue_final_message=body.continue_final_message,
                **(body.chat_template_kwargs or {}),
            )
        else:
            assert body.prompt is not None
            prompt = await engine.encode_prompt(body.prompt, body.add_special_tokens)
        tokens = prompt["prompt_token_ids"]
        result: dict[str, Any] = {
            "count": len(tokens),
            "max_model_len": engine.model_config.max_model_len,
            "tokens": tokens,
            "token_strs": None,  # present as null when not asked for, as in vLLM
        }
        if body.return_token_strs:
            result["token_strs"] = engine.tokenizer.convert_ids_to_tokens(tokens)
        return result

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        completion.check_model(body.model)
        vocab = engine.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ServingError(f"tokens holds ids outside [0, {vocab}): {bad[:8]}", 400, "tokens")
        return {"prompt": await engine.decode(body.tokens)}

    @app.get("/metrics")
    async def metrics() -> Response:
        registry = stat_logger.registry if stat_logger is not None else None
        if stat_logger is not None:
            stat_logger.set_data_parallel(engine.data_parallel_status())
        body = generate_latest(registry) if registry is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    started = time.time()
    return app


def _respond(result: Any) -> Response:
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(
        result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


def _authorized(request: Request, api_key: str) -> bool:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    given = token.strip().encode("utf-8", "surrogateescape")
    return scheme.lower() == "bearer" and hmac.compare_digest(given, api_key.encode())


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


async def _probe_loop_lag(stat_logger: PrometheusStatLogger) -> None:
    """Measures how late a 10 ms timer fires: the loop's stalls (tokenizing, detokenizing,
    JSON) show up in tokenmill:event_loop_lag_seconds."""
    loop = asyncio.get_running_loop()
    while True:
        before = loop.time()
        await asyncio.sleep(_LAG_PROBE_S)
        stat_logger.on_loop_lag(max(loop.time() - before - _LAG_PROBE_S, 0.0))


# ------------------------------------------------------------------------ command line
def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, help="model folder (or --model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key", default=None, help="required from clients (default: TOKENMILL_API_KEY)"
    )
    parser.add_argument(
        "--served-model-name", default=None, help="the model's name in the API (default: path)"
    )
    parser.add_argument(
        "--engine-address", default=None, help="attach to a running engine-core daemon"
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds requests in flight get to finish",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests bring their own chat_template (rendered on the server)",
    )
    parser.add_argument("--log-level", default="info")
    parser.add_argument(
        "--disable-access-log", action="store_true", help="no log line per HTTP request"
    )
    add_engine_args(parser)


def serve(args: argparse.Namespace) -> int:
    """Runs the server until SIGTERM/SIGINT (exit code 0) or the engine's death (1)."""
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    api_key = args.api_key if args.api_key is not None else envs.TOKENMILL_API_KEY
    if not is_loopback_host(args.host) and not api_key:
        sys.exit(
            f"tokenmill serve: refusing to listen on {args.host} without an API key "
            "(pass --api-key or set TOKENMILL_API_KEY, or bind 127.0.0.1)"
        )
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            sys.exit(
                f"tokenmill serve: two models given: {args.model_tag} and --model {args.model}"
            )
        args.model = args.model_tag
    if args.engine_address is not None:
        engine = AsyncLLM(engine_address=args.engine_address)
    else:
        engine = AsyncLLM.from_engine_args(engine_args_from(args))
    # As given; the default model by its name, a daemon's by its folder's.
    model_name = (
        args.served_model_name
        or args.model
        or (DEFAULT_MODEL if args.engine_address is None else None)
        or os.path.basename(engine.model_config.model.rstrip("/"))
    )
    stat_logger = PrometheusStatLogger(model_name)
    cache = engine.config.cache_config
    stat_logger.set_cache_config(
        {
            "block_size": cache.block_size,
            "num_gpu_blocks": engine.num_blocks,
            "enable_prefix_caching": cache.enable_prefix_caching,
            "gpu_memory_utilization": cache.gpu_memory_utilization,
            "cache_dtype": engine.config.model_config.dtype,
        }
    )
    engine.stat_loggers.append(stat_logger)
    given = args.model or DEFAULT_MODEL
    root = os.path.basename(given.rstrip("/")) if os.path.exists(given) else given
    app = build_app(
        engine, model_name, api_key, stat_logger, args.trust_request_chat_template, root
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,  # type: ignore[arg-type]
        timeout_keep_alive=5,
        access_log=not args.disable_access_log,
    )
    server = uvicorn.Server(config)
    # uvicorn re-raises the SIGTERM (SIGINT) it handled once it has drained; by then the
    # default action (dying at once, or a KeyboardInterrupt) would skip the engine's shutdown
    # below and the exit code.
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    # uvicorn's choice of loop: uvloop where it is installed.
    loop_factory = config.get_loop_factory()
    try:
        if loop_factory is not None and sys.version_info >= (3, 11):
            with asyncio.Runner(loop_factory=loop_factory) as runner:
                return runner.run(_serve(server, engine))
        return asyncio.run(_serve(server, engine))
    finally:
        engine.shutdown()


async def _serve(server: Any, engine: AsyncLLM) -> int:
    watchdog = asyncio.ensure_future(_exit_on_engine_death(server, engine))
    try:
        await server.serve()
    finally:
        watchdog.cancel()
    return 1 if engine.dead is not None else 0


async def _exit_on_engine_death(server: Any, engine: AsyncLLM) -> None:
    while engine.dead is None:
        await asyncio.sleep(0.2)
    logger.error("the engine is dead (%s); the server exits", engine.dead)
    await asyncio.sleep(0.5)  # open streams send their error events
    server.should_exit = True
    server.force_exit = True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="tokenmill serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_serve_args(parser)
    sys.exit(serve(parser.parse_args(argv)))
