"""The Worker: one tensor-parallel rank. Sets up its device, loads its shard of the model,
reports how much memory the KV cache may take, allocates it, and runs steps.

Every public method here is reachable through `Executor.collective_rpc`.
"""

from __future__ import annotations

import logging

import psutil
import torch

from tokenmill.protocol import envs
from tokenmill.protocol.config import EngineConfig
from tokenmill.protocol.scheduler_output import KVCacheSpec, ModelRunnerOutput, SchedulerOutput
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.parallel_state import init_tensor_parallel

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, rank: int, local_rank: int) -> None:
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.device = torch.device("cpu")
        self.model_runner: ModelRunner | None = None

    def init_device(self) -> None:
        if self.config.device_config.device == "cuda":
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
        init_tensor_parallel(self.rank, self.config.parallel_config.tensor_parallel_size)
        torch.manual_seed(self.config.model_config.seed)
        self.model_runner = ModelRunner(self.config, self.device)

    def load_model(self) -> None:
        assert self.model_runner is not None
        self.model_runner.load_model()

    def get_kv_cache_specs(self) -> list[KVCacheSpec]:
        assert self.model_runner is not None
        return self.model_runner.get_kv_cache_specs()

    def determine_available_memory(self) -> int:
        """Bytes this rank can give to its KV cache.

        CPU: `kv_cache_memory_bytes`, else TOKENMILL_CPU_KV_FRACTION (default 0.25) of the
        RAM psutil reports available. CUDA: `kv_cache_memory_bytes`, else
        `total * gpu_memory_utilization` minus what is in use after loading the weights,
        less a tenth kept for activations.
        """
        cache = self.config.cache_config
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes
        if self.device.type == "cpu":
            return int(psutil.virtual_memory().available * envs.TOKENMILL_CPU_KV_FRACTION)
        # Weights are loaded by now; activations are not profiled yet, so a tenth of what is
        # left stays free for them.
        free, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * cache.gpu_memory_utilization) - (total - free)
        return max(int(budget * 0.9), 0)

    def initialize_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        assert self.model_runner is not None
        self.model_runner.initialize_kv_cache(num_blocks, max_model_len)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.model_runner is not None
        return self.model_runner.execute_model(scheduler_output)
