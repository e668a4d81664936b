"""Engine-core clients for an asyncio event loop (AsyncLLM and the server), behind one base.

`AsyncEngineCoreClient` is what AsyncLLM holds; its `make_async_client` factory picks
`AsyncMPClient` (one core: spawned, or an `engine-core` daemon) or, with data parallelism,
`AsyncDPClient` (frontend/dp_client.py). Requests go in as EngineCoreRequests, outputs come
back as EngineCoreOutputs on the caller's loop, and a dead core raises `EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from abc import ABC, abstractmethod
from typing import Any

import zmq
import zmq.asyncio

from tokenmill.frontend.core_client import (
    HEARTBEAT_INTERVAL_S,
    UTILITY_TIMEOUT_S,
    EngineDeadError,
    MPClient,
)
from tokenmill.protocol.config import EngineConfig
from tokenmill.protocol.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    Ready,
    Refused,
    RequestType,
    UtilityCall,
    UtilityResult,
)

logger = logging.getLogger(__name__)


class AsyncEngineCoreClient(ABC):
    """What AsyncLLM asks of its client, from one event loop's thread.

    - `ready` (the core's handshake: its KV cache's `num_blocks`) and `engine_config` (the
      config as the core settled it), known once the constructor returns;
    - `add_requests` and `abort_requests`, which send without waiting for the core;
    - `get_output_async`, the next message of outputs, and `call_utility_async`, an
      EngineCore utility's result; both raise EngineDeadError once the core is gone, and so
      does every later call;
    - `data_parallel_status`, each rank's state (None without data parallelism);
    - `shutdown`, which stops a core started here and never waits without a deadline.
    """

    # The handshake's answer (an attribute of the multiprocess client, a property of the
    # data-parallel one, so not an abstract property).
    ready: Ready

    @staticmethod
    def make_async_client(
        config: EngineConfig | None, engine_address: str | None = None, auth_token: str = ""
    ) -> AsyncEngineCoreClient:
        """A client for a daemon at `engine_address`, else for cores spawned from `config`
        (one per data-parallel rank)."""
        if engine_address is not None:
            return AsyncMPClient(None, engine_address, auth_token)
        assert config is not None
        if config.parallel_config.data_parallel_size > 1:
            from tokenmill.frontend.dp_client import AsyncDPClient

            return AsyncDPClient(config, auth_token=auth_token)
        # A core spawned here listens in this client's private socket directory and asks for
        # no token.
        return AsyncMPClient(config)

    @property
    @abstractmethod
    def engine_config(self) -> EngineConfig:
        """The config as the core settled it (e.g. max_model_len after auto-fit)."""

    @abstractmethod
    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Submits requests together, without waiting for the core."""

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    async def get_output_async(self) -> EngineCoreOutputs:
        """The next message of outputs from the core (ranks' outputs, merged)."""

    @abstractmethod
    async def call_utility_async(
        self, method: str, *args: Any, timeout: float = UTILITY_TIMEOUT_S
    ) -> Any:
        """Runs an EngineCore utility (get_stats, ...) and returns its result."""

    def data_parallel_status(self) -> dict[str, Any] | None:
        """Each data-parallel rank's state and the failover counts (None without DP)."""
        return None

    @abstractmethod
    def shutdown(self) -> None: ...


