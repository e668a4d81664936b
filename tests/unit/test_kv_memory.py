"""KV cache memory on the CPU: zero-filled, and committed (on a thread of its own where the
kernel allows) so that writing blocks during steps faults in no pages; what a step writes
while the pages are committed stays written."""

from __future__ import annotations

import resource

import pytest
import torch

from tokenmill.worker import platform
from tokenmill.worker.platform import commit_pages, zeroed_tensor

_SHAPE = (4096, 2, 16, 4, 64)  # 256 MiB of fp32: 65536 pages of 4 KiB, 128 huge pages


@pytest.fixture(autouse=True)
def _commit_at_normal_priority(monkeypatch) -> None:
    """The commit thread runs on idle time only (tested in test_platform.py); here it runs as
    any thread, so that a machine busy with other work does not starve it past the joins."""
    monkeypatch.setattr(platform, "_yield_to_others", lambda: None)


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_cpu_kv_tensor_is_zero_and_committed() -> None:
    cache = zeroed_tensor(_SHAPE, torch.float32, torch.device("cpu"))
    thread = commit_pages([cache])
    if thread is not None:
        thread.join(timeout=60)
        assert not thread.is_alive()
    committed = _faults()
    # Writing every block afterwards faults in nothing: the pages were committed already
    # (a lazily allocated tensor faults here once per page, or at least once per huge page).
    cache[1:].fill_(1.0)
    assert _faults() - committed < 64, _faults() - committed
    assert cache.shape == _SHAPE and cache.dtype == torch.float32 and cache.is_contiguous()
    assert not cache[0].any() and cache[1:].eq(1.0).all()


def test_writes_made_while_pages_are_committed_survive() -> None:
    caches = [zeroed_tensor(_SHAPE, torch.bfloat16, torch.device("cpu")) for _ in range(4)]
    thread = commit_pages(caches)
    # A step writing blocks while the commit runs (every 7th block of every layer).
    for i, cache in enumerate(caches):
        cache[::7].fill_(i + 1)
    if thread is not None:
        thread.join(timeout=60)
    for i, cache in enumerate(caches):
        assert cache[::7].eq(i + 1).all()
        rest = torch.ones(_SHAPE[0], dtype=torch.bool)
        rest[::7] = False
        assert not cache[rest].any()


def test_zeroed_tensor_other_dtypes_and_empty() -> None:
    t = zeroed_tensor((3, 5), torch.bfloat16, torch.device("cpu"))
    assert t.dtype == torch.bfloat16 and t.shape == (3, 5) and not t.any()
    t += 2
    assert t.eq(2).all()
    empty = zeroed_tensor((0, 4), torch.float16, torch.device("cpu"))
    assert empty.shape == (0, 4)
    assert commit_pages([empty]) is None
