"""UniProcExecutor: a single Worker living in the EngineCore process (TP=1).

`collective_rpc` is a direct method call, so a step costs no serialization at all. Under
async scheduling every call runs on one worker thread instead (in order, the worker's set-up
included), so that the core schedules the next step while this one runs; the model's forward
releases the GIL. With CUDA the runner also runs each step's forward and sampling on a device
thread of its own, while the worker's thread prepares the next step (ModelRunner.submit_model).
The threads share the GIL, so the core does its own work (the last step's update, the next
schedule) once the worker's next forward has started (`wait_for_forward`), not while the
worker prepares that step's inputs. The external launcher (torchrun) reuses it with a worker
that is one rank of the torchrun group.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Any

from tokenmill.core.executor.base import Executor
from tokenmill.protocol.rpc import rpc_method
from tokenmill.protocol.threads import OrderedThread, chain

logger = logging.getLogger(__name__)

# How long shutdown waits for each of the worker's threads to finish the call it is running
# (a step: seconds at most on the CPU).
_THREAD_END_WAIT_S = 10.0


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        self.thread: OrderedThread | None = None
        if self.config.scheduler_config.async_scheduling:
            self.thread = OrderedThread("worker")
        self.worker = self._run(self._make_worker).result()
        self.forwards = threading.Condition()
        self.num_forwards = 0  # steps whose forward has started
        if self.thread is not None:
            self.worker.model_runner.on_forward = self._forward_started

    def _make_worker(self) -> Any:
        from tokenmill.worker.worker import Worker

        worker = Worker(self.config, rank=0, local_rank=0)
        worker.init_device()
        worker.load_model()
        return worker

    def _run(self, fn: Any) -> Future:
        if self.thread is not None:
            return self.thread.submit(fn)
        future: Future[Any] = Future()
        result = fn()  # an exception propagates as it is
        if isinstance(result, Future):  # a step (Worker.submit_model), already done
            chain(result, future)
        else:
            future.set_result(result)
        return future

    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        fn = rpc_method(type(self.worker), method).__get__(self.worker)

        def call() -> Any:
            result = fn(*args, **(kwargs or {}))
            if unique_reply_rank is not None:
                return result
            if isinstance(result, Future):  # a step whose device part is queued
                listed: Future[Any] = Future()
                chain(result, listed, lambda r: [r])
                return listed
            return [result]

        future = self._run(call)
        return future if non_block else future.result(timeout)

    def _forward_started(self) -> None:  # on the runner's device thread
        with self.forwards:
            self.num_forwards += 1
            self.forwards.notify_all()

    def wait_for_forward(self, step: int, timeout: float) -> None:
        if self.thread is not None:
            with self.forwards:
                self.forwards.wait_for(lambda: self.num_forwards >= step, timeout)

    def shutdown(self) -> None:
        if self.thread is not None:
            # The worker is dropped here, once its threads have finished the calls they were
            # running: a call still running holds the worker, and on the CPU its KV cache is
            # a Python buffer (platform.zeroed), whose release takes the GIL. Let go of on a
            # thread the exiting interpreter has stopped, it aborted the process. Bounded:
            # a call that never ends is left to the daemon threads.
            ended = self.thread.close(wait=_THREAD_END_WAIT_S)
            ended = self.worker.close(wait=_THREAD_END_WAIT_S if ended else 0.0) and ended
            if not ended:
                logger.warning(
                    "the worker's threads did not end within %.0f s of shutdown",
                    _THREAD_END_WAIT_S,
                )
        self.worker = None  # type: ignore[assignment]
