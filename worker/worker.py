"""The Worker: one tensor-parallel rank. Sets up its device (and its place in the
torch.distributed group), loads its shard of the model, reports how much memory the KV cache
may take, allocates it, and runs steps.

The methods in its RPC table (`rpc_methods`) are what `Executor.collective_rpc` reaches; in
a worker process (worker/worker_proc.py) their arguments and results are decoded by their
annotations. The rest (setting up the device and the model) the worker does itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from concurrent.futures import Future

import psutil
import torch

from tokenmill.protocol import envs
from tokenmill.protocol.config import EngineConfig
from tokenmill.protocol.scheduler_output import KVCacheSpec, ModelRunnerOutput, SchedulerOutput
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.parallel_state import init_distributed, init_tensor_parallel

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
        }
    )

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
        self.device = torch.device("cpu")
        self.model_runner: ModelRunner | None = None

    def init_device(self) -> None:
        if self.config.device_config.device == "cuda":
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
        else:
            if envs.TOKENMILL_CPU_MALLOC_TUNING:
                keep_freed_memory()
            # Ranks on one host split its cores (torch's default count is all of them).
            torch.set_num_threads(max(1, torch.get_num_threads() // self.local_world_size))
        world_size = self.config.parallel_config.tensor_parallel_size
        if world_size > 1:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            init_distributed(self.rank, world_size, self.distributed_init_method, backend)
        init_tensor_parallel(self.rank, world_size)
        torch.manual_seed(self.config.model_config.seed)
        self.model_runner = ModelRunner(self.config, self.device)

    def load_model(self) -> None:
        assert self.model_runner is not None
        self.model_runner.on_device(self.model_runner.load_model)

    def get_kv_cache_specs(self) -> list[KVCacheSpec]:
        assert self.model_runner is not None
        return self.model_runner.get_kv_cache_specs()

    def determine_available_memory(self) -> int:
        """Bytes this rank can give to its KV cache.

        CPU: the host's budget, `kv_cache_memory_bytes` or else TOKENMILL_CPU_KVCACHE_SPACE
        GiB (default 4, as vLLM's CPU backend) but at most TOKENMILL_CPU_KV_FRACTION (default
        0.25) of the RAM psutil reports available, split evenly among the ranks on this host.
        CUDA (per GPU, as in vLLM): `kv_cache_memory_bytes`, else profile the
        largest step and take `total * gpu_memory_utilization` minus the peak torch allocation
        (weights + activations) and minus memory held outside torch (the CUDA context, other
        processes).
        """
        cache = self.config.cache_config
        if self.device.type == "cpu":
            budget = cache.kv_cache_memory_bytes
            if budget is None:
                budget = int(
                    min(
                        envs.TOKENMILL_CPU_KVCACHE_SPACE * (1 << 30),
                        psutil.virtual_memory().available * envs.TOKENMILL_CPU_KV_FRACTION,
                    )
                )
            return budget // self.local_world_size
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes
        assert self.model_runner is not None
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.model_runner.on_device(self.model_runner.profile_run)
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

    def close(self) -> None:
        """Lets the runner's device thread end; never waits for it."""
        if self.model_runner is not None:
            self.model_runner.close()

    def describe_shards(self) -> dict[str, list[int]]:
        """The shape of every parameter this rank holds, and of one layer's KV cache under
        "kv_cache" (for checks that each rank holds only its share)."""
        assert self.model_runner is not None and self.model_runner.model is not None
        shapes = {name: list(p.shape) for name, p in self.model_runner.model.named_parameters()}
        if self.model_runner.kv_caches:
            shapes["kv_cache"] = list(self.model_runner.kv_caches[0].shape)
        return shapes


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
