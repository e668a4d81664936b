"""Launch counters for the Triton kernels: each wrapper counts its launches, so that a test can
prove that a path really ran its kernels rather than a torch fallback."""

from __future__ import annotations

from collections import Counter

LAUNCHES: Counter[str] = Counter()


def count_launch(kernel: str) -> None:
    LAUNCHES[kernel] += 1
