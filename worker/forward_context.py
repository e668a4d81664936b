"""Per-step data that the attention layers read: built once per step by the model runner.

Kept out of the model's call signature so that the model's forward is plain
`forward(input_ids, positions)` and stays compilable.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass
class ForwardContext:
    attn_metadata: Any  # the attention backend's metadata for this step


_CONTEXT: ForwardContext | None = None


@contextmanager
def set_forward_context(attn_metadata: Any) -> Iterator[None]:
    global _CONTEXT
    previous, _CONTEXT = _CONTEXT, ForwardContext(attn_metadata)
    try:
        yield
    finally:
        _CONTEXT = previous


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("attention ran outside set_forward_context()")
    return _CONTEXT
