"""The executor interface: EngineCore's one way to reach its workers.

`collective_rpc(method, timeout, args, kwargs, non_block, unique_reply_rank)` (vLLM's
signature) calls a Worker method on every rank; the named helpers below are built on it.
Implementations: UniProcExecutor (one worker in this process), MultiprocExecutor (one worker
process per tensor-parallel rank) and ExternalLauncherExecutor (this process is one rank of a
torchrun job). An executor whose workers die calls the registered failure callback, so that an
idle engine notices too.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from tokenmill.protocol.config import EngineConfig
from tokenmill.protocol.scheduler_output import KVCacheSpec, ModelRunnerOutput, SchedulerOutput

FailureCallback = Callable[[str], None]


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.failure_callback: FailureCallback | None = None
        self._init_executor()

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        parallel = config.parallel_config
        backend = parallel.distributed_executor_backend
        if backend == "external_launcher":
            from tokenmill.core.executor.external_launcher import ExternalLauncherExecutor

            return ExternalLauncherExecutor
        if backend == "ray":
            from tokenmill.core.executor.ray import RayExecutor

            return RayExecutor
        if backend == "mp" or (backend is None and parallel.tensor_parallel_size > 1):
            from tokenmill.core.executor.multiproc import MultiprocExecutor

            return MultiprocExecutor
        if parallel.tensor_parallel_size > 1:
            raise ValueError(
                f"distributed_executor_backend={backend!r} runs one rank, but "
                f'tensor_parallel_size={parallel.tensor_parallel_size}; use "mp" (or leave '
                "it unset) for one worker process per rank"
            )
        from tokenmill.core.executor.uniproc import UniProcExecutor

        return UniProcExecutor

    @abstractmethod
    def _init_executor(self) -> None: ...

    @abstractmethod
    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """Calls `Worker.<method>(*args, **kwargs)` on every rank. Returns one result per
        rank, or only rank `unique_reply_rank`'s result; with `non_block`, a Future of that.
        Raises TimeoutError after `timeout` seconds without every reply, ValueError when
        every rank refused an argument (a call of `Worker.rpc_refusals`: an adapter that
        cannot run), and RuntimeError (naming the rank) when a worker fails or dies."""

    def register_failure_callback(self, callback: FailureCallback) -> None:
        """`callback(cause)` runs (on another thread) once the workers are found dead."""
        self.failure_callback = callback

    def wait_for_forward(self, step: int, timeout: float) -> None:
        """Returns once the workers have started the forward of the `step`-th step with
        tokens (counted from 1), or after `timeout` seconds. Only an executor whose workers
        share the core's interpreter waits (see UniProcExecutor)."""

    def check_health(self) -> None:
        """Raises RuntimeError, with the cause, if the workers are dead."""

    def determine_available_memory(self) -> int:
        # Every rank must fit the same number of blocks, so the smallest rank decides.
        return min(self.collective_rpc("determine_available_memory"))

    def get_kv_cache_specs(self) -> list[KVCacheSpec]:
        # Every rank holds the same number of KV heads (split or replicated alike).
        return self.collective_rpc("get_kv_cache_specs", unique_reply_rank=0)

    def initialize_kv_cache(self, config: EngineConfig, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", args=(config, num_blocks))

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        # Every rank samples the same tokens; rank 0 reports them.
        return self.collective_rpc(
            "submit_model", args=(scheduler_output,), non_block=non_block, unique_reply_rank=0
        )

    def shutdown(self) -> None:
        """Releases workers; safe to call more than once."""
