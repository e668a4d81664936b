"""MultiprocExecutor: one worker process per tensor-parallel rank, on this host.

Workers are fresh interpreters (`python -m tokenmill.worker.worker_proc`) that load their
shards concurrently and report ready, or the error that stopped them, within a deadline. Each
`collective_rpc` call is encoded once and pushed to every rank (protocol/rpc.py: msgspec, array
frames, never pickle); replies come back on one socket and complete the call's Future, so a
call may be waited for on another thread while the next one is sent (`non_block`). A monitor
thread waits on the workers' process sentinels: the first exit marks the executor failed,
stops the other workers and calls the failure callback. Sockets live in a private 0700
directory; torch.distributed rendezvouses through a file in it (no listening port), and gloo
and NCCL are kept on loopback.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import signal
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from tokenmill.core.executor.base import Executor
from tokenmill.protocol.codec import Decoder, Encoder
from tokenmill.protocol.process import (
    close_sockets,
    remove_dir,
    start_module,
    stop_processes,
    wait_for_exit,
)
from tokenmill.protocol.rpc import (
    SHUTDOWN,
    STARTUP_CALL_ID,
    RpcCall,
    RpcReply,
    return_type,
    rpc_method,
)
from tokenmill.worker.worker import Worker
from tokenmill.worker.worker_proc import call_address, reply_address

logger = logging.getLogger(__name__)

WORKER_STARTUP_TIMEOUT_S = 240.0  # loading a large model from disk on every rank
_POLL_MS = 100  # how often a waiting caller checks for a dead worker
_SEND_TIMEOUT_MS = 30_000  # a worker that leaves 1000 calls unread is not coming back
# A rank's error waits this long for a worker's death to be noticed: when a peer died, the
# survivors' collectives fail first (connection reset) and the death, noticed a moment later,
# is the cause. The peer may even have answered the call before it died.
_FAILURE_GRACE_S = 1.0


@dataclass
class _Call:
    method: str
    future: Future
    waiting_for: set[int]  # ranks whose reply is still missing
    single: bool  # unique_reply_rank: the result is that rank's, not a list
    results: dict[int, Any] = field(default_factory=dict)
    error: str | None = None  # the first rank's failure
    failed_at: float = 0.0
    refused: str | None = None  # the first refusal's message (a ValueError: the caller's)
    other_failure: bool = False  # a rank failed otherwise than by refusing

    def exception(self) -> BaseException:
        """The call's failure: a ValueError where every rank that answered refused the
        argument (what a call in this process would raise), else a RuntimeError naming the
        first rank that failed (ranks that disagree are out of step: the workers' fault)."""
        if self.refused is not None and not self.other_failure and not self.results:
            return ValueError(self.refused)
        return RuntimeError(self.error)


class MultiprocExecutor(Executor):
    def _init_executor(self) -> None:
        self.world_size = self.config.parallel_config.tensor_parallel_size
        self.ctx = zmq.Context()
        self.call_sockets = [self.ctx.socket(zmq.PUSH) for _ in range(self.world_size)]
        for socket in self.call_sockets:
            socket.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
        self.reply_socket = self.ctx.socket(zmq.PULL)
        self.call_addresses, self.reply_address = self._bind_sockets()
        self.encoder = Encoder()
        self.send_lock = threading.Lock()
        self.receive_lock = threading.Lock()
        self.calls: dict[int, _Call] = {}
        self.call_ids = itertools.count()
        self.decoders: dict[str, Decoder] = {}
        self.failure: str | None = None
        self.stopping = threading.Event()
        try:
            self.workers = self._start_workers()
        except BaseException:
            self._abandon_start()
            raise
        self._finalizer = weakref.finalize(
            self,
            _shutdown,
            self._worker_stopper(),
            self.stopping,
            self.ctx,
            [*self.call_sockets, self.reply_socket],
            self._cleanup,
        )
        try:
            self._wait_until_ready(WORKER_STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        threading.Thread(
            target=_monitor,
            args=(weakref.ref(self), self._exit_waiter(), self.stopping),
            daemon=True,
            name="executor-monitor",
        ).start()

    # ------------------------------------------------ what differs where workers live
    def _bind_sockets(self) -> tuple[list[str], str]:
        """Binds the call sockets and the reply socket; returns their addresses. Here: ipc
        sockets in a private (0700) directory, removed by `_cleanup`."""
        self.ipc_dir = tempfile.mkdtemp(prefix="tokenmill-workers-")
        self._cleanup = functools.partial(remove_dir, self.ipc_dir)
        calls = [call_address(self.ipc_dir, rank) for rank in range(self.world_size)]
        for socket, address in zip(self.call_sockets, calls):
            socket.bind(address)
        self.reply_socket.bind(reply_address(self.ipc_dir))
        return calls, reply_address(self.ipc_dir)

    def _abandon_start(self) -> None:
        """Releases what was made before starting the workers failed (no finalizer owns
        it yet): the sockets and their directory."""
        close_sockets(self.ctx, [*self.call_sockets, self.reply_socket])
        self._cleanup()

    def _worker_stopper(self) -> Callable[[], None]:
        """Stops every worker that has not exited after the shutdown call (SIGTERM, then
        SIGKILL); holds no reference to the executor (the finalizer calls it)."""
        return functools.partial(_stop_procs, self.workers)

    def _exit_waiter(self) -> Callable[[threading.Event], int | None]:
        """Blocks until some worker exits (its rank) or the event is set (None)."""
        return functools.partial(wait_for_exit, self.workers)

    def _exited(self, rank: int) -> str | None:
        """How rank's worker ended, if it has."""
        proc = self.workers[rank]
        if proc.poll() is None:
            return None
        return f"worker rank {rank} (pid {proc.pid}) exited ({_exit_status(proc.returncode)})"

    def _death(self, rank: int) -> str:
        """The failure message for rank's worker's death."""
        proc = self.workers[rank]
        return f"worker rank {rank} (pid {proc.pid}) died ({_exit_status(proc.returncode)})"

    def _stop_all(self) -> None:
        """Stops the workers still running after one died (from the monitor's thread)."""
        stop_processes(self.workers, timeout=2.0)

    def _start_workers(self) -> list:
        # Keep torch.distributed's own sockets on loopback unless the user chose otherwise.
        env = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", **os.environ}
        args = [
            f"--ipc-dir={self.ipc_dir}",
            f"--init-method=file://{self.ipc_dir}/dist-store",
            f"--parent-pid={os.getpid()}",
        ]
        return [
            start_module(
                "tokenmill.worker.worker_proc", [f"--rank={rank}", *args], self.config, env
            )
            for rank in range(self.world_size)
        ]

    def _wait_until_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        decoder = Decoder(str | None)
        pending = set(range(self.world_size))
        while pending:
            if self.reply_socket.poll(_POLL_MS):
                header, *payload = self.reply_socket.recv_multipart(copy=False)
                reply = msgspec.msgpack.decode(header.buffer, type=RpcReply)
                if reply.call_id != STARTUP_CALL_ID:
                    continue
                if not reply.ok:
                    error = decoder.decode([f.buffer for f in payload])
                    raise RuntimeError(f"worker rank {reply.rank} failed to start: {error}")
                pending.discard(reply.rank)
                continue
            for rank in range(self.world_size):
                exited = self._exited(rank)
                if exited is not None:
                    raise RuntimeError(f"{exited} during start-up")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"worker ranks {sorted(pending)} were not ready within {timeout:.0f} s"
                )
        logger.info("%d worker processes ready", self.world_size)

    # ------------------------------------------------------------------------------- calls
    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        rpc_method(Worker, method)  # (a method the workers do not serve fails here)
        kwargs = kwargs or {}
        ranks = range(self.world_size) if unique_reply_rank is None else [unique_reply_rank]
        future = _RpcFuture(self, method, timeout)
        call = _Call(method, future, set(ranks), unique_reply_rank is not None)
        with self.send_lock:
            self.check_health()
            call_id = next(self.call_ids)
            header = RpcCall(call_id, method, len(args), list(kwargs), unique_reply_rank)
            # One encoding, sent to every rank; the array frames are not copied.
            frames = [
                msgspec.msgpack.encode(header),
                *self.encoder.encode((*args, *kwargs.values())),
            ]
            self.calls[call_id] = call
            for rank, socket in enumerate(self.call_sockets):
                try:
                    socket.send_multipart(frames, copy=False)
                except zmq.Again:
                    raise RuntimeError(f"worker rank {rank} takes no more calls") from None
        return future if non_block else future.result()

    def _wait(self, future: _RpcFuture, timeout: float | None) -> None:
        """Receives replies (for any call) until `future` is complete; fails it when a
        worker is dead or its deadline passes."""
        deadline = future.deadline
        if timeout is not None:
            deadline = min(deadline or float("inf"), time.monotonic() + timeout)
        while not future.done():
            with self.receive_lock:
                if future.done():
                    return
                if self.failure is not None:
                    for call_id, call in list(self.calls.items()):  # a sender may add one
                        self._fail(call, RuntimeError(self.failure))
                        self.calls.pop(call_id, None)
                    return
                now = time.monotonic()
                for call_id, call in list(self.calls.items()):
                    if call.error is not None and now > call.failed_at + _FAILURE_GRACE_S:
                        self._fail(call, call.exception())
                        if not call.waiting_for:  # every rank has answered: done with it
                            del self.calls[call_id]
                if deadline is not None and now > deadline:
                    raise TimeoutError(f"{future.method} got no reply from every worker in time")
                self._receive(_POLL_MS)

    def _receive(self, timeout_ms: int) -> None:
        if not self.reply_socket.poll(timeout_ms):
            return
        while True:
            try:
                header, *payload = self.reply_socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            reply = msgspec.msgpack.decode(header.buffer, type=RpcReply)
            frames = [f.buffer for f in payload]
            call = self.calls.get(reply.call_id)
            if call is None:
                if not reply.ok:  # it failed where the rank that answers did not
                    error = msgspec.msgpack.decode(frames[0], type=str)
                    if reply.error_type:
                        error = f"{reply.error_type}: {error}"
                    self.failure = f"worker rank {reply.rank} failed (out of step): {error}"
                continue
            call.waiting_for.discard(reply.rank)
            if not reply.ok:
                error = msgspec.msgpack.decode(frames[0], type=str)
                if reply.error_type:
                    call.refused = call.refused or error
                    error = f"{reply.error_type}: {error}"
                else:
                    call.other_failure = True
                if call.error is None:
                    call.error = f"worker rank {reply.rank} failed in {call.method}: {error}"
                    call.failed_at = time.monotonic()
            else:
                call.results[reply.rank] = self._decoder(call.method).decode(frames)
            if not call.waiting_for:
                # Every rank has answered (a failed call stays until then, so that the other
                # ranks' answers to it are not mistaken for ranks out of step). A call that
                # failed on some ranks only waits out the grace period (a peer may have died
                # right after answering); one that failed on every rank fails now.
                if call.error is not None and call.results:
                    continue
                del self.calls[reply.call_id]
                if call.error is not None:
                    self._fail(call, call.exception())
                elif not call.future.done():
                    results = call.results
                    value = next(iter(results.values())) if call.single else [
                        results[rank] for rank in sorted(results)
                    ]  # fmt: skip
                    call.future.set_result(value)

    @staticmethod
    def _fail(call: _Call, error: BaseException) -> None:
        """Fails the call's future, unless an earlier failure already did."""
        if not call.future.done():
            call.future.set_exception(error)

    def _decoder(self, method: str) -> Decoder:
        decoder = self.decoders.get(method)
        if decoder is None:
            decoder = self.decoders[method] = Decoder(return_type(Worker, method))
        return decoder

    def check_health(self) -> None:
        if self.failure is not None:
            raise RuntimeError(self.failure)

    # -------------------------------------------------------------------------- lifetime
    def _on_worker_death(self, rank: int) -> None:
        self.failure = self._death(rank)
        logger.error("%s; stopping the other workers", self.failure)
        self._stop_all()
        if self.failure_callback is not None:
            self.failure_callback(self.failure)

    def shutdown(self) -> None:
        self._finalizer()


class _RpcFuture(Future):
    """A call's result; waiting for it receives the workers' replies on this thread."""

    def __init__(self, executor: MultiprocExecutor, method: str, timeout: float | None) -> None:
        super().__init__()
        self.executor = executor
        self.method = method
        self.deadline = None if timeout is None else time.monotonic() + timeout

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            self.executor._wait(self, timeout)
        return super().result(0)


def _monitor(
    executor_ref: weakref.ref,
    wait: Callable[[threading.Event], int | None],
    stopping: threading.Event,
) -> None:
    rank = wait(stopping)
    executor = executor_ref()
    if rank is not None and executor is not None and not stopping.is_set():
        executor._on_worker_death(rank)


def _shutdown(
    stop_workers: Callable[[], None],
    stopping: threading.Event,
    ctx: zmq.Context,
    sockets: list,
    cleanup: Callable[[], None],
) -> None:
    """Asks every worker to exit, stops whichever has not (stop_workers: within seconds),
    then closes the sockets and cleans up (their directory, say). Every wait here has a
    deadline."""
    stopping.set()
    for socket in sockets[:-1]:  # the call sockets (the last one is the replies')
        try:
            socket.send(msgspec.msgpack.encode(RpcCall(-1, SHUTDOWN)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
    stop_workers()
    close_sockets(ctx, sockets)
    cleanup()


def _stop_procs(workers: list) -> None:
    """Gives worker processes 2 s to exit after the shutdown call, then stops them."""
    deadline = time.monotonic() + 2.0
    for proc in workers:
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
    stop_processes(workers, timeout=3.0)


def _exit_status(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
