"""The worker's malloc tuning on the CPU: freed activation-sized blocks are reused instead of
being page-faulted in afresh on every allocation."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Run in a child: the tuning is process-wide and the count must start from glibc's defaults.
CHILD = """
import resource, sys, torch
from tokenmill.worker.platform import keep_freed_memory

def faults_for_steps():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(12):
        # Like a few steps' activations: several blocks of varying size live at once, all
        # freed together.
        size, count = [(4 << 20, 4), (6 << 20, 3), (2 << 20, 6)][i % 3]
        blocks = [torch.ones(size) for _ in range(count)]  # written in full
        del blocks
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

if sys.argv[1] == "tuned":
    assert keep_freed_memory()
faults_for_steps()  # the first round faults its blocks in either way
print(faults_for_steps())
"""


def _glibc_with_tunables() -> bool:
    """GLIBC_TUNABLES (used to make the untuned case deterministic) exists from glibc 2.26."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
    except (AttributeError, ValueError, OSError):
        return False
    return name == "glibc" and tuple(map(int, version.split(".")[:2])) >= (2, 26)


@pytest.mark.skipif(not _glibc_with_tunables(), reason="needs glibc >= 2.26 (mallopt, tunables)")
def test_freed_blocks_are_reused_after_tuning():
    def faults(mode: str) -> int:
        # glibc's default mmap threshold adapts to the allocation history, so whether the
        # untuned child re-faults depends on what ran before; pinning it at its initial
        # 128 KiB makes the untuned case deterministic (every block mapped and unmapped).
        env = dict(os.environ, GLIBC_TUNABLES="glibc.malloc.mmap_threshold=131072")
        out = subprocess.run(
            [sys.executable, "-c", CHILD, mode],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
            env=env,
        )
        return int(out.stdout)

    # The 12 steps write about 150k 4 KiB pages in all. Tuned, the blocks are reused: what
    # faults in is the heap's rearrangement between block sizes (a few MiB, more or less by
    # glibc version and kernel), a small fraction of the untuned count.
    untuned, tuned = faults("default"), faults("tuned")
    assert untuned > 100_000
    assert tuned < untuned // 20, (untuned, tuned)
