"""KV cache memory on the CPU: zero-filled by the kernel, committed only as blocks are used."""

from __future__ import annotations

import resource

import torch

from tokenmill.worker.model_runner import zeroed_tensor


def test_cpu_kv_tensor_is_zero_and_committed_on_first_touch() -> None:
    shape = (1024, 2, 16, 4, 64)  # 64 MiB of fp32
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cache = zeroed_tensor(shape, torch.float32, torch.device("cpu"))
    allocated = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    assert cache.shape == shape and cache.dtype == torch.float32 and cache.is_contiguous()
    # Nothing was written at allocation: no page of the 16384 was faulted in.
    assert allocated - before < 64
    # Writing 8 blocks (256 KiB) faults in about that much, not the whole tensor.
    cache[100:108] = 1.0
    touched = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    assert touched - allocated < 1024
    assert cache[100:108].eq(1.0).all()
    # Every page reads as zero, touched or not.
    cache[100:108] = 0.0
    assert int(cache.count_nonzero()) == 0


def test_zeroed_tensor_other_dtypes_and_empty() -> None:
    t = zeroed_tensor((3, 5), torch.bfloat16, torch.device("cpu"))
    assert t.dtype == torch.bfloat16 and t.shape == (3, 5) and not t.any()
    t += 2
    assert t.eq(2).all()
    empty = zeroed_tensor((0, 4), torch.float16, torch.device("cpu"))
    assert empty.shape == (0, 4)
