"""The models a server answers to (vLLM's OpenAIServingModels): the base model's name and the
LoRA adapters loaded on top of it, each `name -> LoRARequest` with an id from 1 upward.

build_app (server/app.py) makes one and hands it to every serving (serving.py resolves a
request's `model` here) and to the routes /v1/models (routes/models.py) and
/v1/load_lora_adapter, /v1/unload_lora_adapter (routes/lora.py). Adapters given with
--lora-modules are loaded at start-up (`init_static_loras`); loads and unloads run one at a
time, so that a name and its id stay paired with what the engine holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from dataclasses import dataclass
from typing import Any

from tokenmill.frontend.async_llm import AsyncLLM
from tokenmill.frontend.core_client import EngineDeadError
from tokenmill.frontend.server.serving import ServingError
from tokenmill.protocol.lora import LoRARequest

logger = logging.getLogger("tokenmill.server")


@dataclass(frozen=True)
class LoRAModulePath:
    """One adapter of --lora-modules: `name=path`, or vLLM's JSON form with an optional
    base_model_name (the /v1/models parent it reports, where it names the base model)."""

    name: str
    path: str
    base_model_name: str | None = None


class OpenAIServingModels:
    def __init__(
        self,
        engine: AsyncLLM,
        base_model_name: str,
        root: str,
        lora_modules: list[LoRAModulePath] | None = None,
    ) -> None:
        """root: what /v1/models reports as the base model's root (never a path on this
        machine); lora_modules: the adapters init_static_loras loads."""
        self.engine = engine
        self.base_model_name = base_model_name
        self.root = root
        self.static_lora_modules = list(lora_modules or [])
        self.lora_requests: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)  # never reused: the engine keys its caches by id
        self._lock = asyncio.Lock()

    async def init_static_loras(self) -> None:
        """Loads the --lora-modules adapters; the first that fails raises a ServingError
        naming it and the engine's reason."""
        for module in self.static_lora_modules:
            try:
                await self.load_lora_adapter(module.name, module.path, module.base_model_name)
            except ServingError as e:
                raise ServingError(
                    f"the LoRA adapter {module.name!r} ({module.path}) cannot be served: "
                    f"{e.message}",
                    e.status,
                ) from None

    # ------------------------------------------------------------------ requests
    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names, or None for the base model (also for a
        body without a model, or with "", as in vLLM); any other name is a 404."""
        if not model or model == self.base_model_name:
            return None
        lora = self.lora_requests.get(model)
        if lora is None:
            raise ServingError(
                f"The model `{model}` does not exist; this server serves "
                f"`{self.base_model_name}`{self._adapters_named()}.",
                404,
                "model",
            )
        return lora

    def model_name(self, lora_request: LoRARequest | None) -> str:
        """The `model` a response names: the adapter's, else the base model's."""
        return self.base_model_name if lora_request is None else lora_request.lora_name

    def _adapters_named(self) -> str:
        if not self.lora_requests:
            return ""
        return " and the LoRA adapters " + ", ".join(f"`{n}`" for n in self.lora_requests)

    def model_cards(self, created: int) -> list[dict[str, Any]]:
        """/v1/models' entries: the base model, then each adapter with its folder as root and
        its base model as parent (vLLM's ModelCard fields)."""
        base = self._card(self.base_model_name, created, self.root, None)
        base["max_model_len"] = self.engine.model_config.max_model_len
        adapters = [
            self._card(
                lora.lora_name,
                created,
                lora.lora_path,
                lora.base_model_name or self.base_model_name,
            )
            for lora in self.lora_requests.values()
        ]
        return [base, *adapters]

    @staticmethod
    def _card(name: str, created: int, root: str, parent: str | None) -> dict[str, Any]:
        # An adapter's max_model_len is null, as vLLM reports it (the base model's applies).
        return {"id": name, "object": "model", "created": created, "owned_by": "tokenmill",
                "root": root, "parent": parent, "max_model_len": None}  # fmt: skip

    # ------------------------------------------------------- loading, unloading
    async def load_lora_adapter(
        self,
        lora_name: str,
        lora_path: str,
        base_model_name: str | None = None,
        load_inplace: bool = False,
    ) -> str:
        """Loads an adapter into the engine's workers under a new id and makes its name
        servable; vLLM's answer on success, its error (a ServingError) otherwise. With
        load_inplace a loaded name is read again (from this path) and replaces the old
        adapter, whose requests in flight finish with it; a new id keeps the prefix cache's
        blocks of the old weights from being reused."""
        if not lora_name or not lora_path:
            raise ServingError(
                "Both 'lora_name' and 'lora_path' must be provided.", 400, None, "InvalidUserInput"
            )
        async with self._lock:
            replaced = self.lora_requests.get(lora_name)
            if replaced is not None and not load_inplace:
                raise ServingError(
                    f"The lora adapter '{lora_name}' has already been loaded. If you want to "
                    "load the adapter in place, set 'load_inplace' to True.",
                    400,
                    "lora_name",
                    "InvalidUserInput",
                )
            if lora_name == self.base_model_name:
                raise ServingError(
                    f"The lora adapter '{lora_name}' has the base model's name; requests "
                    "naming it would get the base model. Choose another lora_name.",
                    400,
                    "lora_name",
                    "InvalidUserInput",
                )
            parent = base_model_name if base_model_name == self.base_model_name else None
            lora = LoRARequest(
                lora_name=lora_name,
                lora_int_id=next(self._ids),
                lora_path=lora_path,
                base_model_name=parent,
            )
            try:
                await self.engine.add_lora(lora)
            except EngineDeadError:
                raise  # the engine's trouble, not the adapter's: a 503
            except TimeoutError:
                # The engine may still add it: removed again (the id is never reused).
                with contextlib.suppress(Exception):
                    await self.engine.remove_lora(lora.lora_int_id)
                raise
            except Exception as e:  # the folder refused (rank, weights, config), as vLLM: a 400
                # vLLM's one 404 among the load errors, for an adapter it cannot find at all.
                missing = "No adapter found" in str(e)
                raise ServingError(
                    str(e),
                    404 if missing else 400,
                    "lora_path",
                    "NotFoundError" if missing else "BadRequestError",
                ) from None
            self.lora_requests[lora_name] = lora
            if replaced is not None:
                await self.engine.remove_lora(replaced.lora_int_id)
        logger.info(
            "loaded LoRA adapter %r (id %d) from %s", lora_name, lora.lora_int_id, lora_path
        )
        return f"Success: LoRA adapter '{lora_name}' added successfully."

    async def unload_lora_adapter(self, lora_name: str | None, lora_int_id: int | None) -> str:
        """Forgets an adapter (named, or by its id) and frees its place in the engine;
        requests already running with it finish with it."""
        if not lora_name and lora_int_id is None:
            raise ServingError(
                "either 'lora_name' or 'lora_int_id' needs to be provided.",
                400,
                None,
                "InvalidUserInput",
            )
        async with self._lock:
            lora = self._find(lora_name, lora_int_id)
            try:
                await self.engine.remove_lora(lora.lora_int_id)
            except EngineDeadError:
                raise
            except Exception as e:  # the name stays served, as the engine still holds it
                raise ServingError(
                    f"Failed to remove lora adapter '{lora.lora_name}' from the engine: {e}",
                    500,
                    None,
                    "InternalServerError",
                ) from None
            del self.lora_requests[lora.lora_name]
        logger.info("removed LoRA adapter %r (id %d)", lora.lora_name, lora.lora_int_id)
        return f"Success: LoRA adapter '{lora.lora_name}' removed successfully."

    def _find(self, lora_name: str | None, lora_int_id: int | None) -> LoRARequest:
        """By name where one is given (as vLLM, which ignores the id then), else by id."""
        if lora_name:
            lora, what = self.lora_requests.get(lora_name), f"'{lora_name}'"
        else:
            by_id = (r for r in self.lora_requests.values() if r.lora_int_id == lora_int_id)
            lora, what = next(by_id, None), f"with lora_int_id {lora_int_id}"
        if lora is None:
            raise ServingError(
                f"The lora adapter {what} cannot be found.", 404, None, "NotFoundError"
            )
        return lora
