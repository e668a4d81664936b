"""A worker process: one tensor-parallel rank started by the MultiprocExecutor.

`python -m tokenmill.worker.worker_proc --rank R ...` with the engine config as JSON on stdin.
It pulls calls from its own socket and pushes replies to the executor's (protocol/rpc.py),
joins the torch.distributed group, loads its shard of the weights (all ranks at once), and
reports ready or the error that stopped it. Then it serves `collective_rpc` calls in order
until told to shut down. A call that raises is answered with the error's text (and logged
with its traceback here); a ValueError of a call in `Worker.rpc_refusals` (an argument
refused: an adapter's rank, say) also with its type, which the executor raises again.
Replies leave from a thread of their own, in the calls' order: a step under async scheduling
returns a Future once queued on the runner's device thread, and this process goes on to the
next call while the reply waits for it. The process exits on its own within a second of its
parent's death, removing the executor's socket directory on the way out.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import sys
import threading
import traceback
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq

from tokenmill.protocol.codec import Decoder, Encoder
from tokenmill.protocol.config import EngineConfig
from tokenmill.protocol.process import close_sockets, remove_dir, watch_parent
from tokenmill.protocol.rpc import SHUTDOWN, STARTUP_CALL_ID, RpcCall, RpcReply, argument_type
from tokenmill.protocol.sockets import CurveKeys
from tokenmill.worker.worker import Worker

logger = logging.getLogger(__name__)


class WorkerProc:
    def __init__(
        self,
        worker: Worker,
        call_address: str,
        reply_address: str,
        curve: CurveKeys | None = None,
    ) -> None:
        """Serves `worker`'s RPC table: calls pulled from call_address, replies pushed to
        reply_address (with `curve`, as an authenticated, encrypted CURVE client)."""
        self.rank = worker.rank
        self.ctx = zmq.Context()
        self.calls = self.ctx.socket(zmq.PULL)
        self.replies = self.ctx.socket(zmq.PUSH)
        for socket, address in ((self.calls, call_address), (self.replies, reply_address)):
            if curve is not None:
                curve.make_client(socket)
            socket.connect(address)
        self.encoder = Encoder()
        self.header_decoder = Decoder(RpcCall)
        self.decoders: dict[tuple[str, int, tuple[str, ...]], Decoder] = {}
        self.worker = worker

    def start(self) -> bool:
        try:
            self.worker.init_device()
            self.worker.load_model()
        except Exception as e:
            logger.exception("worker rank %d failed to start", self.rank)
            self._reply(STARTUP_CALL_ID, False, _error_text(e))
            return False
        self._reply(STARTUP_CALL_ID, True, None)
        return True

    def serve(self) -> None:
        replies: queue.SimpleQueue = queue.SimpleQueue()
        sender = threading.Thread(target=self._send, args=(replies,), daemon=True, name="replies")
        sender.start()
        try:
            while True:
                frames = self.calls.recv_multipart(copy=False)
                call = self.header_decoder.decode([frames[0].buffer])
                if call.method == SHUTDOWN:
                    return
                try:
                    args = self._decoder(call).decode([f.buffer for f in frames[1:]])
                    positional = args[: call.num_args]
                    keywords = dict(zip(call.kwarg_names, args[call.num_args :]))
                    result = getattr(self.worker, call.method)(*positional, **keywords)
                    replies.put((call, result))
                except Exception as e:
                    logger.exception("worker rank %d: %s failed", self.rank, call.method)
                    replies.put((call, e))
        finally:
            replies.put(None)
            sender.join(timeout=5.0)  # the socket is closed after; never wait for ever

    def _send(self, replies: queue.SimpleQueue) -> None:
        """The replies' thread: sends each in turn, once its Future (if any) completes. Every
        rank reports an error; a result goes out from the rank the call asked for (or all)."""
        while (item := replies.get()) is not None:
            call, result = item
            if isinstance(result, Future):
                try:
                    result = result.result()
                except Exception as e:
                    logger.exception("worker rank %d: %s failed", self.rank, call.method)
                    result = e
            if type(result) is ValueError and call.method in Worker.rpc_refusals:
                self._reply(call.call_id, False, str(result), "ValueError")  # the type travels
            elif isinstance(result, Exception):
                self._reply(call.call_id, False, _error_text(result))
            elif call.reply_rank is None or call.reply_rank == self.rank:
                self._reply(call.call_id, True, result)

    def _decoder(self, call: RpcCall) -> Decoder:
        key = (call.method, call.num_args, tuple(call.kwarg_names))
        decoder = self.decoders.get(key)
        if decoder is None:
            decoder = self.decoders[key] = Decoder(argument_type(Worker, *key))
        return decoder

    def _reply(self, call_id: int, ok: bool, payload: Any, error_type: str = "") -> None:
        header = msgspec.msgpack.encode(RpcReply(call_id, self.rank, ok, error_type))
        self.replies.send_multipart([header, *self.encoder.encode(payload)], copy=False)

    def close(self) -> None:
        # A moment for the last reply (a start-up error, say) to leave.
        close_sockets(self.ctx, [self.calls, self.replies], linger_ms=1000)


def call_address(ipc_dir: str, rank: int) -> str:
    return f"ipc://{ipc_dir}/calls-{rank}"


def reply_address(ipc_dir: str) -> str:
    return f"ipc://{ipc_dir}/replies"


def _error_text(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--ipc-dir", required=True, help="the executor's sockets (0700)")
    parser.add_argument("--init-method", required=True, help="torch.distributed init method")
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s worker-{args.rank} %(levelname)s %(message)s"
    )
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=EngineConfig)
    watch_parent(args.parent_pid, f"worker rank {args.rank}", lambda: remove_dir(args.ipc_dir))
    tp = config.parallel_config.tensor_parallel_size
    # All ranks are on this host: the local rank is the rank.
    worker = Worker(config, args.rank, args.rank, tp, args.init_method)
    proc = WorkerProc(worker, call_address(args.ipc_dir, args.rank), reply_address(args.ipc_dir))
    started = proc.start()
    if started:
        proc.serve()
    proc.close()
    # Skip interpreter teardown: a process group whose peers are gone can block it.
    logging.shutdown()
    os._exit(0 if started else 1)


if __name__ == "__main__":
    main()