class AsyncMPClient(MPClient, AsyncEngineCoreClient):
    """Talks to an engine core in another process from an asyncio event loop: the loop reads
    the output socket (and its monitor) itself, so no thread stands between a core's output
    and the loop. Sends are non-blocking socket writes made on the loop's thread. One small
    thread sends the heartbeats, so that a daemon keeps this client while no loop runs (between
    two `asyncio.run` calls) or while the loop is busy. Call shutdown() from the loop's thread
    (or with no loop running)."""

    def __init__(
        self,
        config: EngineConfig | None,
        engine_address: str | None = None,
        auth_token: str = "",
        env: dict[str, str] | None = None,
    ) -> None:
        self.outputs: asyncio.Queue[EngineCoreOutputs | BaseException] | None = None
        self.utility_futures: dict[int, asyncio.Future] = {}
        self.tasks: list[asyncio.Task] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        super().__init__(config, engine_address, auth_token, asyncio_mode=True, env=env)
        self._start_thread(_heartbeat_thread, "async-mp-client-heartbeat")

    def _ensure_started(self) -> None:
        """Starts the receiving and watching tasks on the running loop (again if the client
        is used from a new loop: `asyncio.run` twice)."""
        loop = asyncio.get_running_loop()
        if self.loop is loop:
            return
        for task in self.tasks:
            task.cancel()
        self.loop = loop
        self.outputs = asyncio.Queue()
        if self.dead is not None:
            self._deliver(EngineDeadError(self.dead))
            return
        self.tasks = [
            loop.create_task(self._guard(self._receive_loop()), name="async-mp-client-receive"),
            loop.create_task(self._guard(self._watch_process()), name="async-mp-client-watch"),
        ]

    async def _guard(self, loop_coro: Any) -> None:
        """Runs one of the client's loops; if it fails, the client is dead (rather than its
        callers waiting for ever on outputs that nobody receives)."""
        try:
            await loop_coro
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.exception("the engine-core client failed")
            self._die(f"the engine-core client failed: {type(e).__name__}: {e}")

    async def _receive_loop(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self.output_socket, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while self.dead is None:
            ready = dict(await poller.poll())
            if self.output_socket in ready:
                # Messages first: a dying core's last word arrives before its socket closes.
                frames = await self.output_socket.recv_multipart(copy=False)
                self._on_message(self._decode(frames))
            elif self.monitor in ready:
                await self.monitor.recv_multipart()
                self._die(f"lost the connection to the engine core at {self.address}")

    def _on_message(self, message: Any) -> None:
        if isinstance(message, EngineDead):
            self._die(f"the engine core died: {message.cause}")
        elif isinstance(message, UtilityResult) and message.call_id in self.audits:
            lost = self._on_audit(message)
            if lost is not None:
                self._deliver(lost)
        elif isinstance(message, UtilityResult):
            future = self.utility_futures.get(message.call_id)
            if future is not None and not future.done():
                future.set_result(message)
        elif isinstance(message, Refused):
            self._on_refused(message)
        elif message is not None:
            self._finished(message)
            self._deliver(message)

    def _deliver(self, item: EngineCoreOutputs | BaseException) -> None:
        """Hands outputs (or the error that ends them all) to get_output_async's callers."""
        if self.outputs is not None:
            self.outputs.put_nowait(item)

    async def _watch_process(self) -> None:
        while self.dead is None and not self._process_died():
            await asyncio.sleep(0.5)

    def _die(self, reason: str) -> None:
        if self.dead is not None:
            return
        super()._die(reason)
        error = EngineDeadError(reason)
        self._deliver(error)
        for future in self.utility_futures.values():
            if not future.done():
                future.set_exception(error)

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next message of outputs from the core; raises EngineDeadError once it is
        gone."""
        self._ensure_started()
        assert self.outputs is not None
        return await take_output_async(self.outputs)

    async def call_utility_async(
        self, method: str, *args: Any, timeout: float = UTILITY_TIMEOUT_S
    ) -> Any:
        self._ensure_started()
        call_id = next(self.call_ids)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self.utility_futures[call_id] = future
        try:
            self._check_alive()
            self._send(RequestType.UTILITY, UtilityCall(call_id, method, list(args)))
            try:
                result = await asyncio.wait_for(future, timeout)
            except asyncio.TimeoutError:
                raise self._utility_timeout(method, timeout) from None
        finally:
            del self.utility_futures[call_id]
        return self._utility_value(method, result)

    def stop_receiving(self) -> None:
        """Cancels the client's tasks (from the loop's thread, or with no loop running)."""
        for task in self.tasks:
            task.cancel()
        self.tasks = []

    def shutdown(self) -> None:
        self.stop_receiving()
        super().shutdown()


def _heartbeat_thread(client_ref: weakref.ref[AsyncMPClient], stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_INTERVAL_S):
        client = client_ref()
        if client is None or client.dead is not None:
            return
        client._heartbeat()
        client._audit()
        del client


async def take_output_async(
    outputs: asyncio.Queue[EngineCoreOutputs | BaseException],
) -> EngineCoreOutputs:
    """take_output for an asyncio queue (no timeout: the caller cancels)."""
    result = await outputs.get()
    if isinstance(result, BaseException):
        outputs.put_nowait(result)
        raise result
    return result
