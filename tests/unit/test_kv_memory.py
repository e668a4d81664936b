"""KV cache memory on the CPU: zero-filled and committed when allocated, so that writing blocks
during steps faults in no pages."""

from __future__ import annotations

import resource

import torch

from tokenmill.worker.model_runner import zeroed_tensor


def test_cpu_kv_tensor_is_zero_and_committed_at_allocation() -> None:
    shape = (4096, 2, 16, 4, 64)  # 256 MiB of fp32: 65536 pages of 4 KiB, 128 huge pages
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cache = zeroed_tensor(shape, torch.float32, torch.device("cpu"))
    allocated = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    # Writing every block afterwards faults in nothing: the pages were committed already
    # (a lazily allocated tensor faults here once per page, or at least once per huge
    # page).
    cache[1:].fill_(1.0)
    written = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    assert written - allocated < 64, (allocated - before, written - allocated)
    assert cache.shape == shape and cache.dtype == torch.float32 and cache.is_contiguous()
    assert not cache[0].any() and cache[1:].eq(1.0).all()


def test_zeroed_tensor_other_dtypes_and_empty() -> None:
    t = zeroed_tensor((3, 5), torch.bfloat16, torch.device("cpu"))
    assert t.dtype == torch.bfloat16 and t.shape == (3, 5) and not t.any()
    t += 2
    assert t.eq(2).all()
    empty = zeroed_tensor((0, 4), torch.float16, torch.device("cpu"))
    assert empty.shape == (0, 4)
