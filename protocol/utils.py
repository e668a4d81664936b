"""Small helpers that every tokenmill package may use (protocol imports nothing of the
project, so anything may import it): ceiling division, and a value's repr cut short for
error messages."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")


def cdiv(a: T, b: int) -> T:
    """Ceiling division: how many blocks of size b hold a items (ints or numpy arrays)."""
    return -(a // -b)  # type: ignore[operator]


def short_repr(value: object, limit: int = 200) -> str:
    """repr(value), cut to `limit` characters (error messages quote what a client sent)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class StageTimes:
    """Seconds per stage of a loop, summed over its steps (TOKENMILL_STEP_TIMING): timed
    around the stages (`with times.stage("schedule"): ...`), never inside them. Off, a stage
    is a no-op. `synchronize`: called as a stage ends (the worker's: the device's queued
    kernels count where they were launched), unless the stage asks not to."""

    def __init__(self, on: bool, synchronize: Callable[[], None] | None = None) -> None:
        self.on = on
        self.synchronize = synchronize
        self.times: dict[str, float] = {}
        self.num_steps = 0

    def stage(self, name: str, synchronize: bool = True) -> contextlib.AbstractContextManager[None]:
        return self._timed(name, synchronize) if self.on else _UNTIMED

    @contextlib.contextmanager
    def _timed(self, name: str, synchronize: bool) -> Iterator[None]:
        start = time.perf_counter()
        yield
        if synchronize and self.synchronize is not None:
            self.synchronize()
        self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        if self.on:
            self.times[name] = self.times.get(name, 0.0) + seconds


_UNTIMED = contextlib.nullcontext()
