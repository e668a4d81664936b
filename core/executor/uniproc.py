"""UniProcExecutor: a single Worker living in the EngineCore process (TP=1).

`collective_rpc` is a direct method call, so a step costs no serialization at all.
"""

from __future__ import annotations

from typing import Any

from tokenmill.core.executor.base import Executor


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        from tokenmill.worker.worker import Worker

        self.worker = Worker(self.config, rank=0, local_rank=0)
        self.worker.init_device()
        self.worker.load_model()

    def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict | None = None
    ) -> list[Any]:
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def shutdown(self) -> None:
        self.worker = None  # type: ignore[assignment]
