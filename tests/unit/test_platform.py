"""The platform object: what differs between the CPU and CUDA, asked in one place."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tokenmill.protocol.config import CacheConfig, EngineArgs
from tokenmill.protocol.device_defaults import device_defaults
from tokenmill.worker.platform import CpuPlatform, CudaPlatform, platform_of


def test_each_device_type_has_its_platform_and_others_are_refused_by_name() -> None:
    assert isinstance(platform_of(torch.device("cpu")), CpuPlatform)
    assert isinstance(platform_of("cuda"), CudaPlatform)
    with pytest.raises(
        ValueError, match=r"device 'xpu' is not supported \(supported: \['cpu', 'cuda'\]\)"
    ):
        platform_of("xpu")


def test_engine_defaults_and_platforms_read_one_torch_free_table(tiny_model) -> None:
    """protocol/device_defaults.py decides per device kind: the engine config's defaults and
    the platform objects read it, and protocol/ loads without torch (the frontend's start)."""
    model = str(tiny_model("llama-gqa"))
    for kind in ("cpu", "cuda"):
        defaults = device_defaults(kind)
        assert platform_of(kind).defaults is defaults
        config = EngineArgs(model=model, device=kind).create_engine_config()
        assert config.scheduler_config.async_scheduling == defaults.overlaps_steps
        assert config.device_config.attention_backend == defaults.default_attention_backend()
    code = "import sys; sys.modules['torch'] = None; import tokenmill.protocol.config"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cpu_choices() -> None:
    cpu = platform_of("cpu")
    # gloo all-reduces; steps run in turn (a forward needs every core); no graphs, no pinned
    # staging; decode attention in cache-sized groups.
    assert (cpu.dist_backend, cpu.overlaps_steps, cpu.has_graphs, cpu.pinned_staging) == (
        "gloo", False, False, False,
    )  # fmt: skip
    assert cpu.decode_group_bytes() > 0

    # The host's KV budget is split among its ranks; nothing is profiled for it.
    def profile() -> None:
        raise AssertionError("the CPU budget needs no profile")

    cache = CacheConfig(kv_cache_memory_bytes=3 << 30)
    assert cpu.kv_cache_budget(cache, torch.device("cpu"), 3, profile) == 1 << 30
    t = cpu.zeroed((4, 8), torch.float16, torch.device("cpu"))
    assert t.dtype == torch.float16 and t.shape == (4, 8) and not t.any()


def test_cuda_choices_without_a_gpu() -> None:
    cuda = platform_of("cuda")
    assert (cuda.dist_backend, cuda.overlaps_steps, cuda.has_graphs, cuda.pinned_staging) == (
        "nccl", True, True, True,
    )  # fmt: skip
    assert cuda.decode_group_bytes() is None  # every decode in one attention call
    # A fixed budget is taken as given, per GPU, without profiling.
    cache = CacheConfig(kv_cache_memory_bytes=5 << 30)
    assert cuda.kv_cache_budget(cache, torch.device("cuda", 0), 2, lambda: None) == 5 << 30


class FakeDevice:
    """torch.cuda's memory counters over a fake 100 GiB device: allocations of this process,
    its allocator's cache, and memory other processes hold."""

    GiB = 1 << 30

    def __init__(self, others: int) -> None:
        self.total, self.others = 100 * self.GiB, others
        self.allocated = self.peak = self.cached = self.context = 0

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def install(self, monkeypatch) -> None:
        reserved = lambda device=None: self.allocated + self.cached  # noqa: E731
        used = lambda: reserved() + self.context + self.others  # noqa: E731
        for name, fn in {
            "set_device": lambda device: None,
            "synchronize": lambda device=None: None,
            "empty_cache": lambda: setattr(self, "cached", 0),
            "reset_peak_memory_stats": lambda device=None: setattr(self, "peak", self.allocated),
            "mem_get_info": lambda device=None: (self.total - used(), self.total),
            "memory_allocated": lambda device=None: self.allocated,
            "memory_reserved": reserved,
            "max_memory_allocated": lambda device=None: self.peak,
        }.items():
            monkeypatch.setattr(torch.cuda, name, fn)


def test_cuda_budget_is_this_engines_share_whatever_else_holds_the_device(monkeypatch) -> None:
    """As vLLM's gpu_memory_utilization: a share of the device for this engine, less what its
    own allocations peaked at and what grew outside torch since it started; memory another
    engine held before does not count, but the share must have been free."""
    GiB = FakeDevice.GiB
    device = torch.device("cuda", 0)
    gpu = FakeDevice(others=30 * GiB)  # another engine on the device
    gpu.install(monkeypatch)
    cuda = CudaPlatform()
    gpu.context = GiB // 2  # a CUDA context that existed before: not this engine's growth
    cuda.init_process(device, 1)
    gpu.alloc(3 * GiB)  # weights

    def profile() -> None:  # activations of the largest step, and cuBLAS's workspace
        gpu.alloc(2 * GiB)
        gpu.allocated -= 2 * GiB
        gpu.context += GiB // 4

    share = CacheConfig(gpu_memory_utilization=0.5)
    # 50 GiB, less 5 GiB peak of this engine's, less the 0.25 GiB grown outside torch.
    assert cuda.kv_cache_budget(share, device, 1, profile) == 50 * GiB - 5 * GiB - GiB // 4

    # Asked without init_process (weights already loaded): every allocation of the process
    # counts, as above.
    late = CudaPlatform()
    assert late.kv_cache_budget(share, device, 1, profile) == 50 * GiB - 5 * GiB - GiB // 4

    crowded = CudaPlatform()
    gpu.others = 60 * GiB
    crowded.init_process(device, 1)
    with pytest.raises(ValueError, match=r"less than gpu_memory_utilization=0.5 asks for"):
        crowded.kv_cache_budget(share, device, 1, profile)


def test_the_kv_cache_commit_thread_runs_only_on_idle_time(monkeypatch) -> None:
    """The thread that commits the KV cache's pages yields its core to every other thread
    (SCHED_IDLE where Linux has it, else the lowest priority), commits a huge page per call
    (one call for the whole cache held the memory map while it waited), and commits all."""
    import contextlib
    import os
    import threading

    from tokenmill.worker import platform as platform_module

    seen = {"calls": 0}
    real_yield, real_madvise = platform_module._yield_to_others, platform_module._madvise()
    if real_madvise is None:
        pytest.skip("no madvise here")

    def watched_yield() -> None:
        real_yield()
        tid = threading.get_native_id()
        seen["policy"] = os.sched_getscheduler(tid)
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, tid)
        # Seen; the commit itself runs as any thread (a busy machine would starve it).
        with contextlib.suppress(OSError):
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))

    def counted(addr: int, nbytes: int, advice: int) -> int:
        seen["calls"] += 1
        assert nbytes <= platform_module._COMMIT_CHUNK
        return real_madvise(addr, nbytes, advice)

    monkeypatch.setattr(platform_module, "_yield_to_others", watched_yield)
    monkeypatch.setattr(platform_module, "_madvise", lambda: counted)
    cache = platform_module._cpu_zeroed((8, 1 << 20), torch.float32)  # 32 MiB: 16 calls
    thread = platform_module.commit_pages([cache])
    if thread is None:
        pytest.skip("no MADV_POPULATE_WRITE here: the pages are committed by writes instead")
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert seen["policy"] == os.SCHED_IDLE or seen["nice"] == 19
    assert seen["calls"] == 1 + 16  # the probe, then the cache in 2 MiB calls
    assert torch.count_nonzero(cache) == 0
