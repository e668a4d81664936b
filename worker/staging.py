"""Host-to-device transfers of a step's small integer arrays (token ids, positions, attention
metadata) without stalling the host.

On CUDA the arrays are packed into one pinned host buffer and copied asynchronously: a copy
from ordinary memory would make the host wait for the GPU to finish everything queued before
it. The buffer is reused from step to step, so before packing the next arrays the host waits
for the previous copy (only the copy, not the forward queued after it). On the CPU tensors are
zero-copy views of the arrays.

Every host-to-device copy of a step goes through this module (HostStaging, or `to_device`
for the odd array), which counts it in `H2D`: bytes and copies, on the CPU too, where the
count is what a CUDA run copies (scripts/bench_step_overlap.py prints it per step).
"""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.worker.platform import platform_of


class TransferCount:
    """Host-to-device traffic so far. (Threads add to it without a lock: a benchmark's
    figure, not an account.)"""

    def __init__(self) -> None:
        self.bytes = 0
        self.copies = 0

    def add(self, nbytes: int, copies: int = 1) -> None:
        self.bytes += nbytes
        self.copies += copies


H2D = TransferCount()


def to_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """One array (or list) on the device, counted in H2D."""
    if isinstance(values, np.ndarray):
        host = torch.from_numpy(np.ascontiguousarray(values))
        host = host if dtype is None else host.to(dtype)
    else:
        host = torch.tensor(values, dtype=dtype)
    H2D.add(host.nbytes)
    return host.to(device)


class HostStaging:
    def __init__(self, device: torch.device, dtype: torch.dtype = torch.int32) -> None:
        self.device = device
        self.pinned = platform_of(device).pinned_staging
        self.dtype = dtype
        self.np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        self.host: torch.Tensor | None = None
        self.copied: torch.cuda.Event | None = None

    def to_device(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """Device tensors with the arrays' shapes and this staging's dtype (one copy)."""
        H2D.add(sum(a.size for a in arrays) * self.np_dtype.itemsize)
        if not self.pinned:
            return [torch.from_numpy(np.ascontiguousarray(a, self.np_dtype)) for a in arrays]
        packed = self._pack(arrays)
        flat = packed.to(self.device, non_blocking=True)
        self._record()
        return self._unpack(flat, arrays)

    def copy_into(self, pairs: list[tuple[torch.Tensor, np.ndarray]]) -> None:
        """Copies each array into its (contiguous, same-sized) device tensor."""
        H2D.add(sum(dst.nbytes for dst, _ in pairs), len(pairs))
        if not self.pinned:
            for dst, array in pairs:
                dst.copy_(torch.from_numpy(np.ascontiguousarray(array)).view(dst.shape))
            return
        packed = self._pack([a for _, a in pairs])
        for (dst, _), src in zip(pairs, self._unpack(packed, [a for _, a in pairs])):
            dst.copy_(src, non_blocking=True)
        self._record()

    def _pack(self, arrays) -> torch.Tensor:
        total = sum(a.size for a in arrays)
        if self.copied is not None:
            self.copied.synchronize()  # the last copy has left the buffer
        if self.host is None or self.host.numel() < total:
            size = max(total, 2 * (0 if self.host is None else self.host.numel()), 4096)
            self.host = torch.empty(size, dtype=self.dtype).pin_memory()
        host = self.host.numpy()
        offset = 0
        for a in arrays:
            host[offset : offset + a.size] = a.reshape(-1)
            offset += a.size
        return self.host[:total]

    @staticmethod
    def _unpack(flat: torch.Tensor, arrays) -> list[torch.Tensor]:
        out, offset = [], 0
        for a in arrays:
            out.append(flat[offset : offset + a.size].view(a.shape))
            offset += a.size
        return out

    def _record(self) -> None:
        if self.copied is None:
            self.copied = torch.cuda.Event()
        self.copied.record()
