"""Layers with several implementations, as vLLM's CustomOp: `forward_native` (pure torch: the
reference, and the CPU path without tokenmill's kernels), `forward_triton` (kernels/, on CUDA)
and `forward_cpu` (kernels/cpu/, tokenmill's own CPU kernels; the native one where a layer has
none). Which one a layer uses is fixed when it is built, inside `layer_kernels(...)`, so the
choice costs nothing per call."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

KINDS = ("native", "triton", "cpu")
_KIND = "native"


@contextmanager
def layer_kernels(kind: str) -> Iterator[None]:
    """Layers built inside this block run `forward_<kind>`."""
    global _KIND
    if kind not in KINDS:
        raise ValueError(f"layer kernels must be one of {KINDS}, got {kind!r}")
    previous, _KIND = _KIND, kind
    try:
        yield
    finally:
        _KIND = previous


class CustomOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.kind = _KIND
        self.use_triton = _KIND == "triton"

    def forward(self, *args, **kwargs):
        if self.kind == "cpu":
            return self.forward_cpu(*args, **kwargs)
        if self.use_triton:
            return self.forward_triton(*args, **kwargs)
        return self.forward_native(*args, **kwargs)

    def forward_native(self, *args, **kwargs):
        raise NotImplementedError

    def forward_triton(self, *args, **kwargs):
        raise NotImplementedError

    def forward_cpu(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)
