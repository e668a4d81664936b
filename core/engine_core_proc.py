"""EngineCoreProc: EngineCore in its own process, serving clients over ZeroMQ.

Three threads: the input thread receives and decodes client messages onto a queue; the main
thread runs the engine loop (block on the queue while idle, otherwise handle input, step,
route outputs); the output thread encodes and sends, so that socket work overlaps the model
step. Two ROUTER sockets are bound: input (clients' DEALERs send requests) and output (the
same DEALER identities receive their own requests' outputs). A frame that does not decode is
logged and dropped; it never stops the core. Started by a multiprocess client (spawned) or by
the `engine-core` daemon.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import sys
import threading
import time
from typing import Any

import msgspec
import psutil
import zmq

from tokenmill.core.engine_core import EngineCore
from tokenmill.protocol.codec import DecodeError, Decoder, Encoder
from tokenmill.protocol.config import EngineConfig
from tokenmill.protocol.messages import (
    PROTOCOL_VERSION,
    EngineCoreOutputs,
    EngineCoreRequest,
    Hello,
    OutputType,
    Ready,
    RequestType,
    StartupError,
    UtilityCall,
    UtilityResult,
)

logger = logging.getLogger(__name__)

# Utility methods a client may call on the core, by name.
UTILITIES = ("get_stats", "reset_prefix_cache", "check_health")
_DECODERS = {
    RequestType.HELLO: Decoder(Hello),
    RequestType.ADD: Decoder(list[EngineCoreRequest]),
    RequestType.ABORT: Decoder(list[str]),
    RequestType.UTILITY: Decoder(UtilityCall),
}


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
        self.input_queue: queue.Queue[tuple[bytes, bytes, Any]] = queue.Queue()
        self.output_queue: queue.Queue[tuple[bytes, bytes, Any] | None] = queue.Queue()
        self.ctx = zmq.Context()
        self.input_socket = self.ctx.socket(zmq.ROUTER)
        self.input_socket.bind(input_address)
        self.output_socket = self.ctx.socket(zmq.ROUTER)
        self.output_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.output_socket.bind(output_address)
        self.clients: set[bytes] = set()
        self.request_owner: dict[str, bytes] = {}
        self.startup_error: str | None = None
        self.core: EngineCore | None = None
        threading.Thread(target=self._input_loop, daemon=True, name="core-input").start()
        threading.Thread(target=self._output_loop, daemon=True, name="core-output").start()
        if parent_pid is not None:
            threading.Thread(
                target=_exit_with_parent, args=(parent_pid,), daemon=True, name="core-watchdog"
            ).start()
        try:
            self.core = EngineCore(config)
        except Exception as e:  # answered to every client that says hello
            logger.exception("engine core failed to start")
            self.startup_error = f"{type(e).__name__}: {e}"

    # --------------------------------------------------------------------------- threads
    def _input_loop(self) -> None:
        while True:
            try:
                frames = self.input_socket.recv_multipart(copy=False)
            except zmq.ZMQError:
                return
            if len(frames) < 3:
                logger.warning("dropped a message with %d frames", len(frames))
                continue
            identity, kind = frames[0].bytes, frames[1].bytes
            decoder = _DECODERS.get(kind)
            if decoder is None:
                logger.warning("dropped a message of unknown type %r", kind[:8])
                continue
            try:
                payload = decoder.decode([f.buffer for f in frames[2:]])
            except DecodeError as e:
                logger.warning("dropped a malformed %r message: %s", kind, e)
                continue
            self.input_queue.put((identity, kind, payload))

    def _output_loop(self) -> None:
        encoder = Encoder()
        while True:
            item = self.output_queue.get()
            if item is None:
                return
            identity, kind, payload = item
            frames = [identity, kind, *encoder.encode(payload)]
            # A client's output socket may still be connecting when its hello is answered;
            # later messages to a client that is gone are dropped at once, so that no client
            # can stall the others.
            attempts = 100 if kind in (OutputType.READY, OutputType.STARTUP_ERROR) else 1
            for attempt in range(attempts):
                try:
                    self.output_socket.send_multipart(frames, copy=False)
                    break
                except zmq.ZMQError as e:
                    if e.errno != zmq.EHOSTUNREACH:
                        raise
                    if attempt + 1 < attempts:
                        time.sleep(0.01)
            else:
                logger.warning("client %s is gone; dropped its %r message", identity.hex(), kind)

    def _send(self, identity: bytes, kind: bytes, payload: Any) -> None:
        self.output_queue.put((identity, kind, payload))

    # ---------------------------------------------------------------------- engine loop
    def run(self) -> None:
        if self.startup_error is not None:
            self._refuse_hellos(seconds=3.0)
            return
        while True:
            core = self.core
            busy = core is not None and core.has_unfinished_requests()
            if not busy:
                self._handle(*self.input_queue.get())  # idle: block, no spinning
            while True:
                try:
                    self._handle(*self.input_queue.get_nowait())
                except queue.Empty:
                    break
            if core is not None and core.has_unfinished_requests():
                self._route(core.step())

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
        if kind == RequestType.HELLO:
            self._hello(identity, payload)
            return
        if identity not in self.clients or self.core is None:
            logger.warning("dropped a %r message from a client without a handshake", kind)
            return
        # Request ids are the clients' own: inside the core they are prefixed with the
        # client's identity, so that two clients may use the same id.
        if kind == RequestType.ADD:
            for request in payload:
                request.request_id = _scoped(identity, request.request_id)
                self.request_owner[request.request_id] = identity
                self.core.add_request(request)
        elif kind == RequestType.ABORT:
            scoped = [_scoped(identity, req_id) for req_id in payload]
            self.core.abort_requests(scoped)
            for req_id in scoped:
                self.request_owner.pop(req_id, None)
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
        for identity, outs in per_client.items():
            self._send(identity, OutputType.OUTPUTS, EngineCoreOutputs(outs, outputs.timestamp))


_SCOPE_LEN = 17  # 16 hex digits of the client's 8-byte identity, then "/"


def _scoped(identity: bytes, request_id: str) -> str:
    return f"{identity.hex():0>16.16}/{request_id}"


def _exit_with_parent(parent_pid: int) -> None:
    """A spawned core must not outlive the process that started it."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid or not psutil.pid_exists(parent_pid):
            logger.error("parent process %d is gone; engine core exits", parent_pid)
            os._exit(1)


def run_engine_core(
    config: EngineConfig,
    input_address: str,
    output_address: str,
    parent_pid: int | None = None,
    auth_token: str = "",
) -> None:
    """Process entry point (spawned by a client or run by the engine-core daemon)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    proc = EngineCoreProc(config, input_address, output_address, parent_pid, auth_token)
    proc.run()
    os._exit(1)  # run() returns only after a failed start


def main() -> None:
    """`python -m tokenmill.core.engine_core_proc`: what a multiprocess client spawns. The
    engine config arrives as JSON on stdin, so nothing of the parent's __main__ is re-run."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--input-address", required=True)
    parser.add_argument("--output-address", required=True)
    parser.add_argument("--parent-pid", type=int, default=None)
    args = parser.parse_args()
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=EngineConfig)
    run_engine_core(config, args.input_address, args.output_address, args.parent_pid)


if __name__ == "__main__":
    main()
