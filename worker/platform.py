"""What differs between the CPU and CUDA, in one place: a `Platform` per device type.

The worker and its model runner ask their platform instead of testing `device.type`:
- CPU: glibc malloc keeps freed memory (steps allocate their activations afresh), oneDNN
  keeps more compiled matmul kernels (see ONEDNN_KERNEL_CACHE), the ranks of a host split
  its cores, the KV cache is lazily zeroed memory (committed in the background only where
  Linux gives it no huge pages), matmul weights are packed for tokenmill's CPU kernels
  (kernels/cpu/; oneDNN's layout where they are not in use), the torch path's decode
  attention runs in groups sized to the L2 caches, Triton kernels run in the interpreter
  (tests), the KV budget is a share of the host's RAM, steps run in turn (the forward needs
  every core), gloo all-reduces.
- CUDA: one device per local rank, steps overlap (the forward leaves the host free), decode
  CUDA graphs, pinned staging of a step's inputs (worker/staging.py), the KV budget is what a
  profiled step leaves of the GPU, nccl all-reduces.
The choices that are plain data (collectives, step overlap, graphs, staging) live in
protocol/device_defaults.py, which the engine config's defaults read too. Kernel-level choices
(Triton tile sizes, the rejection kernel, the sampler's chunking) stay with their kernels.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import math
import mmap
import os
import sys
import threading
from collections.abc import Callable

import psutil
import torch

from tokenmill.protocol import envs
from tokenmill.protocol.config import CacheConfig
from tokenmill.protocol.device_defaults import DeviceDefaults, device_defaults

logger = logging.getLogger(__name__)


# Compiled matmul kernels oneDNN keeps (its primitive cache; its default is 1024). oneDNN
# compiles a kernel per matmul shape (1.5-4 ms each on a 2-core AMX CPU, about 1 MB of memory
# each) and evicts the least recently used when the cache is full. A dense layer meets one
# shape per token count a step has, and the experts round theirs (worker/layers/fused_moe.py:
# gemm_rows), so a run meets a few hundred shapes; this leaves room for more before the cache
# would start to recompile on every step (as it did before the experts' row counts were
# rounded: 30 ms of a 45 ms MoE decode step). It grows only as far as it is used.
ONEDNN_KERNEL_CACHE = 2048


class Platform:
    # The device kind's data-only choices; the properties below read them.
    defaults: DeviceDefaults

    @property
    def device_type(self) -> str:
        return self.defaults.device_type

    @property
    def dist_backend(self) -> str:
        return self.defaults.dist_backend

    @property
    def overlaps_steps(self) -> bool:
        """Whether steps overlap by default under async scheduling."""
        return self.defaults.overlaps_steps

    @property
    def has_graphs(self) -> bool:
        return self.defaults.has_graphs

    @property
    def triton_interpreted(self) -> bool:
        return self.defaults.triton_interpreted

    @property
    def pinned_staging(self) -> bool:
        return self.defaults.pinned_staging

    def device(self, local_rank: int) -> torch.device:
        raise NotImplementedError

    def init_process(self, device: torch.device, local_world_size: int) -> None:
        """The worker process's set-up, before anything is allocated."""

    def thread_setup(self, device: torch.device) -> Callable[[], None] | None:
        """What a thread that runs torch work for this device runs first."""
        return None

    def step_threads(self) -> contextlib.AbstractContextManager[None]:
        """Entered around each step on the thread that runs it."""
        return contextlib.nullcontext()

    def zeroed(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    def commit(self, tensors: list[torch.Tensor]) -> None:
        """Makes the KV cache's memory resident (where it is not already)."""

    def prepare_model(self, model: torch.nn.Module) -> None:
        """Weight layouts for this device, once the weights are loaded."""

    def cpu_kernels(self) -> bool:
        """Whether layers run tokenmill's own CPU kernels (kernels/cpu/)."""
        return False

    def decode_group_bytes(self) -> int | None:
        """K+V bytes one decode group of the torch attention backend may copy (None: all
        decodes in one attention call)."""
        return None

    def synchronize(self, device: torch.device) -> None:
        """Waits for the device's queued work (step timing)."""

    def resident_bytes(self, device: torch.device) -> int:
        """The memory this process holds where the model lives: on the CPU its resident set
        (the model's load is measured as its growth)."""
        import psutil

        return psutil.Process().memory_info().rss

    def after_load(self) -> None:
        """Once the model is loaded: on the CPU, the load's freed temporaries go back to the
        OS."""

    def kv_cache_budget(
        self, cache: CacheConfig, device: torch.device, local_world_size: int,
        profile: Callable[[], None], engines_on_host: int = 1,
    ) -> int:  # fmt: skip
        """Bytes this rank can give to its KV cache; profile() runs the largest step."""
        raise NotImplementedError


class CpuPlatform(Platform):
    defaults = device_defaults("cpu")

    def device(self, local_rank: int) -> torch.device:
        return torch.device("cpu")

    def init_process(self, device: torch.device, local_world_size: int) -> None:
        if envs.TOKENMILL_CPU_MALLOC_TUNING:
            keep_freed_memory()
        # Read by oneDNN when it first compiles a kernel (later in this process); a value the
        # user set wins.
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_KERNEL_CACHE))
        # Ranks on one host split its cores (torch's default count is all of them).
        torch.set_num_threads(max(1, torch.get_num_threads() // local_world_size))
        self._governor = None
        if envs.TOKENMILL_CPU_THREAD_GOVERNOR:
            from tokenmill.worker.cpu_threads import ThreadGovernor

            self._governor = ThreadGovernor(torch.get_num_threads())

    def step_threads(self) -> contextlib.AbstractContextManager[None]:
        governor = getattr(self, "_governor", None)
        return contextlib.nullcontext() if governor is None else governor.step()

    def zeroed(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return _cpu_zeroed(shape, dtype)

    def commit(self, tensors: list[torch.Tensor]) -> None:
        # With transparent huge pages a first touch faults in 2 MiB: a step rarely meets one,
        # and the cache is better left lazy than committed beside the steps (a thread
        # committing 4 GiB slowed W1-cpu's first rounds by 5-8%, as it took the memory
        # bandwidth the steps stream at). Without them the pages are committed.
        if not transparent_huge_pages():
            commit_pages(tensors)

    def cpu_kernels(self) -> bool:
        return cpu_kernels_in_use()

    def after_load(self) -> None:
        release_freed_memory()

    def prepare_model(self, model: torch.nn.Module) -> None:
        from tokenmill.kernels.batch_invariant import batch_invariant
        from tokenmill.worker.layers.embedding import ParallelLMHead
        from tokenmill.worker.layers.linear import (
            LinearBase,
            keep_for_triton_matmul,
            pack_cpu_weights,
        )

        # (Quantized layers have their own layout: worker/layers/quantization/.)
        matmuls = [
            m
            for m in model.modules()
            if isinstance(m, (LinearBase, ParallelLMHead)) and getattr(m, "qweight", None) is None
        ]
        # A model built with Triton's layers (the TRITON_ATTN backend: ModelRunner.layer_kernels)
        # runs kernels/matmul.py in the batch-invariant mode, on plain weights.
        if batch_invariant() and any(getattr(m, "use_triton", False) for m in model.modules()):
            keep_for_triton_matmul(matmuls)
            logger.info("batch-invariant mode: %d matmuls on Triton's kernel", len(matmuls))
            return
        own = cpu_kernels_in_use()
        packed, widened = pack_cpu_weights(matmuls, own)
        if packed < len(matmuls):
            kind = "tokenmill's CPU kernels" if own else "oneDNN"
            logger.info("%d of %d matmul weights packed for %s", packed, len(matmuls), kind)
        if batch_invariant() and own:
            variant = variant_layers(model)
            if variant:
                logger.warning(
                    "batch_invariant=True: %d layers run kernels that choose their blocking by "
                    "the row count, so outputs through them still depend on the batch (%s%s)",
                    len(variant), ", ".join(variant[:3]), ", ..." if len(variant) > 3 else "",
                )  # fmt: skip
        if widened:
            logger.info(
                "this CPU has no bf16 GEMM: %d bf16 matmul weights widened to fp32 (bf16 "
                "activations and KV cache, fp32 matmuls)",
                widened,
            )

    def decode_group_bytes(self) -> int | None:
        from tokenmill.worker.attention.torch_backend import cpu_decode_group_bytes

        return cpu_decode_group_bytes()

    def kv_cache_budget(
        self, cache: CacheConfig, device: torch.device, local_world_size: int,
        profile: Callable[[], None], engines_on_host: int = 1,
    ) -> int:  # fmt: skip
        """The engine's budget, `kv_cache_memory_bytes`, split evenly among its TP ranks on
        this host. By default the host's: TOKENMILL_CPU_KVCACHE_SPACE GiB (default 4, as
        vLLM's CPU backend) but at most TOKENMILL_CPU_KV_FRACTION (default 0.25) of the RAM
        psutil reports available, shared by the engines (data-parallel ranks) on this host
        too."""
        budget = cache.kv_cache_memory_bytes
        if budget is None:
            budget = (
                int(
                    min(
                        envs.TOKENMILL_CPU_KVCACHE_SPACE * (1 << 30),
                        psutil.virtual_memory().available * envs.TOKENMILL_CPU_KV_FRACTION,
                    )
                )
                // engines_on_host
            )
        return budget // local_world_size


class CudaPlatform(Platform):
    defaults = device_defaults("cuda")

    def __init__(self) -> None:
        # Per device, what it held when this process's engine began (init_process).
        self._baseline: dict[torch.device, tuple[int, int, int]] = {}

    def device(self, local_rank: int) -> torch.device:
        return torch.device("cuda", local_rank)

    def init_process(self, device: torch.device, local_world_size: int) -> None:
        torch.cuda.set_device(device)
        # What the device holds before this engine loads anything (other processes, other
        # engines in this process): gpu_memory_utilization is this engine's share, as in
        # vLLM, so the budget counts only what grows from here.
        self._baseline[device] = self._snapshot(device)

    @staticmethod
    def _snapshot(device: torch.device) -> tuple[int, int, int]:
        """(free bytes, this process's torch allocations, bytes held outside its allocator)."""
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        reserved = torch.cuda.memory_reserved(device)
        return free, torch.cuda.memory_allocated(device), total - free - reserved

    def thread_setup(self, device: torch.device) -> Callable[[], None] | None:
        return lambda: torch.cuda.set_device(device)

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def resident_bytes(self, device: torch.device) -> int:
        return torch.cuda.memory_allocated(device)

    def kv_cache_budget(
        self, cache: CacheConfig, device: torch.device, local_world_size: int,
        profile: Callable[[], None], engines_on_host: int = 1,
    ) -> int:  # fmt: skip
        """Per GPU, as in vLLM: `kv_cache_memory_bytes`, else profile the largest step and
        take `total * gpu_memory_utilization` (this engine's share of the device) minus what
        the engine's torch allocations peaked at (weights + activations) and minus what grew
        outside torch (cuBLAS, NCCL) since the process began; memory other processes or
        engines held then is not counted, but the share must have been free."""
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes
        baseline = self._baseline.get(device)
        if baseline is None:  # init_process never ran here: every torch allocation counts
            free, _, outside = self._snapshot(device)
            baseline = (free + torch.cuda.memory_reserved(device), 0, outside)
        free_at_start, allocated_at_start, outside_at_start = baseline
        total = torch.cuda.mem_get_info(device)[1]
        requested = int(total * cache.gpu_memory_utilization)
        if free_at_start < requested:
            raise ValueError(
                f"Free memory on device {device} ({free_at_start / 2**30:.2f}/"
                f"{total / 2**30:.2f} GiB) at start-up is less than gpu_memory_utilization="
                f"{cache.gpu_memory_utilization} asks for ({requested / 2**30:.2f} GiB): lower "
                "gpu_memory_utilization or free the memory other processes hold."
            )
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        profile()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - allocated_at_start
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info(device)[0]
        outside_torch = max(
            0, (total - free) - torch.cuda.memory_reserved(device) - outside_at_start
        )
        available = requested - peak - outside_torch
        logger.info(
            "GPU memory: total %.2f GiB, this engine's share %.2f GiB, peak torch use %.2f GiB, "
            "grown outside torch %.2f GiB, %.2f GiB left for the KV cache",
            total / 2**30,
            requested / 2**30,
            peak / 2**30,
            outside_torch / 2**30,
            available / 2**30,
        )
        return max(available, 0)


_PLATFORMS = {"cpu": CpuPlatform(), "cuda": CudaPlatform()}


def cpu_kernels_in_use() -> bool:
    """Whether this process runs tokenmill's own CPU kernels (kernels/cpu/): not with
    TOKENMILL_CPU_KERNELS=0, nor where they cannot be built (one log line then)."""
    if not envs.TOKENMILL_CPU_KERNELS:
        return False
    from tokenmill.kernels import cpu

    if not cpu.load(envs.TOKENMILL_CACHE):
        return False
    cap = envs.TOKENMILL_CPU_ISA
    if cap:
        if cap not in cpu.ISAS:
            raise ValueError(f"TOKENMILL_CPU_ISA must be one of {sorted(cpu.ISAS)}, got {cap!r}")
        cpu.limit_isa(cpu.ISAS[cap])
    return True


def variant_layers(model: torch.nn.Module) -> list[str]:
    """The CPU layers that the batch-invariant mode cannot cover, by name: matmul weights
    tokenmill's layout does not take (N not a multiple of 16, K odd in bf16: oneDNN runs
    them) and unquantized MoE experts (torch's batched matmuls)."""
    from tokenmill.worker.layers.embedding import ParallelLMHead
    from tokenmill.worker.layers.fused_moe import FusedMoE
    from tokenmill.worker.layers.linear import LinearBase

    found = []
    for name, module in model.named_modules():
        if isinstance(module, (LinearBase, ParallelLMHead)):
            weight = module.weight
            own = weight.dim() > 2 and not weight.is_mkldnn
            if getattr(module, "qweight", None) is None and not own:
                found.append(name)
        elif isinstance(module, FusedMoE) and module.gguf_experts is None:
            found.append(f"{name} (experts)")
    return found


def platform_of(device: torch.device | str) -> Platform:
    """The platform of a device (or a device type: "cpu", "cuda")."""
    kind = device if isinstance(device, str) else device.type
    if kind not in _PLATFORMS:
        raise ValueError(f"device {kind!r} is not supported (supported: {sorted(_PLATFORMS)})")
    return _PLATFORMS[kind]


def zeroed_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, as the device's platform makes it (Platform.zeroed)."""
    return platform_of(device).zeroed(shape, dtype, device)


def _cpu_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Memory the kernel zero-fills as it is first touched.

    A private anonymous mapping needs no memset pass, and advised for transparent huge
    pages it is faulted in 2 MiB at a time (1.4-1.7x faster than torch.zeros for a 5.5 GiB
    cache here). `commit_pages` then faults it in, so that steps meet no page faults."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(buffer, dtype=torch.uint8)  # keeps the mapping alive
    return raw.view(dtype).view(shape)


def transparent_huge_pages() -> bool:
    """Whether Linux backs the mappings _cpu_zeroed advises with 2 MiB pages."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and ("[always]" in mode or "[madvise]" in mode)


_MADV_POPULATE_WRITE = 23  # Linux 5.14: fault pages in writable without writing to them


def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_COMMIT_CHUNK = 2 << 20  # bytes committed per call: one transparent huge page


def commit_pages(tensors: list[torch.Tensor]) -> threading.Thread | None:
    """Commits the pages of these CPU tensors (from zeroed_tensor): left lazy, a decode step's
    K/V writes reach a fresh page every few tokens of every request.

    Where the kernel has MADV_POPULATE_WRITE the pages are faulted in on a daemon thread
    (ctypes releases the GIL), which the engine does not wait for: populating leaves what a
    step has written meanwhile untouched, and a 4 GiB cache takes 0.4-3 s (the first touch of
    a VM's memory is the slow part), which start-up no longer pays. The thread runs only on
    time no other thread wants (`_yield_to_others`), 2 MiB per call: a thread zeroing pages
    beside a step's own on the same cores made libgomp's threads wait for each other (the
    first request took 3-7 s instead of 0.5), and one call for the whole cache held the
    process's memory map while the thread waited for a core, stalling every allocation (a
    first round of W1-cpu's prompts took 7 s instead of 2). Pages a step reaches first it
    faults in itself. Elsewhere one write per page commits them now. Returns the thread, if
    one was started."""
    spans = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors if t.numel()]
    if not spans:
        return None
    madvise = _madvise()
    page = mmap.PAGESIZE
    if madvise is not None and madvise(spans[0][0], page, _MADV_POPULATE_WRITE) == 0:

        def populate() -> None:
            _yield_to_others()
            for addr, nbytes in spans:
                for at in range(0, nbytes, _COMMIT_CHUNK):
                    madvise(addr + at, min(_COMMIT_CHUNK, nbytes - at), _MADV_POPULATE_WRITE)

        thread = threading.Thread(target=populate, name="kv-commit", daemon=True)
        thread.start()
        return thread
    for t in tensors:
        t.view(-1).view(torch.uint8)[::page].zero_()
    return None


def _yield_to_others() -> None:
    """Makes the calling thread run only on time no other thread wants (Linux's SCHED_IDLE,
    else the lowest priority)."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, tid, 19)


# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def release_freed_memory() -> bool:
    """Hands the heap's free pages back to the OS (glibc's malloc_trim): once after loading a
    model, whose temporaries (a checkpoint's copies, a quantized format's re-layouts) would
    otherwise stay resident under keep_freed_memory's settings."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


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
