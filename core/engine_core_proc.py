"""EngineCoreProc: EngineCore in its own process, serving clients over ZeroMQ.

Three threads: the input thread receives and decodes client messages onto a queue; the main
thread runs the engine loop (block on the queue while idle, otherwise handle input, step,
route outputs); the output thread encodes and sends, so that socket work overlaps the model
step. Two ROUTER sockets are bound: input (clients' DEALERs send requests) and output (the
same DEALER identities receive their own requests' outputs). A message that does not decode
never stops the core, and never loses a request unsaid: an ADD is read request by request,
a request whose id can be read ends with an error output, and a sender whose requests cannot
be read gets a REFUSED message; clients also compare their unfinished requests with the
core's now and then (LIVE_REQUEST_IDS) and end the ones it does not hold. Started by a
multiprocess client (spawned) or by the `engine-core` daemon.

Clients that go away lose their requests: a client whose output socket is gone (seen when an
output to it cannot be delivered), or, for a daemon, one that sends no heartbeat for
CLIENT_TIMEOUT_S, has its requests aborted and their blocks freed. A step that raises, or
workers that die, kill the engine: every client is sent the cause (ENGINE_DEAD), the workers
are stopped, and the process exits.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

import msgspec
import psutil
import zmq

from tokenmill.core.engine_core import EngineCore
from tokenmill.protocol import envs
from tokenmill.protocol.codec import DecodeError, Decoder, Encoder
from tokenmill.protocol.config import EngineConfig
from tokenmill.protocol.lora import LoRARequest
from tokenmill.protocol.messages import (
    LIVE_REQUEST_IDS,
    PROTOCOL_VERSION,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    Hello,
    OutputType,
    Ready,
    Refused,
    RequestType,
    StartupError,
    UtilityCall,
    UtilityResult,
    describe_validation_error,
)
from tokenmill.protocol.process import close_sockets, remove_dir, watch_parent

logger = logging.getLogger(__name__)

# Utility methods a client may call on the core, by name (the LoRA ones with its own ids).
_LORA_UTILITIES = ("add_lora", "remove_lora", "list_loras")
UTILITIES = (
    "get_stats", "reset_prefix_cache", "check_health", "add_lora", "remove_lora", "list_loras"
)
_DECODERS = {
    RequestType.HELLO: Decoder(Hello),
    RequestType.ADD: Decoder(list[EngineCoreRequest]),
    RequestType.ABORT: Decoder(list[str]),
    RequestType.UTILITY: Decoder(UtilityCall),
}
# Events the core's own threads put on the input queue (never sent by a client).
_CLIENT_GONE = b"client-gone"
_ADD_FAILED = b"add-failed"  # (request id, why) of requests in an ADD that did not decode
_FATAL = b"fatal"  # the engine cannot go on (its workers died, ...): the cause follows

CLIENT_TIMEOUT_S = 5.0  # a daemon's client that sends nothing for this long is gone
_IDLE_WAKE_S = 1.0  # an idle loop still looks for silent clients this often
_DEAD_LINGER_MS = 1000  # how long the last messages get to leave a dying core
_STATS_INTERVAL_S = 1.0  # how often a client without outputs hears the scheduler stats


class BindError(RuntimeError):
    """An address the core cannot listen on (in use, or not this host's); says what holds a
    port in use where the system tells."""

    def __init__(self, address: str, error: zmq.ZMQError) -> None:
        holder = _port_holder(address) if error.errno == zmq.EADDRINUSE else None
        held = f"; held by {holder}" if holder else ""
        super().__init__(f"cannot listen on {address}: {error.strerror}{held}")


def _port_holder(address: str) -> str | None:
    """The process listening on a tcp address's port, as "pid N (name)", if it can be seen."""
    if not address.startswith("tcp://"):
        return None
    port = int(address.rsplit(":", 1)[1])
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
                if conn.pid is None:
                    return "another process"
                return f"pid {conn.pid} ({psutil.Process(conn.pid).name()})"
    except (psutil.Error, OSError):
        return None
    return None


class EngineCoreProc:
    def __init__(
        self,
        config: EngineConfig,
        input_address: str,
        output_address: str,
        parent_pid: int | None = None,
        auth_token: str = "",
    ) -> None:
        self.auth_token = auth_token
        self.engine_index = config.parallel_config.data_parallel_rank
        self.input_queue: queue.Queue[tuple[bytes, bytes, Any]] = queue.Queue()
        self.output_queue: queue.Queue[tuple[bytes, bytes, Any] | None] = queue.Queue()
        self.ctx = zmq.Context()
        self.input_socket = self.ctx.socket(zmq.ROUTER)
        self.output_socket = self.ctx.socket(zmq.ROUTER)
        self.output_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # No send limit: a client that stops reading must not block the output thread (and
        # every other client with it); a daemon drops it once its heartbeats stop.
        self.output_socket.setsockopt(zmq.SNDHWM, 0)
        for socket, address in ((self.input_socket, input_address),
                                (self.output_socket, output_address)):  # fmt: skip
            try:
                socket.bind(address)
            except zmq.ZMQError as e:
                close_sockets(self.ctx, [self.input_socket, self.output_socket])
                raise BindError(address, e) from None
        self.clients: set[bytes] = set()
        # When each client was last heard from; only a daemon times its clients out (a
        # spawned core has one client, and exits with it).
        self.last_seen: dict[bytes, float] = {}
        self.client_timeout = CLIENT_TIMEOUT_S if parent_pid is None else None
        self.next_client_check = 0.0
        self.request_owner: dict[str, bytes] = {}
        self.lora_ids = ClientLoRAIds()
        self.startup_error: str | None = None
        self.core: EngineCore | None = None
        self.stopped = False
        # Scheduler stats changed outside a step (an abort, a dropped client): an idle core
        # sends them once, so that no client's gauges go stale.
        self.stats_dirty = False
        self.next_stats_broadcast = 0.0
        threading.Thread(target=self._input_loop, daemon=True, name="core-input").start()
        self.output_thread = threading.Thread(
            target=self._output_loop, daemon=True, name="core-output"
        )
        self.output_thread.start()
        started = _process_age()  # interpreter, imports, sockets
        try:
            self.core = EngineCore(config)
            self.core.startup_s = {"process + imports": started, **self.core.startup_s}
        except Exception as e:  # answered to every client that says hello
            logger.exception("engine core failed to start")
            self.startup_error = f"{type(e).__name__}: {e}"
            return
        self.core.executor.register_failure_callback(
            lambda cause: self.input_queue.put((b"", _FATAL, cause))
        )

    # --------------------------------------------------------------------------- threads
    def _input_loop(self) -> None:
        while True:
            try:
                frames = self.input_socket.recv_multipart(copy=False)
            except zmq.ZMQError:  # the context is terminating: the owner closes its socket
                self.input_socket.close(linger=0)
                return
            if len(frames) < 2:
                logger.warning("dropped a message with %d frames", len(frames))
                continue
            identity, kind = frames[0].bytes, frames[1].bytes
            if identity in self.clients:
                self.last_seen[identity] = time.monotonic()
            if kind == RequestType.HEARTBEAT:
                continue
            decoder = _DECODERS.get(kind)
            if decoder is None or len(frames) < 3:
                logger.warning("dropped a message of unknown type %r", kind[:8])
                if kind == RequestType.ADD:
                    self._send(identity, OutputType.REFUSED, Refused("an ADD without a body"))
                continue
            body = [f.buffer for f in frames[2:]]
            try:
                payload = decoder.decode(body)
            except DecodeError as e:
                logger.warning("malformed %r message: %s", kind, e)
                if kind == RequestType.ADD:
                    self._salvage_add(identity, body, e)
                elif kind == RequestType.UTILITY:
                    self._answer_bad_utility(identity, body, e)
                continue
            self.input_queue.put((identity, kind, payload))

    def _salvage_add(self, identity: bytes, body: list, error: Exception) -> None:
        """An ADD that does not decode as a whole, read request by request: the ones that
        decode are added, one whose id can be read ends with the decode error as its error
        output, and the sender is told of any it cannot read (no request is lost unsaid)."""
        try:
            items = msgspec.msgpack.decode(body[0])
        except (msgspec.DecodeError, ValueError, TypeError):
            items = None
        if not isinstance(items, list):
            self._send(identity, OutputType.REFUSED, Refused(f"unreadable ADD message: {error}"))
            return
        good, failed, unreadable = [], [], []
        for item in items:
            try:
                good.append(msgspec.convert(item, EngineCoreRequest))
                continue
            except msgspec.ValidationError as e:
                why = describe_validation_error(e, item, EngineCoreRequest)
            req_id = _request_id_of(item)
            if req_id is None:
                unreadable.append(why)
            else:
                failed.append((req_id, f"the request did not decode: {why}"))
        if good:
            self.input_queue.put((identity, RequestType.ADD, good))
        if failed:
            self.input_queue.put((identity, _ADD_FAILED, failed))
        if unreadable:
            message = f"{len(unreadable)} request(s) without a readable id: {unreadable[0]}"
            self._send(identity, OutputType.REFUSED, Refused(message))

    def _answer_bad_utility(self, identity: bytes, body: list, error: Exception) -> None:
        """A utility call that does not decode is answered with the error (when its call id
        can be read), so that its caller does not wait for its deadline."""
        try:
            item = msgspec.msgpack.decode(body[0])
        except (msgspec.DecodeError, ValueError, TypeError):
            return
        if isinstance(item, list) and item and type(item[0]) is int:
            result = UtilityResult(item[0], error=f"the utility call did not decode: {error}")
            self._send(identity, OutputType.UTILITY_RESULT, result)

    def _output_loop(self) -> None:
        encoder = Encoder()
        while True:
            item = self.output_queue.get()
            if item is None:
                self.output_socket.close(linger=_DEAD_LINGER_MS)
                return
            identity, kind, payload = item
            try:
                frames = [identity, kind, *encoder.encode(payload)]
            except Exception:  # one bad message must not silence every client
                logger.exception("could not encode a %r message; dropped it", kind)
                continue
            # A client's output socket may still be connecting when its hello is answered;
            # later messages to a client that is gone are dropped at once, so that no client
            # can stall the others.
            attempts = 100 if kind in (OutputType.READY, OutputType.STARTUP_ERROR) else 1
            for attempt in range(attempts):
                try:
                    self.output_socket.send_multipart(frames, zmq.NOBLOCK, copy=False)
                    break
                except zmq.ZMQError as e:
                    if e.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                        raise
                    if attempt + 1 < attempts:
                        time.sleep(0.01)
            else:
                self.input_queue.put((identity, _CLIENT_GONE, "its output socket is gone"))

    def _send(self, identity: bytes, kind: bytes, payload: Any) -> None:
        self.output_queue.put((identity, kind, payload))

    # ---------------------------------------------------------------------- engine loop
    def run(self) -> None:
        if self.startup_error is not None:
            self._refuse_hellos(seconds=3.0)
            return
        core = self.core
        assert core is not None
        while True:
            if not core.has_unfinished_requests():
                try:  # idle: block, no spinning
                    self._handle(*self.input_queue.get(timeout=_IDLE_WAKE_S))
                except queue.Empty:
                    pass
            while True:
                try:
                    self._handle(*self.input_queue.get_nowait())
                except queue.Empty:
                    break
            self._drop_silent_clients()
            if self.stats_dirty and not core.has_unfinished_requests():
                self.stats_dirty = False
                self._broadcast_stats(EngineCoreOutputs(scheduler_stats=core.make_stats()), set())
            if core.has_unfinished_requests():
                try:
                    outputs = core.step()
                except Exception as e:  # logged with the step's summary by EngineCore
                    self._die(f"{type(e).__name__}: {e}")
                with core.timing.stage("output"):
                    self._route(outputs)

    def _refuse_hellos(self, seconds: float) -> None:
        """After a failed start: answer waiting clients with the error, then stop."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                identity, kind, payload = self.input_queue.get(timeout=left)
            except queue.Empty:
                break
            if kind == RequestType.HELLO:
                self._hello(identity, payload)
        time.sleep(0.2)  # let the output thread send

    def _handle(self, identity: bytes, kind: bytes, payload: Any) -> None:
        if kind == _FATAL:
            self._die(payload)
        if kind == _CLIENT_GONE:
            self._drop_client(identity, payload)
            return
        if kind == RequestType.HELLO:
            self._hello(identity, payload)
            return
        if identity not in self.clients or self.core is None:
            # A client this core dropped (it went quiet) must not wait for ever on requests
            # that are never run: tell it, as its core's death.
            logger.warning("dropped a %r message from a client without a handshake", kind)
            cause = "this client is not connected to the engine core (dropped or never admitted)"
            self._send(identity, OutputType.ENGINE_DEAD, EngineDead(cause))
            return
        # Request ids are the clients' own: inside the core they are prefixed with the
        # client's identity, so that two clients may use the same id.
        if kind == _ADD_FAILED:
            for req_id, error in payload:
                scoped = _scoped(identity, req_id)
                if not self.core.is_live(scoped):
                    self.request_owner[scoped] = identity
                self.core.reject_request(scoped, error)
        elif kind == RequestType.ADD:
            for request in payload:
                # A reused live id maps to the same owner, and EngineCore ignores the request
                # without an output, so the live request's routing stays as it was.
                request.request_id = _scoped(identity, request.request_id)
                self.request_owner[request.request_id] = identity
                lora = request.lora_request
                if lora is not None:
                    core_id = self.lora_ids.core_id(identity, lora.lora_int_id)
                    request.lora_request = msgspec.structs.replace(lora, lora_int_id=core_id)
                self.core.add_request(request)
        elif kind == RequestType.ABORT:
            scoped = [_scoped(identity, req_id) for req_id in payload]
            self.core.abort_requests(scoped)
            for req_id in scoped:
                self.request_owner.pop(req_id, None)
            self.stats_dirty = True
        elif kind == RequestType.UTILITY and payload.method == LIVE_REQUEST_IDS:
            self._send(identity, OutputType.UTILITY_RESULT, self._live_ids(identity, payload))
        elif kind == RequestType.UTILITY and payload.method in _LORA_UTILITIES:
            self._send(identity, OutputType.UTILITY_RESULT, self._lora_utility(identity, payload))
        elif kind == RequestType.UTILITY:
            self._send(identity, OutputType.UTILITY_RESULT, self._utility(payload))

    def _hello(self, identity: bytes, hello: Hello) -> None:
        if hello.protocol_version != PROTOCOL_VERSION:
            message = (
                f"protocol version mismatch: client speaks {hello.protocol_version}, "
                f"this engine core speaks {PROTOCOL_VERSION}"
            )
        elif self.auth_token and hello.auth_token != self.auth_token:
            message = "authentication failed: wrong or missing auth token"
        else:
            message = self.startup_error
        if message is not None:
            logger.warning("refused client %s: %s", identity.hex(), message)
            self._send(identity, OutputType.STARTUP_ERROR, StartupError(message))
            return
        assert self.core is not None
        self.clients.add(identity)
        self.last_seen[identity] = time.monotonic()
        ready = Ready(PROTOCOL_VERSION, self.core.config, self.core.kv_sizing.num_blocks)
        self._send(identity, OutputType.READY, ready)

    def _utility(self, call: UtilityCall) -> UtilityResult:
        if call.method not in UTILITIES:
            return UtilityResult(call.call_id, error=f"unknown utility method {call.method!r}")
        try:
            result = getattr(self.core, call.method)(*call.args)
            return UtilityResult(call.call_id, result=result)
        except Exception as e:
            return UtilityResult(call.call_id, error=f"{type(e).__name__}: {e}")

    def _lora_utility(self, identity: bytes, call: UtilityCall) -> UtilityResult:
        """add_lora, remove_lora and list_loras with the client's own adapter ids."""
        assert self.core is not None
        ids = self.lora_ids
        try:
            if call.method == "add_lora":
                lora = msgspec.convert(call.args[0], LoRARequest)
                core_id = ids.core_id(identity, lora.lora_int_id)
                result: Any = self.core.add_lora(msgspec.structs.replace(lora, lora_int_id=core_id))
            elif call.method == "remove_lora":
                # (0, which no adapter has, for an id this client never used: False)
                result = self.core.remove_lora(ids.core_id(identity, call.args[0], new=False))
            else:
                result = ids.client_ids(identity, self.core.list_loras())
            return UtilityResult(call.call_id, result=result)
        except Exception as e:
            return UtilityResult(call.call_id, error=f"{type(e).__name__}: {e}")

    def _live_ids(self, identity: bytes, call: UtilityCall) -> UtilityResult:
        """The client's requests that will still get an output. An owner entry the core no
        longer knows (which no path should leave) is dropped: the client then ends that
        request with an error instead of waiting."""
        assert self.core is not None
        live = []
        for req_id, owner in list(self.request_owner.items()):
            if owner != identity:
                continue
            if self.core.is_live(req_id):
                live.append(req_id[_SCOPE_LEN:])
            else:
                logger.error("request %s had an owner but no state in the core", req_id)
                del self.request_owner[req_id]
        return UtilityResult(call.call_id, result=live)

    def _route(self, outputs: EngineCoreOutputs) -> None:
        per_client: dict[bytes, list] = {}
        for out in outputs.outputs:
            owner = self.request_owner.get(out.request_id)
            if owner is None:
                continue
            if out.finished:
                del self.request_owner[out.request_id]
            out.request_id = out.request_id[_SCOPE_LEN:]
            per_client.setdefault(owner, []).append(out)
        stats = outputs.scheduler_stats
        for identity, outs in per_client.items():
            self._send(
                identity,
                OutputType.OUTPUTS,
                EngineCoreOutputs(outs, outputs.timestamp, stats, self.engine_index),
            )
        assert self.core is not None
        now = time.monotonic()
        if now >= self.next_stats_broadcast or not self.core.has_unfinished_requests():
            self._broadcast_stats(outputs, per_client.keys())

    def _broadcast_stats(self, outputs: EngineCoreOutputs, skip: Any) -> None:
        """Sends the scheduler stats alone to every client not in `skip` (at most once a
        second while busy; always when the core goes idle)."""
        self.next_stats_broadcast = time.monotonic() + _STATS_INTERVAL_S
        stats_only = EngineCoreOutputs(
            [], outputs.timestamp, outputs.scheduler_stats, self.engine_index
        )
        for identity in self.clients:
            if identity not in skip:
                self._send(identity, OutputType.OUTPUTS, stats_only)

    # ----------------------------------------------------------------- clients and death
    def _drop_silent_clients(self) -> None:
        now = time.monotonic()
        if self.client_timeout is None or now < self.next_client_check:
            return
        self.next_client_check = now + _IDLE_WAKE_S
        for identity in list(self.clients):
            silent = now - self.last_seen.get(identity, now)
            if silent > self.client_timeout:
                self._drop_client(identity, f"no heartbeat for {silent:.1f} s")

    def _drop_client(self, identity: bytes, reason: str) -> None:
        """Forgets a client that is gone and aborts its requests, freeing their blocks."""
        if identity not in self.clients:
            return
        self.clients.discard(identity)
        self.last_seen.pop(identity, None)
        orphans = [req_id for req_id, owner in self.request_owner.items() if owner == identity]
        for req_id in orphans:
            del self.request_owner[req_id]
        if self.core is not None:
            self.core.abort_requests(orphans)
            gone = self.lora_ids.forget(identity)
            if self.core.config.lora_config is not None:
                for core_id in gone:  # its adapters go with it
                    self.core.remove_lora(core_id)
        self.stats_dirty = True
        logger.warning(
            "client %s is gone (%s); aborted its %d requests", identity.hex(), reason, len(orphans)
        )

    def fail(self, cause: str) -> None:
        """Ends the engine from any thread: the engine loop tells every client why and the
        process exits with an error."""
        self.input_queue.put((b"", _FATAL, cause))

    def _die(self, cause: str) -> NoReturn:
        """Tells every client why the engine is dead, stops the workers and exits."""
        logger.error("engine core is dead: %s", cause)
        for identity in self.clients:
            self._send(identity, OutputType.ENGINE_DEAD, EngineDead(cause))
        self.shutdown()
        os._exit(1)

    def shutdown(self) -> None:
        """Lets queued messages out (bounded), closes the sockets and stops the workers."""
        if self.stopped:
            return
        self.stopped = True
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # already on the way out
        self.output_queue.put(None)
        self.output_thread.join(2.0)
        # The input thread closes its socket when the context terminates under it.
        close_sockets(self.ctx, [], linger_ms=_DEAD_LINGER_MS)
        if self.core is not None:
            self.core.shutdown()


_SCOPE_LEN = 17  # 16 hex digits of the client's 8-byte identity, then "/"


def _request_id_of(item: Any) -> str | None:
    """The id of a request that did not decode, if it can be read (requests travel as
    arrays, id first; a dict with a request_id is read too)."""
    if isinstance(item, list) and item:
        req_id = item[0]
    elif isinstance(item, dict):
        req_id = item.get("request_id")
    else:
        return None
    return req_id if isinstance(req_id, str) else None


def _scoped(identity: bytes, request_id: str) -> str:
    return f"{identity.hex():0>16.16}/{request_id}"


class ClientLoRAIds:
    """LoRA adapter ids are the clients' own, as request ids are: inside the core each
    (client, lora_int_id) gets an id of its own, so that two frontends of one daemon may
    both number their adapters from 1 (each server does) without taking each other's."""

    def __init__(self) -> None:
        self.to_core: dict[tuple[bytes, int], int] = {}
        self.to_client: dict[int, tuple[bytes, int]] = {}
        self.next_id = 1

    def core_id(self, identity: bytes, lora_id: int, new: bool = True) -> int:
        """The core's id for this client's adapter (0 if it has none and `new` is False)."""
        key = (identity, lora_id)
        if key not in self.to_core:
            if not new:
                return 0
            self.to_core[key], self.to_client[self.next_id] = self.next_id, key
            self.next_id += 1
        return self.to_core[key]

    def client_ids(self, identity: bytes, core_ids: list[int]) -> list[int]:
        """Of the core's adapters, this client's, by its own ids."""
        owners = (self.to_client.get(core_id) for core_id in core_ids)
        return sorted(key[1] for key in owners if key is not None and key[0] == identity)

    def forget(self, identity: bytes) -> list[int]:
        """Drops a client's ids; returns the core's ids it had."""
        gone = [key for key in self.to_core if key[0] == identity]
        core_ids = [self.to_core.pop(key) for key in gone]
        for core_id in core_ids:
            del self.to_client[core_id]
        return core_ids


def _process_age() -> float:
    """Seconds since this process started, from the kernel's own clock (to 10 ms; psutil's
    create_time rests on a boot time rounded to the second)."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time() - psutil.Process().create_time()


def run_engine_core(
    config: EngineConfig,
    input_address: str,
    output_address: str,
    parent_pid: int | None = None,
    auth_token: str = "",
    on_ready: Callable[[EngineCoreProc], None] | None = None,
) -> None:
    """Process entry point (spawned by a client or run by the engine-core daemon).
    `on_ready` runs once the engine is built and about to serve (a headless data-parallel
    rank registers with its frontend then)."""
    parallel = config.parallel_config
    # A data-parallel rank says which one it is in every line (its stats line included).
    name = "engine-core" if parallel.data_parallel_size == 1 else (
        f"engine-core-dp{parallel.data_parallel_rank}"
    )  # fmt: skip
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(message)s")

    def terminate(*_: Any) -> None:
        raise SystemExit(0)  # unwinds the engine loop into the shutdown below

    signal.signal(signal.SIGTERM, terminate)
    if parent_pid is not None:
        # A spawned core must not outlive the process that started it, nor leave its
        # private socket directory behind.
        ipc_dir = os.path.dirname(input_address[6:]) if input_address.startswith("ipc://") else None
        watch_parent(parent_pid, "engine core", lambda: remove_dir(ipc_dir))
    proc = None
    try:
        proc = EngineCoreProc(config, input_address, output_address, parent_pid, auth_token)
        if proc.startup_error is None:
            # What start-up made lives as long as this process: out of the garbage collector's
            # generations (as vLLM's engine core), whose full collections would walk it each
            # time. (Only here, in the core's own process: an in-process engine leaves its
            # user's heap alone.)
            gc.collect()
            gc.freeze()
        if on_ready is not None and proc.startup_error is None:
            on_ready(proc)
        proc.run()
    except SystemExit:
        logger.info("engine core stopping")
    finally:
        if proc is not None:
            proc.shutdown()
    os._exit(0 if proc is not None and proc.startup_error is None else 1)


def main() -> None:
    """`python -m tokenmill.core.engine_core_proc`: what a multiprocess client spawns. The
    engine config arrives as JSON on stdin, so nothing of the parent's __main__ is re-run."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--input-address", required=True)
    parser.add_argument("--output-address", required=True)
    parser.add_argument("--parent-pid", type=int, default=None)
    args = parser.parse_args()
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=EngineConfig)
    # A core on tcp (a Ray rank's, on its node's IP) demands the token its starter set.
    token = envs.TOKENMILL_AUTH_TOKEN if args.input_address.startswith("tcp://") else ""
    run_engine_core(config, args.input_address, args.output_address, args.parent_pid, token)


if __name__ == "__main__":
    main()
