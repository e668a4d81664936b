"""The attention backends by name (vLLM's names), imported when chosen: the Triton backend's
module must not load before TRITON_INTERPRET is set, and the CPU backend's needs the kernels."""

from __future__ import annotations

import importlib
import logging
import os

import torch

from tokenmill.protocol.config import EngineConfig
from tokenmill.worker.attention.base import AttentionBackend
from tokenmill.worker.platform import platform_of

logger = logging.getLogger(__name__)

BACKENDS = {
    "TORCH_SDPA": "tokenmill.worker.attention.torch_backend:TorchAttentionBackend",
    "TRITON_ATTN": "tokenmill.worker.attention.triton_backend:TritonAttentionBackend",
    "CPU_ATTN": "tokenmill.worker.attention.cpu_backend:CpuAttentionBackend",
}


def backend_class(name: str) -> type[AttentionBackend]:
    if name not in BACKENDS:
        raise ValueError(f"attention_backend {name!r} is not one of {sorted(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    backend = getattr(importlib.import_module(module), cls)
    assert backend.name == name
    return backend


def make_attention_backend(config: EngineConfig, device: torch.device) -> AttentionBackend:
    """The configured backend (registry.py). Triton on the CPU runs in Triton's interpreter
    (for tests: it is slow), which must be chosen before any kernel module is imported.
    CPU_ATTN gives way to TORCH_SDPA, with a log line, where tokenmill's CPU kernels are not in
    use or do not take the model's dtype."""
    platform = platform_of(device)
    name = config.device_config.attention_backend
    dtype = getattr(torch, config.model_config.dtype)
    if name == "TRITON_ATTN":
        if platform.triton_interpreted and os.environ.get("TRITON_INTERPRET") != "1":
            # The choice is the process's: made here it would also send the CUDA kernels of a
            # process that has a GPU (and its child processes) to the interpreter.
            if torch.cuda.is_available():
                raise ValueError(
                    f"attention_backend='TRITON_ATTN' with device={device.type!r} runs in "
                    "Triton's interpreter, which a process with a GPU must choose before it "
                    "starts (TRITON_INTERPRET=1); or use device='cuda'"
                )
            os.environ["TRITON_INTERPRET"] = "1"
        backend = backend_class(name)
        model, tp = config.model_config, config.parallel_config.tensor_parallel_size
        kv_heads = max(1, model.num_kv_heads // tp)  # replicated when fewer than the ranks
        return backend(model.num_attention_heads // tp, kv_heads, model.head_size, device, dtype)
    if name == "CPU_ATTN":
        if not platform.cpu_kernels():
            logger.info("attention_backend CPU_ATTN needs tokenmill's CPU kernels: TORCH_SDPA runs")
        elif dtype not in backend_class(name).dtypes:
            logger.info("attention_backend CPU_ATTN takes fp32 and bf16, not %s: TORCH_SDPA runs",
                        config.model_config.dtype)  # fmt: skip
        else:
            return backend_class(name)()
    # On a GPU every decode goes into one attention call; on the CPU into cache-sized groups.
    return backend_class("TORCH_SDPA")(platform.decode_group_bytes())
