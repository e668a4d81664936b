"""UniProcExecutor: a single Worker living in the EngineCore process (TP=1).

`collective_rpc` is a direct method call, so a step costs no serialization at all. The
external launcher (torchrun) reuses it with a worker that is one rank of the torchrun group.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from tokenmill.core.executor.base import Executor


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        from tokenmill.worker.worker import Worker

        self.worker = Worker(self.config, rank=0, local_rank=0)
        self.worker.init_device()
        self.worker.load_model()

    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        result = getattr(self.worker, method)(*args, **(kwargs or {}))
        result = result if unique_reply_rank is not None else [result]
        if not non_block:
            return result
        future: Future[Any] = Future()
        future.set_result(result)
        return future

    def shutdown(self) -> None:
        self.worker = None  # type: ignore[assignment]
