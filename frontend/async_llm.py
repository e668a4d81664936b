"""AsyncLLM: the asyncio engine front, for servers and concurrent callers.

`async for out in engine.generate(prompt, params, request_id)` yields a RequestOutput after
every engine step that gave the request new tokens (cumulative text and token ids by
default; `output_kind` asks for deltas or the final output only). Leaving the loop early, or
cancelling the task, aborts the request in the core at once. On a pooling model
`engine.encode(prompt, pooling_params, request_id)` yields the prompt's one
PoolingRequestOutput instead.

The engine core runs in its own process (spawned, or a daemon given by `engine_address`),
reached through an AsyncEngineCoreClient (frontend/async_core_client.py) whose sockets the
event loop reads itself. One task takes the core's outputs, detokenizes them in chunks
(yielding to the loop between chunks, so that hundreds of streams never stall it for long)
and hands them to the streams. Prompts are tokenized (and chat templates rendered) on one
worker thread, off the loop. If the core dies, every open stream raises EngineDeadError, and
so does every later call.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import weakref
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from tokenmill.frontend.async_core_client import AsyncEngineCoreClient
from tokenmill.frontend.core_client import EngineDeadError
from tokenmill.frontend.input_processor import PromptType, render_chat
from tokenmill.frontend.llm_engine import LORA_TIMEOUT_S, make_processors, preload_tokenizer
from tokenmill.frontend.outputs import PoolingRequestOutput, RequestOutput
from tokenmill.protocol import envs
from tokenmill.protocol.config import EngineArgs, EngineConfig
from tokenmill.protocol.lora import LoRARequest
from tokenmill.protocol.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    PoolingParams,
    SamplingParams,
    SchedulerStats,
)

logger = logging.getLogger(__name__)

# Outputs detokenized between two yields to the event loop (vLLM processes them in chunks
# of the same size).
OUTPUT_CHUNK_SIZE = 128

Stream = asyncio.Queue  # of RequestOutput, or the exception that ends the stream


class AsyncLLM:
    def __init__(
        self,
        model: str | None = None,
        engine_address: str | None = None,
        auth_token: str | None = None,
        stat_loggers: list[Any] | None = None,
        **kwargs: Any,
    ) -> None:
        token = auth_token if auth_token is not None else envs.TOKENMILL_AUTH_TOKEN
        if engine_address is None:
            config: EngineConfig | None = EngineArgs(model=model, **kwargs).create_engine_config()
            tokenizer = preload_tokenizer(config, multiprocess=True)
        else:
            if kwargs:
                raise TypeError(
                    f"engine arguments {sorted(kwargs)} belong to the engine-core daemon at "
                    f"{engine_address}, not to a client that connects to it"
                )
            config, tokenizer = None, None
        self.client: AsyncEngineCoreClient = AsyncEngineCoreClient.make_async_client(
            config, engine_address, token
        )
        self.config = self.client.engine_config
        self.model_config = self.config.model_config
        self.num_blocks = self.client.ready.num_blocks  # the KV cache's, as the core sized it
        self.tokenizer, self.input_processor, self.output_processor = make_processors(
            self.config, tokenizer
        )
        # Stat loggers get `on_request`, `on_abort` and `on_outputs` calls (frontend/metrics.py).
        self.stat_loggers = list(stat_loggers or [])
        self.streams: dict[str, Stream] = {}
        self.scheduler_stats = SchedulerStats()  # as of the core's latest message
        self.dead: BaseException | None = None
        self._ids = itertools.count()
        self._handler: asyncio.Task | None = None
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._finalizer = weakref.finalize(self, _shutdown, self.client, self._tokenizer_thread)

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, stat_loggers: list[Any] | None = None
    ) -> AsyncLLM:
        kwargs = {k: getattr(engine_args, k) for k in EngineArgs.field_names()}
        return cls(stat_loggers=stat_loggers, **kwargs)

    # ------------------------------------------------------------------------ requests
    async def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> tuple[EngineCoreRequest, str | None]:
        """The request for the core and its prompt text, tokenized and checked off the
        loop; a bad prompt or parameter raises ValueError here, before anything is sent
        (a server answers 400 before it starts a stream). SamplingParams make a request for
        generate() (a generative model's), PoolingParams one for encode() (a pooling
        model's: its dimensions are checked against the model's Matryoshka sizes here)."""
        return await self._run_off_loop(
            self.input_processor.process, request_id, prompt, params, priority, lora_request
        )

    async def generate(
        self,
        prompt: PromptType | EngineCoreRequest,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        prompt_text: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams a request's outputs. `prompt` is a prompt, or a request made by
        process_inputs() (then its own id, parameters, priority and adapter apply, and
        `prompt_text` is the text shown in its outputs). `lora_request`: the LoRA adapter it
        runs (enable_lora). A pooling model refuses (ValueError)."""
        self._require_runner("generate", "AsyncLLM.generate()")
        if not isinstance(prompt, EngineCoreRequest) and sampling_params is None:
            raise TypeError("generate() needs sampling_params for a prompt")
        stream = self._stream(
            prompt, sampling_params, request_id, priority, prompt_text, lora_request
        )
        async with contextlib.aclosing(stream):  # leaving early aborts at once
            async for output in stream:
                yield output

    async def encode(
        self,
        prompt: PromptType | EngineCoreRequest,
        pooling_params: PoolingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        truncate_prompt_tokens: int | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[PoolingRequestOutput]:
        """A pooling model's vector for one prompt (vLLM's AsyncLLM.encode): yields one
        PoolingRequestOutput, finished (`outputs.data` a float32 tensor; `error` set, and
        the vector empty, where the engine rejected the request). `prompt` is a prompt (a
        string, {"prompt_token_ids": [...]}, or encode_chat()'s rendering), or a request
        made by process_inputs() with PoolingParams (its own id, parameters and priority
        apply). pooling_params None: PoolingParams() (the model's defaults);
        truncate_prompt_tokens: keep the prompt's last k tokens (-1: max_model_len) where
        pooling_params set none. Bad parameters (dimensions a model does not support, say)
        raise ValueError before anything is sent; a generative model refuses likewise."""
        self._require_runner("pooling", "AsyncLLM.encode()")
        params = pooling_params if pooling_params is not None else PoolingParams()
        if truncate_prompt_tokens is not None and params.truncate_prompt_tokens is None:
            params = msgspec.structs.replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
        stream = self._stream(prompt, params, request_id, priority, None, lora_request)
        async with contextlib.aclosing(stream):  # leaving early aborts at once
            async for output in stream:
                yield output

    def _require_runner(self, runner_type: str, method: str) -> None:
        """vLLM's refusal of a method the model's runner does not serve."""
        if self.model_config.runner_type != runner_type:
            kind = "generative" if runner_type == "generate" else "pooling"
            raise ValueError(
                f"{method} is only supported for {kind} models. Try passing "
                f"`--runner {runner_type}` to use the model as a {kind} model."
            )

    async def _stream(
        self,
        prompt: PromptType | EngineCoreRequest,
        params: SamplingParams | PoolingParams | None,
        request_id: str | None,
        priority: int,
        prompt_text: str | None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[Any]:
        """Sends one request and yields its outputs until it is finished; leaving early
        aborts it in the core."""
        self.start()
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        arrival = time.monotonic()
        if isinstance(prompt, EngineCoreRequest):
            request, text = prompt, prompt_text
            request_id = request.request_id
        else:
            assert params is not None
            request_id = request_id if request_id is not None else f"async-{next(self._ids)}"
            request, text = await self.process_inputs(
                request_id, prompt, params, priority, lora_request
            )
            if self.dead is not None:  # died while the prompt was tokenized
                raise EngineDeadError(str(self.dead))
        if request_id in self.streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream: Stream = asyncio.Queue()
        self.streams[request_id] = stream
        finished = False
        try:
            core_requests = self.output_processor.add_request(request, text)
            sampling = request.sampling_params
            for stat_logger in self.stat_loggers:
                stat_logger.on_request(
                    [r.request_id for r in core_requests],
                    len(request.prompt_token_ids),
                    arrival,
                    1 if sampling is None else sampling.n,
                    None if sampling is None else sampling.max_tokens,
                )
            self.client.add_requests(core_requests)
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            del self.streams[request_id]
            if not finished:  # cancelled or abandoned: stop spending compute on it
                self._abort([request_id])

    async def encode_prompt(self, text: str, add_special_tokens: bool = True) -> dict[str, Any]:
        """A text prompt tokenized (off the loop), as a token prompt for generate()."""
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer (skip_tokenizer_init=True has none)")
        ids = await self._run_off_loop(
            lambda: self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        )
        return {"prompt": text, "prompt_token_ids": ids}

    async def decode(self, token_ids: list[int]) -> str:
        """Token ids as text (off the loop)."""
        if self.tokenizer is None:
            raise ValueError("decoding needs a tokenizer (skip_tokenizer_init=True has none)")
        return await self._run_off_loop(self.tokenizer.decode, token_ids)

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> dict[str, Any]:
        """A chat rendered with the model's template (`tools` handed to it), as a token
        prompt for generate()."""
        return await self._run_off_loop(
            render_chat,
            self.tokenizer,
            messages,
            chat_template,
            add_generation_prompt,
            template_kwargs,
            add_special_tokens,
            tools,
        )

    async def _run_off_loop(self, fn: Callable, *args: Any) -> Any:
        """Runs tokenizer work on the one tokenizer thread (tokenizers are not safe to use
        from several threads at once), leaving the event loop free."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_thread, fn, *args)

    def _abort(self, request_ids: list[str]) -> None:
        core_ids = self.output_processor.abort_requests(request_ids)
        for stat_logger in self.stat_loggers:
            stat_logger.on_abort(core_ids)
        if self.dead is None:
            self.client.abort_requests(core_ids)

    async def abort(self, request_id: str) -> None:
        """Aborts a request; its stream (if any is open) ends with CancelledError."""
        self._abort([request_id])
        stream = self.streams.get(request_id)
        if stream is not None:
            stream.put_nowait(asyncio.CancelledError(f"request {request_id} was aborted"))

    # ------------------------------------------------------------------------- outputs
    def start(self) -> None:
        """Starts taking the core's outputs on the running loop (generate() does it too), so
        that a core's death is noticed without any request in flight."""
        loop = asyncio.get_running_loop()
        if self._handler is None or self._handler.get_loop() is not loop:
            self._handler = loop.create_task(
                _output_handler(weakref.ref(self), self.client), name="async-llm-outputs"
            )

    async def _dispatch(self, outputs: EngineCoreOutputs) -> None:
        if outputs.scheduler_stats is not None:
            self.scheduler_stats = outputs.scheduler_stats
        for stat_logger in self.stat_loggers:
            stat_logger.on_outputs(outputs)
        items = outputs.outputs
        for start in range(0, len(items), OUTPUT_CHUNK_SIZE):
            if start:
                await asyncio.sleep(0)  # let the loop serve others between chunks
            chunk = items[start : start + OUTPUT_CHUNK_SIZE]
            try:
                results, stopped = self.output_processor.process_outputs(chunk)
            except Exception as e:  # fail these requests, not every stream
                logger.exception("could not process the engine core's outputs")
                self._fail_requests([out.request_id for out in chunk], e)
                continue
            if stopped:  # ended here by a stop string: still running in the core
                self.client.abort_requests(stopped)
                for stat_logger in self.stat_loggers:
                    stat_logger.on_finished(stopped)
            for result in results:
                stream = self.streams.get(result.request_id)
                if stream is not None:
                    stream.put_nowait(result)

    def _fail_all(self, error: BaseException) -> None:
        self.dead = error
        for stream in self.streams.values():
            stream.put_nowait(error)

    def _fail_requests(self, core_ids: list[str], error: Exception) -> None:
        parents = self.output_processor.parent_of
        user_ids = {parents.get(core_id, core_id) for core_id in core_ids}
        self._abort(list(user_ids))
        for user_id in user_ids:
            stream = self.streams.get(user_id)
            if stream is not None:
                stream.put_nowait(RuntimeError(f"processing the outputs failed: {error!r}"))

    # ---------------------------------------------------------------------- utilities
    @property
    def errored(self) -> bool:
        return self.dead is not None

    async def get_stats(self) -> dict[str, Any]:
        return await self.client.call_utility_async("get_stats")

    async def check_health(self) -> bool:
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        return await self.client.call_utility_async("check_health")

    async def reset_prefix_cache(self) -> bool:
        return await self.client.call_utility_async("reset_prefix_cache")

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Reads the adapter into the workers now (vLLM's add_lora); False if it was there. A
        ValueError says why it cannot run."""
        return await self.client.call_utility_async(
            "add_lora", lora_request, timeout=LORA_TIMEOUT_S
        )

    async def remove_lora(self, lora_id: int) -> bool:
        return await self.client.call_utility_async("remove_lora", lora_id, timeout=LORA_TIMEOUT_S)

    async def list_loras(self) -> set[int]:
        return set(await self.client.call_utility_async("list_loras"))

    def data_parallel_status(self) -> dict[str, Any] | None:
        """Each data-parallel rank's state and the failover counts (None without DP)."""
        return self.client.data_parallel_status()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def shutdown(self) -> None:
        """Stops the engine core (a spawned one) and ends every open stream with
        EngineDeadError."""
        if self._handler is not None:
            self._handler.cancel()
        if self.dead is None:
            self._fail_all(EngineDeadError("the engine was shut down"))
        self._finalizer()


async def _output_handler(engine_ref: weakref.ref[AsyncLLM], client: AsyncEngineCoreClient) -> None:
    """Takes the core's outputs to the streams, holding the engine only weakly: once it is
    garbage, its finalizer shuts the core down."""
    while True:
        try:
            outputs = await client.get_output_async()
        except EngineDeadError as e:
            engine = engine_ref()
            if engine is not None:
                engine._fail_all(e)
            return
        engine = engine_ref()
        if engine is None:
            return
        await engine._dispatch(outputs)
        del engine


def _shutdown(client: AsyncEngineCoreClient, tokenizer_thread: ThreadPoolExecutor) -> None:
    tokenizer_thread.shutdown(wait=False, cancel_futures=True)
    client.shutdown()
