"""Engine-core clients: how the blocking frontend (LLMEngine) reaches EngineCore, behind
`EngineCoreClient` and its `make_client` factory; `MPClient`, the multiprocess part that the
asyncio clients (frontend/async_core_client.py) share.

`InprocClient` builds the EngineCore in the caller's process and steps it directly (for
debugging and the torchrun external launcher). `SyncMPClient` spawns an engine-core process
(or reaches a daemon) and talks to it over ZeroMQ with msgspec frames: requests go out on a
DEALER socket, and a background thread receives outputs and utility results and sends a
heartbeat every second.
If the core dies (it says why in a last message, or its process or connection is seen gone),
every pending and later call raises `EngineDeadError` instead of hanging. While the core
lives, every request sent gets a final output: the client keeps the ids of its unfinished
requests and now and then asks the core which of them it holds (`_audit`); one that was sent
before the question and is missing from the answer was lost on the way (a message the core
could not read, say) and gets an error output here. Shutting down
never waits without a deadline, also when it runs as a garbage collector's finalizer.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import subprocess
import tempfile
import threading
import time
import weakref
from abc import ABC, abstractmethod
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from tokenmill.protocol.codec import DecodeError, Decoder, Encoder
from tokenmill.protocol.config import EngineConfig
from tokenmill.protocol.messages import (
    LIVE_REQUEST_IDS,
    PROTOCOL_VERSION,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    FinishReason,
    Hello,
    OutputType,
    Ready,
    Refused,
    RequestType,
    StartupError,
    UtilityCall,
    UtilityResult,
)
from tokenmill.protocol.process import close_sockets, remove_dir, start_module, stop_processes
from tokenmill.protocol.sockets import split_address

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0  # loading a model (and converting the default one) takes a while
CONNECT_TIMEOUT_S = 30.0  # a running daemon answers a hello at once
RECONNECT_TIMEOUT_S = 60.0  # how long a reconnecting client waits for a restarted daemon
UTILITY_TIMEOUT_S = 60.0  # a utility call (get_stats, ...) that gets no answer fails
HEARTBEAT_INTERVAL_S = 1.0  # well inside the daemon's CLIENT_TIMEOUT_S
# How often a client with unfinished requests asks the core which of them it holds
# (LIVE_REQUEST_IDS); one the core does not hold is ended with an error output.
AUDIT_INTERVAL_S = 5.0


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; no request in flight will finish."""


class EngineCoreClient(ABC):
    @staticmethod
    def make_client(
        config: EngineConfig | None,
        multiprocess: bool = True,
        engine_address: str | None = None,
        auth_token: str = "",
        reconnect: bool = False,
    ) -> EngineCoreClient:
        if engine_address is not None:
            return SyncMPClient(None, engine_address, auth_token, reconnect)
        assert config is not None
        if config.parallel_config.data_parallel_size > 1:
            if not multiprocess:
                raise ValueError(
                    "data_parallel_size > 1 runs an engine-core process per rank; it cannot "
                    "run with multiprocess=False"
                )
            from tokenmill.frontend.dp_client import DPClient

            return DPClient(config, auth_token=auth_token)
        return SyncMPClient(config) if multiprocess else InprocClient(config)

    @abstractmethod
    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Submits requests together (one message to a core in another process)."""

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next batch of outputs (one engine step's worth)."""

    @abstractmethod
    def call_utility(self, method: str, *args: Any, timeout: float = UTILITY_TIMEOUT_S) -> Any:
        """Runs an EngineCore utility (get_stats, ...) and returns its result."""

    @abstractmethod
    def shutdown(self) -> None: ...

    @property
    @abstractmethod
    def engine_config(self) -> EngineConfig:
        """The config as the core settled it (e.g. max_model_len after auto-fit)."""


class InprocClient(EngineCoreClient):
    def __init__(self, config: EngineConfig) -> None:
        # The one place the frontend builds a core itself.
        from tokenmill.core.engine_core import EngineCore

        self.engine_core: Any = EngineCore(config)

    @property
    def engine_config(self) -> EngineConfig:
        return self.engine_core.config

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        for request in requests:
            self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def call_utility(self, method: str, *args: Any, timeout: float = UTILITY_TIMEOUT_S) -> Any:
        return getattr(self.engine_core, method)(*args)

    def shutdown(self) -> None:
        if self.engine_core is not None:
            self.engine_core.shutdown()
            self.engine_core = None


