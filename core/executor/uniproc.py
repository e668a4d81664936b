"""UniProcExecutor: a single Worker living in the EngineCore process (TP=1).

`collective_rpc` is a direct method call, so a step costs no serialization at all. Under
async scheduling every call runs on one worker thread instead (in order, the worker's set-up
included), so that the core schedules the next step while this one runs; the model's forward
releases the GIL. The external launcher (torchrun) reuses it with a worker that is one rank of
the torchrun group.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tokenmill.core.executor.base import Executor


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        self.thread: ThreadPoolExecutor | None = None
        if self.config.scheduler_config.async_scheduling:
            self.thread = ThreadPoolExecutor(1, thread_name_prefix="worker")
        self.worker = self._run(self._make_worker).result()

    def _make_worker(self) -> Any:
        from tokenmill.worker.worker import Worker

        worker = Worker(self.config, rank=0, local_rank=0)
        worker.init_device()
        worker.load_model()
        return worker

    def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Future:
        if self.thread is not None:
            return self.thread.submit(fn, *args, **kwargs)
        future: Future[Any] = Future()
        future.set_result(fn(*args, **kwargs))  # an exception propagates as it is
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
        def call() -> Any:
            result = getattr(self.worker, method)(*args, **(kwargs or {}))
            return result if unique_reply_rank is not None else [result]

        future = self._run(call)
        return future if non_block else future.result(timeout)

    def shutdown(self) -> None:
        if self.thread is not None:
            # A step still running finishes on its own; nothing waits for it here.
            self.thread.shutdown(wait=False, cancel_futures=True)
        self.worker = None  # type: ignore[assignment]
