"""Layers with two implementations, as vLLM's CustomOp: `forward_native` (pure torch: the CPU
path and the reference) and `forward_triton` (kernels/). Which one a layer uses is fixed when
it is built, inside `use_triton_layers(...)`, so the choice costs nothing per call."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

_USE_TRITON = False


@contextmanager
def use_triton_layers(enabled: bool) -> Iterator[None]:
    """Layers built inside this block run their Triton kernels when `enabled`."""
    global _USE_TRITON
    previous, _USE_TRITON = _USE_TRITON, enabled
    try:
        yield
    finally:
        _USE_TRITON = previous


def triton_layers_enabled() -> bool:
    return _USE_TRITON


class CustomOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.use_triton = _USE_TRITON

    def forward(self, *args, **kwargs):
        if self.use_triton:
            return self.forward_triton(*args, **kwargs)
        return self.forward_native(*args, **kwargs)

    def forward_native(self, *args, **kwargs):
        raise NotImplementedError

    def forward_triton(self, *args, **kwargs):
        raise NotImplementedError
