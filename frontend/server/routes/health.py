"""Routes for load balancers and monitoring: /health, /version and /metrics (Prometheus).

Included by build_app (server/app.py). They read the engine's state and the stat logger from
ServerState and touch no request; /health is the one route the API key does not guard
(server/auth.py).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import tokenmill
from tokenmill.frontend.server.state import State

HEALTH_TIMEOUT_S = 5.0  # a core that cannot answer a health check this fast is unhealthy

router = APIRouter()


@router.get("/health")
async def health(state: State) -> Response:
    """200 while the engine serves (empty, as vLLM's), 503 once it cannot. With data
    parallelism the body lists every rank's state, and says "degraded" while some rank
    is down (the others still serve)."""
    engine = state.engine
    if engine.dead is not None:
        return Response(status_code=503)
    try:
        await asyncio.wait_for(engine.check_health(), HEALTH_TIMEOUT_S)
    except Exception:
        return Response(status_code=503)
    status = engine.data_parallel_status()
    if status is None:
        return Response(status_code=200)
    health_state = "ok" if status["ranks_up"] == status["size"] else "degraded"
    return JSONResponse({"status": health_state, "data_parallel": status})


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": tokenmill.__version__}


@router.get("/metrics")
async def metrics(state: State) -> Response:
    stat_logger = state.stat_logger
    registry = stat_logger.registry if stat_logger is not None else None
    if stat_logger is not None:
        stat_logger.set_data_parallel(state.engine.data_parallel_status())
    body = generate_latest(registry) if registry is not None else b""
    return Response(body, media_type=CONTENT_TYPE_LATEST)
