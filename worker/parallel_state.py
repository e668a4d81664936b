"""This worker's place in the tensor-parallel group, and the collectives the layers use.

Set once by the Worker (`init_distributed`, then `init_tensor_parallel`); read by the parallel
layers while they are built and run. With one rank every collective is the identity and
torch.distributed is never touched.
"""

from __future__ import annotations

import atexit
from datetime import timedelta

import torch
import torch.distributed as dist

# How long a rank waits for the others, to join the group or inside one collective.
DIST_TIMEOUT_S = 300

_TP_RANK = 0
_TP_SIZE = 1
_OWN_GROUP = False  # whether init_distributed made the torch.distributed group


def init_distributed(rank: int, world_size: int, init_method: str, backend: str) -> None:
    """Joins the torch.distributed group (unless the caller, under torchrun say, already
    did); every rank waits here for the others, up to DIST_TIMEOUT_S."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise RuntimeError(
                f"torch.distributed is initialized with world size {dist.get_world_size()}, "
                f"but tensor_parallel_size={world_size}"
            )
        return
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=DIST_TIMEOUT_S),
    )
    global _OWN_GROUP
    _OWN_GROUP = True
    # A group still alive at interpreter exit aborts the process (its threads are joinable).
    atexit.register(destroy_distributed)


def destroy_distributed() -> None:
    """Leaves the group this module joined (one the caller made is the caller's to end)."""
    global _OWN_GROUP
    if _OWN_GROUP and dist.is_initialized():
        dist.destroy_process_group()
    _OWN_GROUP = False


def init_tensor_parallel(rank: int, world_size: int) -> None:
    global _TP_RANK, _TP_SIZE
    if world_size > 1 and not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialized before tensor parallelism")
    _TP_RANK, _TP_SIZE = rank, world_size


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP_SIZE > 1:
        dist.all_reduce(x)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)
