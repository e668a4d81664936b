"""The CPU worker's thread count, following contention for its cores.

libgomp's threads spin between parallel regions: on a quiet machine that is what makes a
decode step's hundreds of small parallel ops fast, but when another job shares the cores a
thread waits, spinning, for a partner that the OS has descheduled, and every parallel region
costs a time slice (W1-cpu on 2 cores beside a job of 2 busy threads: 3.4x its quiet time
with 2 threads, 1.8x with 1; a passive wait policy costs 40% on a quiet machine instead).

So each step is timed, wall and process CPU time: with N threads on cores of its own, the
process burns about N CPU-seconds a second (spinning included); well below that, it shares
its cores (beside 2 busy threads on 2 cores: 50%) and runs on one thread, trying its full
count again every PROBE_S seconds.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)


class ThreadGovernor:
    WINDOW_S = 0.5  # step time summed before a decision
    PROBE_S = 10.0  # on one thread, how long before the full count is tried again
    SHARE = 0.65  # CPU time per thread per second below which the cores are shared
    LOW_WINDOWS = 3  # windows in a row below SHARE before the count drops (1 after a probe)

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.current = threads
        self._wall = self._cpu = 0.0
        self._switched = time.perf_counter()
        self._low = 0  # windows in a row below SHARE
        self._probing = False  # the full count is back on trial

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around a step, on the thread that runs its torch work."""
        if self.threads < 2:
            yield
            return
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            now = time.perf_counter()
            self._wall += now - wall
            self._cpu += time.process_time() - cpu
            if self._wall >= self.WINDOW_S:
                self._decide(now, self._cpu / (self._wall * self.current))
                self._wall = self._cpu = 0.0

    def _decide(self, now: float, share: float) -> None:
        if self.current > 1:
            # Several windows in a row (a burst of single-threaded work, such as oneDNN
            # compiling its kernels for new shapes, is not contention), one after a probe.
            self._low = self._low + 1 if share < self.SHARE else 0
            if self._low >= (1 if self._probing else self.LOW_WINDOWS):
                self._set(1, now)
                if not self._probing:
                    logger.info("the CPU's cores are shared with other work (%.0f%% of %d "
                                "threads' time): running on one thread while they are",
                                100 * share, self.threads)  # fmt: skip
            self._probing = False
        elif now - self._switched >= self.PROBE_S:
            self._set(self.threads, now)
            self._probing = True

    def _set(self, threads: int, now: float) -> None:
        torch.set_num_threads(threads)
        self.current = threads
        self._switched = now
        self._low = 0
