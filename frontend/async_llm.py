"""AsyncLLM: the asyncio engine front, for servers and concurrent callers.

`async for out in engine.generate(prompt, params, request_id)` yields a RequestOutput after
every engine step that gave the request new tokens (cumulative text and token ids, as vLLM's
default). Leaving the loop early, or cancelling the task, aborts the request in the core.
The engine core runs in its own process (spawned, or a daemon given by `engine_address`);
a thread waits for its outputs and hands them to the event loop, where all bookkeeping and
socket sends happen. If the core dies, every open stream raises EngineDeadError.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import weakref
from collections.abc import AsyncIterator
from typing import Any

from tokenmill.frontend.core_client import EngineDeadError, SyncMPClient
from tokenmill.frontend.input_processor import PromptType
from tokenmill.frontend.llm_engine import make_processors
from tokenmill.frontend.outputs import RequestOutput
from tokenmill.protocol import envs
from tokenmill.protocol.config import EngineArgs
from tokenmill.protocol.messages import EngineCoreOutputs, SamplingParams


class AsyncLLM:
    def __init__(
        self,
        model: str | None = None,
        engine_address: str | None = None,
        auth_token: str | None = None,
        **kwargs: Any,
    ) -> None:
        token = auth_token if auth_token is not None else envs.TOKENMILL_AUTH_TOKEN
        if engine_address is None:
            self.client = SyncMPClient(EngineArgs(model=model, **kwargs).create_engine_config())
        else:
            self.client = SyncMPClient(None, engine_address, token)
        self.config = self.client.engine_config
        self.tokenizer, self.input_processor, self.output_processor = make_processors(
            self.config.model_config
        )
        self.streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self.dead: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()

    def _start(self) -> None:
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
            threading.Thread(
                target=_pump,
                args=(weakref.ref(self), self.client, self.loop),
                daemon=True,
                name="async-llm-outputs",
            ).start()

    def _dispatch(self, outputs: EngineCoreOutputs) -> None:
        results, stopped = self.output_processor.process_outputs(outputs.outputs)
        if stopped:
            self.client.abort_requests(stopped)
        for result in results:
            stream = self.streams.get(result.request_id)
            if stream is not None:
                stream.put_nowait(result)

    def _fail_all(self, error: BaseException) -> None:
        self.dead = error
        for stream in self.streams.values():
            stream.put_nowait(error)

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        self._start()
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        request_id = request_id if request_id is not None else f"async-{next(self._ids)}"
        if request_id in self.streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        request, text = self.input_processor.process(request_id, prompt, sampling_params, priority)
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.streams[request_id] = stream
        finished = False
        try:
            self.client.add_requests(self.output_processor.add_request(request, text))
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            del self.streams[request_id]
            if not finished:  # cancelled or abandoned: stop spending compute on it
                core_ids = self.output_processor.abort_requests([request_id])
                if self.dead is None:
                    self.client.abort_requests(core_ids)

    async def abort(self, request_id: str) -> None:
        self.client.abort_requests(self.output_processor.abort_requests([request_id]))
        stream = self.streams.get(request_id)
        if stream is not None:
            stream.put_nowait(asyncio.CancelledError(f"request {request_id} was aborted"))

    async def get_stats(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.client.call_utility, "get_stats")

    async def check_health(self) -> bool:
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        return await asyncio.to_thread(self.client.call_utility, "check_health")

    def shutdown(self) -> None:
        self.client.shutdown()


def _pump(
    engine_ref: weakref.ref[AsyncLLM], client: SyncMPClient, loop: asyncio.AbstractEventLoop
) -> None:
    """Waits for the core's outputs off the event loop and hands them over. Holds the engine
    only weakly: once it is garbage, the core is shut down."""
    while True:
        try:
            outputs = client.get_output(timeout=0.2)
        except EngineDeadError as e:
            engine = engine_ref()
            if engine is not None:
                try:
                    loop.call_soon_threadsafe(engine._fail_all, e)
                except RuntimeError:  # the event loop was closed: nobody is listening
                    pass
            return
        engine = engine_ref()
        if engine is None:
            client.shutdown()
            return
        if outputs is not None:
            try:
                loop.call_soon_threadsafe(engine._dispatch, outputs)
            except RuntimeError:  # the event loop was closed: nobody is listening
                return
        del engine
