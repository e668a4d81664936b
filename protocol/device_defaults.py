"""What each device kind runs with where the user leaves the choice open: one frozen
`DeviceDefaults` per kind ("cpu", "cuda"), found with `device_defaults()`. Read by
protocol/config.py (async scheduling, attention backend and dtype defaults) and by the platform
objects of worker/platform.py (step overlap, graphs, staging, collectives). Plain data and host
checks that need no torch: the frontend resolves the engine config without importing it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal

from tokenmill.protocol import envs
from tokenmill.protocol.cpu_features import native_bf16


@dataclass(frozen=True)
class DeviceDefaults:
    device_type: str
    dist_backend: str  # tensor parallelism's all-reduces
    # Whether the forward leaves the host's cores free: then async scheduling is on by default
    # and the worker overlaps steps (vLLM's default where it pays: a GPU step is short enough
    # for the core's CPU work to matter). On the CPU the forward needs every core and dwarfs
    # the core's work, and the overlap costs a thread (measured in scripts/bench_throughput.py
    # --async-scheduling both).
    overlaps_steps: bool
    # Attention backends in order of preference: the default is the first this host can run
    # (TRITON_ATTN needs triton; CPU_ATTN needs TOKENMILL_CPU_KERNELS on; TORCH_SDPA always runs).
    attention_backends: tuple[str, ...]
    # What dtype="auto" follows: the checkpoint's dtype, or what the host CPU multiplies
    # natively (protocol/cpu_features.py).
    auto_dtype_source: Literal["checkpoint", "cpu"]
    has_graphs: bool  # decode steps can be replayed from CUDA graphs
    triton_interpreted: bool  # Triton kernels run in the interpreter (tests only: slow)
    # A step's inputs go through a pinned host buffer, copied asynchronously
    # (worker/staging.py); otherwise tensors are views of the host arrays.
    pinned_staging: bool

    def default_attention_backend(self) -> str:
        """The first of `attention_backends` this host can run."""
        return next(b for b in self.attention_backends if _runs_here(b))

    def auto_dtype(self, checkpoint_dtype: str) -> str:
        """What dtype="auto" resolves to for a checkpoint stored in `checkpoint_dtype`."""
        if self.auto_dtype_source == "cpu":
            # bf16 where the CPU multiplies bf16 natively (as vLLM's CPU backend chooses);
            # elsewhere bf16 matmuls are emulated and 3-5x slower than fp32, and fp16 is
            # slow on every CPU without AVX512-FP16.
            return "bfloat16" if native_bf16() else "float32"
        # An fp32 checkpoint runs in bf16, as in vLLM: fp32 would double weights and KV cache.
        return "bfloat16" if checkpoint_dtype == "float32" else checkpoint_dtype


_DEFAULTS = {
    "cpu": DeviceDefaults(
        device_type="cpu",
        dist_backend="gloo",
        overlaps_steps=False,
        attention_backends=("CPU_ATTN", "TORCH_SDPA"),
        auto_dtype_source="cpu",
        has_graphs=False,
        triton_interpreted=True,
        pinned_staging=False,
    ),
    "cuda": DeviceDefaults(
        device_type="cuda",
        dist_backend="nccl",
        overlaps_steps=True,
        attention_backends=("TRITON_ATTN", "TORCH_SDPA"),
        auto_dtype_source="checkpoint",
        has_graphs=True,
        triton_interpreted=False,
        pinned_staging=True,
    ),
}


def device_defaults(device_type: str) -> DeviceDefaults:
    """The defaults of a device kind ("cpu" or "cuda")."""
    if device_type not in _DEFAULTS:
        raise ValueError(
            f"device {device_type!r} is not supported (supported: {sorted(_DEFAULTS)})"
        )
    return _DEFAULTS[device_type]


def has_triton() -> bool:
    """Whether triton is installed (looked up without importing it)."""
    return importlib.util.find_spec("triton") is not None


def _runs_here(backend: str) -> bool:
    if backend == "TRITON_ATTN":
        return has_triton()
    if backend == "CPU_ATTN":
        # Switched off by the user; where they cannot be built the model runner falls back to
        # TORCH_SDPA itself, with a log line.
        return envs.TOKENMILL_CPU_KERNELS
    return True
