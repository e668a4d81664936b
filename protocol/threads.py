"""A daemon thread that runs calls in order, each call's outcome delivered through a Future.

The in-process executor runs the worker on one (so that the core schedules the next step while
this one runs), and the model runner runs each step's device part on one (so that the host
prepares the next step while this one's forward runs). Daemon threads, so that a call still
running never holds up the process's exit; `close(wait=...)` gives the call being run a
bounded time to finish, so that what it holds is let go before the interpreter exits.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class OrderedThread:
    def __init__(self, name: str, setup: Callable[[], None] | None = None) -> None:
        """setup: run first on the thread (a CUDA device to select, say)."""
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, args=(setup,), daemon=True, name=name)
        self.thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future:
        future: Future[Any] = Future()
        self.calls.put((fn, future))
        return future

    def alive(self) -> bool:
        return self.thread.is_alive()

    def close(self, wait: float = 0.0) -> bool:
        """The thread ends after the calls already submitted. wait: seconds to wait for that
        (not from the thread itself). Returns whether it has ended."""
        self.calls.put(None)
        if wait > 0 and threading.current_thread() is not self.thread:
            self.thread.join(wait)
        return not self.thread.is_alive()

    def _serve(self, setup: Callable[[], None] | None) -> None:
        if setup is not None:
            setup()
        while (item := self.calls.get()) is not None:
            _run(*item)
            # Hold nothing while waiting: what a call referenced is freed by its owner's
            # thread, not by this one as the interpreter exits.
            del item


def _run(fn: Callable[[], Any], future: Future) -> None:
    try:
        result = fn()
    except BaseException as e:  # the caller re-raises it from future.result()
        future.set_exception(e)
        return
    if isinstance(result, Future):  # a call that started work elsewhere
        chain(result, future)
    else:
        future.set_result(result)


def chain(source: Future, target: Future, transform: Callable[[Any], Any] | None = None) -> None:
    """Completes `target` with `source`'s outcome (its result passed through `transform`)."""

    def settle(done: Future) -> None:
        try:
            result = done.result()
            target.set_result(result if transform is None else transform(result))
        except BaseException as e:
            target.set_exception(e)

    source.add_done_callback(settle)
