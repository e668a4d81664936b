"""`tokenmill serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn).

    tokenmill serve [MODEL] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [engine args]
        [--enable-lora --lora-modules NAME=PATH ...]
    python -m tokenmill.frontend.server [MODEL] ...

Runs AsyncLLM in the server's own event loop: the engine core is spawned (or, with
`--engine-address`, an `engine-core` daemon is attached). Endpoints: /v1/models,
/v1/completions, /v1/chat/completions (streamed as server-sent events with `stream=true`),
/invocations (SageMaker's: either body), /tokenize, /detokenize, /health, /version, /metrics
(Prometheus). A request's `model` may name a LoRA adapter of --lora-modules (listed in
/v1/models); with TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING=1, /v1/load_lora_adapter and
/v1/unload_lora_adapter add and remove adapters while serving. With an API key (or
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
import json
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI

import tokenmill
from tokenmill.frontend.async_llm import AsyncLLM
from tokenmill.frontend.metrics import PrometheusStatLogger
from tokenmill.frontend.server.auth import add_api_key_check
from tokenmill.frontend.server.errors import ERROR_HANDLERS
from tokenmill.frontend.server.routes import embeddings, generate, health, lora, models
from tokenmill.frontend.server.serving import ServingError
from tokenmill.frontend.server.serving_chat import OpenAIServingChat
from tokenmill.frontend.server.serving_completion import OpenAIServingCompletion
from tokenmill.frontend.server.serving_embedding import OpenAIServingEmbedding
from tokenmill.frontend.server.serving_models import LoRAModulePath, OpenAIServingModels
from tokenmill.frontend.server.state import ServerState
from tokenmill.frontend.server.tool_parsers import TOOL_PARSERS
from tokenmill.protocol import envs
from tokenmill.protocol.config import add_engine_args, engine_args_from
from tokenmill.protocol.default_model import DEFAULT_MODEL
from tokenmill.protocol.sockets import is_loopback_host

logger = logging.getLogger("tokenmill.server")

_LAG_PROBE_S = 0.01  # the event-loop lag probe's timer


def build_app(
    engine: AsyncLLM,
    model_name: str,
    api_key: str = "",
    stat_logger: PrometheusStatLogger | None = None,
    trust_request_chat_template: bool = False,
    model_root: str | None = None,
    chat_template: str | None = None,
    enable_auto_tools: bool = False,
    tool_parser: str | None = None,
    lora_modules: list[LoRAModulePath] | None = None,
) -> FastAPI:
    """The server's app: its routes (server/routes/), the error bodies (server/errors.py) and,
    with `api_key`, the key check (server/auth.py), over one ServerState. model_root: what
    /v1/models reports as the served model's root (the model as the user named it; by default
    its folder's name, never a path on this machine). chat_template, enable_auto_tools and
    tool_parser: the chat route's (--chat-template, --enable-auto-tool-choice,
    --tool-call-parser). lora_modules: the adapters served beside the model (--lora-modules),
    loaded by `load_static_loras` before the server listens."""
    pooling = engine.model_config.runner_type == "pooling"
    root = model_root or os.path.basename(engine.model_config.model.rstrip("/"))
    served = OpenAIServingModels(engine, model_name, root, lora_modules)
    state = ServerState(
        engine=engine,
        models=served,
        completion=OpenAIServingCompletion(engine, served),
        chat=OpenAIServingChat(
            engine,
            served,
            trust_request_chat_template,
            chat_template,
            enable_auto_tools,
            tool_parser,
        ),
        embedding=OpenAIServingEmbedding(engine, served, trust_request_chat_template, chat_template)
        if pooling
        else None,
        stat_logger=stat_logger,
        started=time.time(),
    )
    app = FastAPI(
        title="tokenmill",
        version=tokenmill.__version__,
        lifespan=_lifespan,
        exception_handlers=ERROR_HANDLERS,
    )
    app.state.server = state
    if api_key:
        add_api_key_check(app, api_key)
    app.include_router(health.router)
    app.include_router(models.router)
    # A pooling model embeds; a generating one generates (vLLM's routes by runner).
    app.include_router(embeddings.router if pooling else generate.router)
    if envs.TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING:
        logger.warning(
            "LoRA adapters may be loaded and unloaded at run time (/v1/load_lora_adapter): any "
            "client can make the server read a folder of this machine; use it on trusted "
            "networks only"
        )
        app.include_router(lora.router)
    return app


async def load_static_loras(app: FastAPI) -> bool:
    """Loads the app's --lora-modules adapters into the engine; False (logged, naming the
    adapter and the engine's reason) if one cannot be served."""
    state: ServerState = app.state.server
    state.engine.start()  # the engine's answers to add_lora come through its output task
    try:
        await state.models.init_static_loras()
    except ServingError as e:
        logger.error("tokenmill serve: --lora-modules: %s", e.message)
        return False
    return True


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: ServerState = app.state.server
    state.engine.start()
    # Everything made so far (the tokenizer, the app, imported modules) lives as long as
    # the server: out of the collector's sight, a full collection no longer stalls the
    # loop for a fifth of a second under load.
    gc.collect()
    gc.freeze()
    stat_logger = state.stat_logger
    probe = asyncio.ensure_future(_probe_loop_lag(stat_logger)) if stat_logger else None
    yield
    if probe is not None:
        probe.cancel()


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
    parser.add_argument(
        "--chat-template",
        default=None,
        help="a chat template (a file, or the template itself) over the model's own",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto": the tool parser turns answers into tool calls',
    )
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="how the model writes tool calls (for --enable-auto-tool-choice)",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        action=LoRAParserAction,
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) served beside the model, each named by a request's "
        'model: name=path, or vLLM\'s JSON {"name": ..., "path": ..., "base_model_name": ...} '
        "(needs --enable-lora)",
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
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        sys.exit("tokenmill serve: --enable-auto-tool-choice needs --tool-call-parser")
    if args.lora_modules and not args.enable_lora and args.engine_address is None:
        names = ", ".join(m.name for m in args.lora_modules)
        sys.exit(
            f"tokenmill serve: --lora-modules ({names}) needs --enable-lora (and --max-lora-rank "
            "at least the adapters' rank)"
        )
    chat_template = load_chat_template(args.chat_template)
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
    if engine.config.lora_config is not None:
        stat_logger.set_lora_config(engine.config.lora_config.max_loras)
    engine.stat_loggers.append(stat_logger)
    given = args.model or DEFAULT_MODEL
    root = os.path.basename(given.rstrip("/")) if os.path.exists(given) else given
    app = build_app(
        engine,
        model_name,
        api_key,
        stat_logger,
        args.trust_request_chat_template,
        root,
        chat_template,
        args.enable_auto_tool_choice,
        args.tool_call_parser,
        args.lora_modules,
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
                return runner.run(_serve(server, app, engine))
        return asyncio.run(_serve(server, app, engine))
    finally:
        engine.shutdown()


class LoRAParserAction(argparse.Action):
    """--lora-modules: each value `name=path`, or a JSON object with name, path and an
    optional base_model_name (vLLM's two forms)."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: Any = None
    ) -> None:
        modules = []
        for item in values:
            if not item:
                continue
            if "=" in item and "," not in item:  # name=path (a JSON object has commas)
                name, _, path = item.partition("=")
                modules.append(LoRAModulePath(name, path))
                continue
            try:
                fields = json.loads(item)
                modules.append(LoRAModulePath(**fields))
            except json.JSONDecodeError:
                parser.error(
                    f"Invalid JSON format for --lora-modules: {item} (give name=path or "
                    '{"name": ..., "path": ...})'
                )
            except TypeError as e:
                parser.error(f"Invalid fields for --lora-modules: {item} - {e}")
        setattr(namespace, self.dest, modules)


def load_chat_template(given: str | None) -> str | None:
    """--chat-template: a file's text, or (no such file, and it reads as a Jinja template)
    the template itself, as vLLM takes it."""
    if given is None:
        return None
    if os.path.isfile(given):
        with open(given, encoding="utf-8") as f:
            return f.read()
    if any(mark in given for mark in ("{{", "{%")):
        return given
    sys.exit(f"tokenmill serve: --chat-template {given!r} is neither a file nor a template")


async def _serve(server: Any, app: FastAPI, engine: AsyncLLM) -> int:
    if not await load_static_loras(app):
        return 1
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
