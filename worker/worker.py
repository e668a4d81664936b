"""The Worker: one tensor-parallel rank. Sets up its device (and its place in the
torch.distributed group), loads its shard of the model, reports how much memory the KV cache
may take, allocates it, and runs steps.

The methods in its RPC table (`rpc_methods`) are what `Executor.collective_rpc` reaches; in
a worker process (worker/worker_proc.py) their arguments and results are decoded by their
annotations. The rest (setting up the device and the model) the worker does itself.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

import torch

from tokenmill.protocol.config import EngineConfig
from tokenmill.protocol.lora import LoRARequest
from tokenmill.protocol.scheduler_output import KVCacheSpec, ModelRunnerOutput, SchedulerOutput
from tokenmill.worker.lora.manager import LoRAManager
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.parallel_state import init_distributed, init_tensor_parallel
from tokenmill.worker.platform import platform_of

logger = logging.getLogger(__name__)


class Worker:
    # The RPC table: what an executor may call on every rank (collective_rpc). Their type
    # hints are the wire's types (protocol/rpc.py); a step is `execute_model` (its output)
    # or `submit_model` (a Future of it, the reply sent when it resolves).
    rpc_methods = frozenset(
        {
            "get_kv_cache_specs",
            "determine_available_memory",
            "initialize_kv_cache",
            "execute_model",
            "submit_model",
            "describe_shards",
            "model_memory",
            "add_lora",
            "remove_lora",
            "list_loras",
        }
    )
    # Of those, the calls whose ValueError is the caller's argument refused (an adapter's
    # rank, LoRA off): the executor raises it again as a ValueError. Any other failure, a
    # step's above all, is the worker's (a RuntimeError naming the rank).
    rpc_refusals = frozenset({"add_lora", "remove_lora", "list_loras"})

    def __init__(
        self,
        config: EngineConfig,
        rank: int,
        local_rank: int,
        local_world_size: int = 1,
        distributed_init_method: str = "env://",
    ) -> None:
        """`local_world_size`: ranks on this host, which share its cores and (on the CPU) its
        KV cache budget. `distributed_init_method`: how torch.distributed finds the other
        ranks when tensor_parallel_size > 1."""
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.local_world_size = local_world_size
        self.distributed_init_method = distributed_init_method
        self.platform = platform_of(config.device_config.device)
        self.device = torch.device("cpu")
        self.model_runner: ModelRunner | None = None

    def init_device(self) -> None:
        self.device = self.platform.device(self.local_rank)
        # The host's cores are shared by every rank of every engine (DP rank) on it.
        engines = self.config.parallel_config.num_local_dp_ranks
        self.platform.init_process(self.device, self.local_world_size * engines)
        world_size = self.config.parallel_config.tensor_parallel_size
        if world_size > 1:
            init_distributed(
                self.rank, world_size, self.distributed_init_method, self.platform.dist_backend
            )
        init_tensor_parallel(self.rank, world_size)
        torch.manual_seed(self.config.model_config.seed)
        self.model_runner = ModelRunner(self.config, self.device)

    def load_model(self) -> None:
        assert self.model_runner is not None
        self.model_runner.on_device(self.model_runner.load_model)

    def get_kv_cache_specs(self) -> list[KVCacheSpec]:
        assert self.model_runner is not None
        return self.model_runner.get_kv_cache_specs()

    def model_memory(self) -> dict[str, int]:
        """The loaded model's bytes: `weights_bytes` (its tensors) and `load_bytes` (what the
        load added to the process's memory: resident set on the CPU, allocated on CUDA)."""
        assert self.model_runner is not None
        return dict(self.model_runner.model_memory)

    def determine_available_memory(self) -> int:
        """Bytes this rank can give to its KV cache (Platform.kv_cache_budget: on the CPU a
        share of the host's RAM, on CUDA what a profiled step leaves of the GPU)."""
        runner = self.model_runner
        assert runner is not None
        return self.platform.kv_cache_budget(
            self.config.cache_config,
            self.device,
            self.local_world_size,
            lambda: runner.on_device(runner.profile_run),
            self.config.parallel_config.num_local_dp_ranks,
        )

    def initialize_kv_cache(self, config: EngineConfig, num_blocks: int) -> None:
        """Takes the config as the core settled it (max_model_len after auto-fit) and
        allocates `num_blocks` blocks in every layer."""
        assert self.model_runner is not None
        self.config = config
        runner = self.model_runner
        runner.on_device(lambda: runner.initialize_kv_cache(config, num_blocks))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step to its end and returns its output."""
        assert self.model_runner is not None
        if self.model_runner.overlap_steps:
            return self.model_runner.submit_model(scheduler_output).result()
        return self.model_runner.execute_model(scheduler_output)

    def submit_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """The executor's call for a step: its output as a Future. With the worker's steps
        overlapped (async scheduling on CUDA, ModelRunner.submit_model), it returns once the
        step is prepared and its forward queued, and whoever serves the call (the worker
        process's reply thread, the in-process executor) replies when it completes; in turn,
        the step has run and the Future is done."""
        assert self.model_runner is not None
        if self.model_runner.overlap_steps:
            return self.model_runner.submit_model(scheduler_output)
        future: Future[ModelRunnerOutput] = Future()
        future.set_result(self.model_runner.execute_model(scheduler_output))
        return future

    def close(self, wait: float = 0.0) -> bool:
        """Lets the runner's device thread end, waiting up to `wait` seconds for it; returns
        whether it has ended."""
        return self.model_runner is None or self.model_runner.close(wait)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Reads the adapter into host memory (a ValueError naming what is wrong if it cannot
        run here); False if it was added already."""
        manager = self._lora_manager()
        assert self.model_runner is not None
        # On the device's thread, which steps change the adapters from (and read their slots).
        return self.model_runner.on_device(lambda: manager.add(lora_request))

    def remove_lora(self, lora_id: int) -> bool:
        manager = self._lora_manager()
        assert self.model_runner is not None
        return self.model_runner.on_device(lambda: manager.remove(lora_id))

    def list_loras(self) -> list[int]:
        return sorted(self._lora_manager().list())

    def _lora_manager(self) -> LoRAManager:
        runner = self.model_runner
        if runner is None or runner.lora_manager is None:
            raise ValueError("LoRA is not enabled (start the engine with enable_lora=True)")
        return runner.lora_manager

    def describe_shards(self) -> dict[str, list[int]]:
        """The shape of every parameter this rank holds (a packed matmul weight's as [N, K]), and
        of one layer's KV cache under "kv_cache" (for checks that each rank holds only its
        share)."""
        assert self.model_runner is not None and self.model_runner.model is not None
        shapes = {
            name: list(getattr(p, "logical_shape", p.shape))
            for name, p in self.model_runner.model.named_parameters()
        }
        if self.model_runner.kv_caches:
            shapes["kv_cache"] = list(self.model_runner.kv_caches[0].shape)
        return shapes
