"""The CPU worker's thread governor: one thread while another job shares the cores (its
threads got well under their full CPU time), the full count again once a probe finds the
cores free; a short burst of single-threaded work is not contention."""

from __future__ import annotations

import pytest
import torch

from tokenmill.worker import cpu_threads
from tokenmill.worker.cpu_threads import ThreadGovernor


@pytest.fixture
def governor():
    threads = torch.get_num_threads()
    yield ThreadGovernor(4)
    torch.set_num_threads(threads)


def test_contention_drops_to_one_thread_and_a_free_probe_restores_the_count(governor) -> None:
    g = governor
    low, free = 0.5, 0.98  # shares of the threads' time: 2 busy threads beside, or none
    g._decide(1.0, low)
    g._decide(1.5, low)  # two windows: a burst of single-threaded work, not yet contention
    assert g.current == 4
    g._decide(2.0, free)  # the run of low windows broken: counted afresh
    for t in (2.5, 3.0):
        g._decide(t, low)
    assert g.current == 4
    g._decide(3.5, low)  # the third in a row
    assert g.current == 1 and torch.get_num_threads() == 1
    g._decide(3.5 + g.PROBE_S - 0.1, 1.0)  # one thread has its core: no probe before PROBE_S
    assert g.current == 1
    g._decide(3.5 + g.PROBE_S, 1.0)  # the probe: the full count on trial
    assert g.current == 4 and torch.get_num_threads() == 4
    g._decide(4.0 + g.PROBE_S, low)  # still shared: one window on trial is enough
    assert g.current == 1
    g._decide(4.0 + 2 * g.PROBE_S, 1.0)
    g._decide(4.5 + 2 * g.PROBE_S, free)  # the job is gone: the full count stays
    g._decide(5.0 + 2 * g.PROBE_S, low)
    assert g.current == 4


def test_steps_are_timed_in_windows_of_their_own_time(governor, monkeypatch) -> None:
    """Only the time inside steps counts (an idle engine is not a shared one): 3 steps of
    0.2 s wall in which the process got 0.4 CPU-seconds of 4 threads' 0.8 are one low
    window of 0.6 s."""
    clock = {"wall": 0.0, "cpu": 0.0}
    monkeypatch.setattr(cpu_threads.time, "perf_counter", lambda: clock["wall"])
    monkeypatch.setattr(cpu_threads.time, "process_time", lambda: clock["cpu"])
    shares = []
    monkeypatch.setattr(governor, "_decide", lambda now, share: shares.append(share))
    for _ in range(3):
        with governor.step():
            clock["wall"] += 0.2
            clock["cpu"] += 0.4
        clock["wall"] += 5.0  # idle between steps
    assert shares == [pytest.approx(0.5)]
