"""LoRA adapters loaded and unloaded at run time, as vLLM serves them: POST
/v1/load_lora_adapter {"lora_name", "lora_path"} and POST /v1/unload_lora_adapter
{"lora_name"} (or {"lora_int_id"}), answered with vLLM's plain-text success line.

build_app (server/app.py) includes this router only with TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING
set: without it the routes do not exist (404). The work, and the errors (ServingError, with
vLLM's status and type), are the served models' (server/serving_models.py).
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from tokenmill.frontend.server.state import State

router = APIRouter()


class LoadLoRAAdapterRequest(BaseModel):
    # Optional here so that a missing field gets vLLM's message (both must be given).
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False  # read a loaded name again, replacing it


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = ""
    lora_int_id: int | None = None


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, state: State) -> PlainTextResponse:
    message = await state.models.load_lora_adapter(
        body.lora_name, body.lora_path, load_inplace=body.load_inplace
    )
    return PlainTextResponse(message)


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, state: State) -> PlainTextResponse:
    message = await state.models.unload_lora_adapter(body.lora_name, body.lora_int_id)
    return PlainTextResponse(message)
