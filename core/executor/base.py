"""The executor interface: EngineCore's one way to reach its workers.

`collective_rpc(method, args)` calls a Worker method on every rank and returns each rank's
result; the named helpers below are built on it. Implementations: UniProcExecutor (one worker
in this process); MultiprocExecutor and the external launcher come with tensor parallelism.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from tokenmill.protocol.config import EngineConfig
from tokenmill.protocol.scheduler_output import KVCacheSpec, ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._init_executor()

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        parallel = config.parallel_config
        backend = parallel.distributed_executor_backend
        if parallel.tensor_parallel_size == 1 and backend in (None, "uni"):
            from tokenmill.core.executor.uniproc import UniProcExecutor

            return UniProcExecutor
        raise NotImplementedError(
            f"tensor_parallel_size={parallel.tensor_parallel_size} with "
            f"distributed_executor_backend={backend!r} needs the multiprocess executor, which "
            "this version does not have yet; use tensor_parallel_size=1"
        )

    @abstractmethod
    def _init_executor(self) -> None: ...

    @abstractmethod
    def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict | None = None
    ) -> list[Any]:
        """Calls `Worker.<method>(*args, **kwargs)` on every rank; one result per rank."""

    def determine_available_memory(self) -> int:
        # Every rank must fit the same number of blocks, so the smallest rank decides.
        return min(self.collective_rpc("determine_available_memory"))

    def get_kv_cache_specs(self) -> list[KVCacheSpec]:
        return self.collective_rpc("get_kv_cache_specs")[0]

    def initialize_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks, max_model_len))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", (scheduler_output,))[0]

    def shutdown(self) -> None:
        """Releases workers; safe to call more than once."""
