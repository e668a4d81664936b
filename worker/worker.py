"""The Worker: one tensor-parallel rank. Sets up its device, loads its shard of the model,
reports how much memory the KV cache may take, allocates it, and runs steps.

Every public method here is reachable through `Executor.collective_rpc`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

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
        elif envs.TOKENMILL_CPU_MALLOC_TUNING:
            keep_freed_memory()
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
        RAM psutil reports available. CUDA: `kv_cache_memory_bytes`, else profile the largest
        step and take `total * gpu_memory_utilization` minus the peak torch allocation
        (weights + activations) and minus memory held outside torch (the CUDA context, other
        processes).
        """
        cache = self.config.cache_config
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes
        if self.device.type == "cpu":
            return int(psutil.virtual_memory().available * envs.TOKENMILL_CPU_KV_FRACTION)
        assert self.model_runner is not None
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.model_runner.profile_run()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        outside_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        available = int(total * cache.gpu_memory_utilization) - peak - outside_torch
        logger.info(
            "GPU memory: total %.2f GiB, peak torch use %.2f GiB, outside torch %.2f GiB, "
            "%.2f GiB left for the KV cache",
            total / 2**30,
            peak / 2**30,
            outside_torch / 2**30,
            available / 2**30,
        )
        return max(available, 0)

    def initialize_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        assert self.model_runner is not None
        self.model_runner.initialize_kv_cache(num_blocks, max_model_len)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.model_runner is not None
        return self.model_runner.execute_model(scheduler_output)


# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def keep_freed_memory() -> bool:
    """Makes glibc malloc keep freed memory for reuse instead of handing it back to the OS.

    A CPU step allocates its activations afresh (up to tens of MB per tensor in a prefill).
    By default glibc serves large blocks with mmap and trims the heap on free, so every step
    page-faults its activations in again: on the W1-cpu benchmark up to ~150k extra page
    faults per run and about 4% of its time. Blocks up to 32 MiB (glibc's ceiling) come from
    the heap and stay there. Returns whether the settings took (glibc on Linux only).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = {_M_MMAP_THRESHOLD: 32 << 20, _M_TRIM_THRESHOLD: 1 << 30, _M_TOP_PAD: 64 << 20}
    return all(mallopt(param, value) == 1 for param, value in settings.items())
