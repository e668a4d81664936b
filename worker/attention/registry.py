"""The attention backends by name (vLLM's names), imported when chosen: the Triton backend's
module must not load before TRITON_INTERPRET is set, and the CPU backend's needs the kernels."""

from __future__ import annotations

import importlib

from tokenmill.worker.attention.base import AttentionBackend

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