class MPClient:
    """What both multiprocess clients share: spawning (or reaching) the core, the sockets
    and handshake, decoding the core's messages, and a shutdown that never blocks.

    Without `engine_address` it spawns the core itself and stops it on shutdown(), garbage
    collection or interpreter exit; with one it connects to a running `engine-core` daemon
    (and leaves it running). With `asyncio_mode` the output socket (and its monitor) are
    asyncio sockets, read by the event loop itself."""

    def __init__(
        self,
        config: EngineConfig | None,
        engine_address: str | None = None,
        auth_token: str = "",
        asyncio_mode: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        """`env`: the spawned core's environment (default: this process's)."""
        self.proc: subprocess.Popen | None = None
        self.auth_token = auth_token
        self.ipc_dir: str | None = None
        if engine_address is None:
            assert config is not None, "a spawned engine core needs a config"
            self.ipc_dir = tempfile.mkdtemp(prefix="tokenmill-")  # private: mode 0700
            input_address = f"ipc://{self.ipc_dir}/input"
            output_address = f"ipc://{self.ipc_dir}/output"
            self.proc = _spawn_core(config, input_address, output_address, env)
            timeout = STARTUP_TIMEOUT_S
        else:
            input_address, output_address = split_address(engine_address)
            timeout = CONNECT_TIMEOUT_S
        self.address = engine_address or input_address
        self.ctx = zmq.Context()
        output_ctx = zmq.asyncio.Context.shadow(self.ctx.underlying) if asyncio_mode else self.ctx
        identity = os.urandom(8)
        self.input_socket = self.ctx.socket(zmq.DEALER)
        # No send limit: a send must never block the caller (an event loop, say) while a
        # stalled core is not yet known to be dead.
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        self.output_socket = output_ctx.socket(zmq.DEALER)
        for socket, address in (
            (self.input_socket, input_address),
            (self.output_socket, output_address),
        ):
            socket.setsockopt(zmq.IDENTITY, identity)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(address)
        # A daemon has no process handle to watch: a dropped connection is how it dies.
        self.monitor = self.output_socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.encoder = Encoder()
        # A heartbeat or output thread sends too; re-entrant, as a send of requests also
        # records them (see _audit).
        self.send_lock = threading.RLock()
        # Requests sent without a final output yet, and the audits in flight: call id -> the
        # unfinished ids when it was sent (all of them sent before it, so the core has read
        # them when it answers).
        self.unfinished: dict[str, None] = {}
        self.audits: dict[int, set[str]] = {}
        self.next_audit = 0.0
        self.refusal: str | None = None  # the core's last REFUSED message
        self.call_ids = itertools.count()
        self.dead: str | None = None
        self.stop_thread = threading.Event()
        self.threads: list[threading.Thread] = []
        # The finalizer holds the sockets themselves: by the time a garbage collector runs
        # it, the context's own (weak) list of them is already cleared.
        sockets = [self.input_socket, self.output_socket, self.monitor]
        self._finalizer = weakref.finalize(
            self,
            _shutdown,
            self.proc,
            self.ctx,
            sockets,
            self.ipc_dir,
            self.stop_thread,
            self.threads,
        )
        self.ready = self._handshake(auth_token, timeout)
        self._decoders = {
            OutputType.OUTPUTS: Decoder(EngineCoreOutputs),
            OutputType.UTILITY_RESULT: Decoder(UtilityResult),
            OutputType.ENGINE_DEAD: Decoder(EngineDead),
            OutputType.REFUSED: Decoder(Refused),
        }
        self.next_heartbeat = 0.0

    @property
    def engine_config(self) -> EngineConfig:
        return self.ready.config

    def _start_thread(self, target: Any, name: str) -> None:
        """A daemon thread running `target(client_ref, stop_event)`. It holds the client only
        weakly, so that dropping the last reference to it still shuts the engine core down;
        shutdown stops and joins it (with a deadline)."""
        thread = threading.Thread(
            target=target, args=(weakref.ref(self), self.stop_thread), daemon=True, name=name
        )
        self.threads.append(thread)
        thread.start()

    def _handshake(self, auth_token: str, timeout: float) -> Ready:
        self._send(RequestType.HELLO, Hello(PROTOCOL_VERSION, auth_token))
        # A blocking view of the output socket (an asyncio one cannot be read outside a loop).
        socket = zmq.Socket.shadow(self.output_socket.underlying)
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        waited = 0.0
        while waited < timeout:
            if poller.poll(100):
                kind, *frames = socket.recv_multipart(copy=False)
                if kind.bytes == OutputType.READY:
                    return Decoder(Ready).decode([f.buffer for f in frames])
                if kind.bytes == OutputType.STARTUP_ERROR:
                    error = Decoder(StartupError).decode([f.buffer for f in frames])
                    self.shutdown()
                    raise RuntimeError(f"engine core failed to start: {error.message}")
            elif self.proc is not None and self.proc.poll() is not None:
                self.shutdown()
                raise RuntimeError(
                    f"engine core process exited during start-up (exit code {self.proc.returncode})"
                )
            waited += 0.1
        self.shutdown()
        raise TimeoutError(f"engine core at {self.address} did not answer within {timeout:.0f} s")

    def _decode(self, frames: list) -> Any:
        """The message in a multipart from the core (None if it cannot be read)."""
        kind, *body = frames
        decoder = self._decoders.get(kind.bytes)
        if decoder is None:
            return None
        try:
            return decoder.decode([f.buffer for f in body])
        except (DecodeError, ValueError) as e:
            logger.warning("dropped a message from the engine core: %s", e)
            return None

    def _heartbeat(self) -> None:
        """Sends a heartbeat when one is due (a daemon drops clients that go quiet)."""
        now = time.monotonic()
        if now >= self.next_heartbeat:
            self.next_heartbeat = now + HEARTBEAT_INTERVAL_S
            with contextlib.suppress(zmq.Again):
                self._send_raw([RequestType.HEARTBEAT], zmq.NOBLOCK)

    def _audit(self) -> None:
        """Asks the core which unfinished requests it holds, when that is due (every
        AUDIT_INTERVAL_S while there are any; at once after a REFUSED message)."""
        now = time.monotonic()
        if now < self.next_audit or self.dead is not None:
            return
        self.next_audit = now + AUDIT_INTERVAL_S
        with self.send_lock:
            if not self.unfinished:
                return
            call_id = next(self.call_ids)
            self.audits[call_id] = set(self.unfinished)
            with contextlib.suppress(zmq.Again):
                self._send(RequestType.UTILITY, UtilityCall(call_id, LIVE_REQUEST_IDS), zmq.NOBLOCK)

    def _on_audit(self, result: UtilityResult) -> EngineCoreOutputs | None:
        """Error outputs for the requests the audit found lost (None if there are none)."""
        asked = self.audits.pop(result.call_id)
        if result.error is not None or not isinstance(result.result, list):
            logger.warning("the engine core could not list its requests: %s", result.error)
            return None
        live = set(result.result)
        refusal, self.refusal = self.refusal, None  # it explains this audit's losses only
        with self.send_lock:
            lost = [req_id for req_id in asked if req_id in self.unfinished and req_id not in live]
            for req_id in lost:
                del self.unfinished[req_id]
        if not lost:
            return None
        why = refusal or "the engine core holds no such request"
        logger.error("%d request(s) lost on the way to the engine core: %s", len(lost), why)
        error = f"the request was lost on the way to the engine core: {why}"
        ended = FinishReason.ERROR
        outs = [EngineCoreOutput(r, [], finish_reason=ended, error=error) for r in lost]
        return EngineCoreOutputs(outs, time.monotonic())

    def _on_refused(self, refused: Refused) -> None:
        logger.warning("the engine core refused requests: %s", refused.message)
        self.refusal = refused.message
        self.next_audit = 0.0  # the lost requests are found by the next audit

    def _finished(self, outputs: EngineCoreOutputs) -> None:
        """Forgets the requests these outputs end."""
        ended = [out.request_id for out in outputs.outputs if out.finished]
        if ended:
            with self.send_lock:
                for req_id in ended:
                    self.unfinished.pop(req_id, None)

    def _process_died(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            self._die(f"engine core process died (exit code {self.proc.returncode})")
            return True
        return False

    def _die(self, reason: str) -> None:
        self.dead = reason

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)

    def _utility_timeout(self, method: str, timeout: float) -> TimeoutError:
        return TimeoutError(
            f"{method} got no answer from the engine core at {self.address} within {timeout:.0f} s"
        )

    @staticmethod
    def _utility_value(method: str, result: UtilityResult) -> Any:
        if result.error is not None:
            # The caller's mistake (an adapter that cannot run, say) stays a ValueError.
            kind, _, message = result.error.partition(": ")
            if kind == "ValueError":
                raise ValueError(message)
            raise RuntimeError(f"{method} failed in the engine core: {result.error}")
        return result.result

    def _send_raw(self, frames: list, flags: int = 0) -> None:
        with self.send_lock:
            self.input_socket.send_multipart(frames, flags, copy=False)

    def _send(self, kind: bytes, payload: Any, flags: int = 0) -> None:
        with self.send_lock:  # the encoder is not thread-safe either
            self._send_raw([kind, *self.encoder.encode(payload)], flags)

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._check_alive()
        with self.send_lock:  # recorded and sent before any audit can ask for them
            for request in requests:
                self.unfinished[request.request_id] = None
            self._send(RequestType.ADD, requests)

    def abort_requests(self, request_ids: list[str]) -> None:
        with self.send_lock:
            for req_id in request_ids:
                self.unfinished.pop(req_id, None)
        if self.dead is None and request_ids:
            self._send(RequestType.ABORT, list(request_ids))

    def shutdown(self) -> None:
        if self.dead is None:
            self._die("the client was shut down")
        self._finalizer()


class SyncMPClient(MPClient, EngineCoreClient):
    """Talks to an engine core in another process, for blocking callers: a background
    thread receives outputs and utility results and sends the heartbeats. With a daemon and
    `reconnect`, it survives the daemon's restart by resubmitting unfinished requests."""

    def __init__(
        self,
        config: EngineConfig | None,
        engine_address: str | None = None,
        auth_token: str = "",
        reconnect: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        self.reconnect = reconnect and engine_address is not None
        self.in_flight: dict[str, tuple[EngineCoreRequest, list[int]]] = {}
        self.outputs: queue.Queue[EngineCoreOutputs | BaseException] = queue.Queue()
        self.utility_results: dict[int, queue.Queue[UtilityResult | BaseException]] = {}
        super().__init__(config, engine_address, auth_token, env=env)
        self._poller = zmq.Poller()
        self._poller.register(self.output_socket, zmq.POLLIN)
        self._poller.register(self.monitor, zmq.POLLIN)
        self._start_thread(_output_thread, "mp-client-output")

    def _receive_once(self) -> bool:
        """One turn of the output thread: waits up to 200 ms for a message from the core and
        hands it over, sending a heartbeat when one is due. False once the thread should end.
        The sockets it polls are closed only after it has ended."""
        if self.dead is not None:
            return False
        self._heartbeat()
        self._audit()
        ready = dict(self._poller.poll(200))
        # Messages first: a dying core's last word (why it died) arrives before its socket
        # is seen to close.
        if self.monitor in ready and self.output_socket not in ready:
            self.monitor.recv_multipart()
            if self.reconnect and self._reconnect():
                return True
            self._die(f"lost the connection to the engine core at {self.address}")
            return False
        if not ready:
            return not self._process_died()
        message = self._decode(self.output_socket.recv_multipart(copy=False))
        if isinstance(message, EngineDead):
            self._die(f"the engine core died: {message.cause}")
            return False
        if isinstance(message, UtilityResult) and message.call_id in self.audits:
            lost = self._on_audit(message)
            if lost is not None:
                self._track(lost)
                self._deliver(lost)
        elif isinstance(message, UtilityResult):
            waiter = self.utility_results.get(message.call_id)
            if waiter is not None:
                waiter.put(message)
        elif isinstance(message, Refused):
            self._on_refused(message)
        elif message is not None:
            self._finished(message)
            self._track(message)
            self._deliver(message)
        return True

    def _deliver(self, item: EngineCoreOutputs | BaseException) -> None:
        """Hands outputs (or the error that ends them all) to get_output's callers."""
        self.outputs.put(item)

    def _track(self, outputs: EngineCoreOutputs) -> None:
        """Remembers what unfinished requests produced, to resubmit them after a restart."""
        if not self.reconnect:
            return
        with self.send_lock:
            for out in outputs.outputs:
                entry = self.in_flight.get(out.request_id)
                if entry is None:
                    continue
                if out.finished:
                    del self.in_flight[out.request_id]
                else:
                    entry[1].extend(out.new_token_ids)

    def _reconnect(self) -> bool:
        """Waits for the daemon to come back at the same address, says hello again and
        resubmits every unfinished request with the tokens it already produced appended to
        its prompt, so callers get complete outputs. False if it does not come back."""
        logger.warning("lost the engine core at %s; waiting for it to come back", self.address)
        deadline = time.monotonic() + RECONNECT_TIMEOUT_S
        poller = zmq.Poller()
        poller.register(self.output_socket, zmq.POLLIN)
        while time.monotonic() < deadline and self.dead is None and not self.stop_thread.is_set():
            self._send(RequestType.HELLO, Hello(PROTOCOL_VERSION, self.auth_token))
            if not poller.poll(1000):
                continue
            kind, *frames = self.output_socket.recv_multipart(copy=False)
            if kind.bytes != OutputType.READY:
                continue
            with self.send_lock:
                resubmitted = [
                    continuation(req, produced) for req, produced in self.in_flight.values()
                ]
                self.in_flight = {r.request_id: (r, []) for r in resubmitted}
                self.audits.clear()  # asked of the core that went away: never answered
            if resubmitted:
                self._send(RequestType.ADD, resubmitted)
            logger.warning("reconnected; resubmitted %d unfinished requests", len(resubmitted))
            return True
        return False

    def _die(self, reason: str) -> None:
        super()._die(reason)
        error = EngineDeadError(reason)
        self._deliver(error)
        for waiter in list(self.utility_results.values()):
            waiter.put(error)

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._check_alive()
        if self.reconnect:
            with self.send_lock:
                for request in requests:
                    self.in_flight[request.request_id] = (request, [])
        super().add_requests(requests)

    def abort_requests(self, request_ids: list[str]) -> None:
        if self.reconnect:
            with self.send_lock:
                for req_id in request_ids:
                    self.in_flight.pop(req_id, None)
        super().abort_requests(request_ids)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        """The next step's outputs; None if `timeout` seconds pass without any."""
        self._check_alive()
        return take_output(self.outputs, timeout)

    def call_utility(self, method: str, *args: Any, timeout: float = UTILITY_TIMEOUT_S) -> Any:
        call_id = next(self.call_ids)
        waiter: queue.Queue[UtilityResult | BaseException] = queue.Queue()
        # Registered before the liveness check: a death after it reaches this waiter, and
        # one before it is caught by the check (or, at the latest, by the polls below).
        self.utility_results[call_id] = waiter
        try:
            self._check_alive()
            self._send(RequestType.UTILITY, UtilityCall(call_id, method, list(args)))
            deadline = time.monotonic() + timeout
            while True:
                try:
                    result = waiter.get(timeout=min(0.5, max(deadline - time.monotonic(), 0)))
                    break
                except queue.Empty:
                    self._check_alive()
                    if time.monotonic() >= deadline:
                        raise self._utility_timeout(method, timeout) from None
        finally:
            del self.utility_results[call_id]
        if isinstance(result, BaseException):
            raise result
        return self._utility_value(method, result)


def _output_thread(client_ref: weakref.ref[SyncMPClient], stop: threading.Event) -> None:
    while not stop.is_set():
        client = client_ref()
        if client is None or not client._receive_once():
            return
        del client


def take_output(
    outputs: queue.Queue[EngineCoreOutputs | BaseException], timeout: float | None
) -> EngineCoreOutputs | None:
    """The next outputs from a client's queue (None after `timeout` s); an error in it is
    raised, and left there so that every later call fails the same way."""
    try:
        result = outputs.get(timeout=timeout)
    except queue.Empty:
        return None
    if isinstance(result, BaseException):
        outputs.put(result)
        raise result
    return result


def continuation(request: EngineCoreRequest, produced: list[int]) -> EngineCoreRequest:
    """The rest of a request, to resubmit: it resumes after what it produced (the core treats
    those tokens as its outputs so far, as after a preemption). Its prompt logprobs, which
    leave with the first output, are not asked for again."""
    if not produced:
        return request
    params = request.sampling_params
    if params.prompt_logprobs is not None:
        params = msgspec.structs.replace(params, prompt_logprobs=None)
    return msgspec.structs.replace(
        request,
        sampling_params=params,
        resumed_token_ids=request.resumed_token_ids + produced,
    )


def _spawn_core(
    config: EngineConfig, input_address: str, output_address: str, env: dict[str, str] | None
) -> subprocess.Popen:
    # A fresh interpreter running the core's module: unlike multiprocessing's spawn it never
    # re-imports the caller's __main__.
    args = [
        f"--input-address={input_address}",
        f"--output-address={output_address}",
        f"--parent-pid={os.getpid()}",
    ]
    return start_module("tokenmill.core.engine_core_proc", args, config, env)


def _shutdown(
    proc: subprocess.Popen | None,
    ctx: zmq.Context,
    sockets: list,
    ipc_dir: str | None,
    stop_thread: threading.Event,
    threads: list[threading.Thread],
) -> None:
    """Stops the output thread, which owns the sockets it polls (it finishes its turn: a
    200 ms poll, or a 1 s reconnect attempt), and a spawned core (SIGTERM: it stops its
    workers; SIGKILL after 5 s), then closes this client's sockets and removes the private
    socket directory. Runs once: from shutdown(), garbage collection or interpreter exit."""
    stop_thread.set()
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join(2.0)
    if proc is not None:
        stop_processes([proc], timeout=5.0)
    close_sockets(ctx, sockets)
    remove_dir(ipc_dir)
