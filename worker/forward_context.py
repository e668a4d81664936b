"""Per-step data that the attention and LoRA layers read: built once per step by the model
runner.

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
    # The step's rows grouped by LoRA slot (kernels/punica.py's LoRAMapping); None: no row
    # runs an adapter.
    lora_mapping: Any = None


_CONTEXT: ForwardContext | None = None


@contextmanager
def set_forward_context(attn_metadata: Any, lora_mapping: Any = None) -> Iterator[None]:
    global _CONTEXT
    previous, _CONTEXT = _CONTEXT, ForwardContext(attn_metadata, lora_mapping)
    try:
        yield
    finally:
        _CONTEXT = previous


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("attention ran outside set_forward_context()")
    return _CONTEXT


def current_lora_mapping() -> Any:
    """The step's LoRA mapping, None outside a step or where no row runs an adapter."""
    return None if _CONTEXT is None else _CONTEXT.lora_mapping
