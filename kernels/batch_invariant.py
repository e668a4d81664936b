"""The batch-invariant mode (`batch_invariant=True`, `TOKENMILL_BATCH_INVARIANT=1`): one
process-wide switch that the kernels read, set by the model runner from the engine's config
before it builds anything. On, every kernel computes a row of its output in an order fixed
by that row alone (its context length, its width), never by how many rows or requests the
step holds: matmuls on one microkernel and one K blocking for every row count, attention
split along the context at a fixed size (and every query token, prefill or decode, through
the same decode kernel), reductions per row. A request's logits are then the same bits alone
or in any batch, chunked or not, after a preemption or a prefix hit, and as a verified
proposal. What it costs and what stays variant (TP sizes): README, "Batch invariance"."""

from __future__ import annotations

_ON = False


def set_batch_invariant(on: bool) -> None:
    """Turns the mode on or off for this process (the C++ kernels' switch too, where they
    are loaded)."""
    global _ON
    _ON = bool(on)
    from tokenmill.kernels import cpu

    if cpu.loaded():
        import torch

        torch.ops.tokenmill.set_batch_invariant(_ON)


def batch_invariant() -> bool:
    return _ON
