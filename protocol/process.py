"""Starting, watching and stopping tokenmill's own processes, with a deadline on every wait.

Used on both sides of each process boundary: a frontend spawning its engine core, an executor
spawning its workers, and the children watching the parent that started them. Children are
fresh interpreters running a module (`python -m ...`), never forks of the caller, so a user's
script needs no `if __name__ == "__main__"` guard; their configuration arrives as JSON on
stdin. Whoever owns ZeroMQ sockets closes them itself (`close_sockets`): a context terminated
while a socket is still open waits for ever.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec
import psutil

logger = logging.getLogger(__name__)


def start_module(
    module: str, args: Sequence[str], config: Any, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """Runs `python -m module *args` with `config` JSON-encoded on its stdin, in a session of
    its own: a signal meant for the parent's process group (Ctrl-C in a terminal, a service
    manager's SIGTERM) reaches only the parent, which stops its children in order (a server
    drains first). A child whose parent dies exits by itself (watch_parent)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdin=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    assert proc.stdin is not None
    proc.stdin.write(msgspec.json.encode(config))
    proc.stdin.close()
    return proc


def stop_processes(procs: Iterable[subprocess.Popen], timeout: float = 5.0) -> None:
    """SIGTERM, then SIGKILL whatever is still running `timeout` seconds later; reaps all."""
    procs = [p for p in procs if p.poll() is None]
    for proc in procs:
        proc.terminate()
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            proc.kill()
    for proc in procs:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:  # unkillable (stuck in the kernel): leave it
            logger.error("process %d did not exit after SIGKILL", proc.pid)


def wait_for_exit(procs: Sequence[subprocess.Popen], stop: threading.Event) -> int | None:
    """Blocks until one of `procs` exits (its index) or `stop` is set (None).

    Waits on the processes' sentinels (pidfds) where the platform has them, so an exit is
    seen at once; elsewhere it polls five times a second."""
    pidfds = []
    if hasattr(os, "pidfd_open"):
        try:
            pidfds = [os.pidfd_open(p.pid) for p in procs]
        except OSError:  # kernel without pidfds, or the process is already reaped
            pidfds = []
    try:
        while not stop.is_set():
            for i, proc in enumerate(procs):
                if proc.poll() is not None:
                    return i
            if pidfds:
                multiprocessing.connection.wait(pidfds, timeout=0.2)
            else:
                stop.wait(0.2)
        return None
    finally:
        for fd in pidfds:
            os.close(fd)


def watch_parent(parent_pid: int, name: str, cleanup: Callable[[], None] | None = None) -> None:
    """Makes this process exit (after `cleanup`) within a second of its parent's death, even
    while its main thread is blocked (in a collective, say)."""

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid or not psutil.pid_exists(parent_pid):
                logger.error("parent process %d is gone; %s exits", parent_pid, name)
                if cleanup is not None:
                    cleanup()
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name=f"{name}-watchdog").start()


def remove_dir(path: str | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def close_sockets(ctx: Any, sockets: Iterable[Any], linger_ms: int = 0) -> None:
    """Closes the sockets this owner made, then terminates their context.

    `Context.destroy()` is not enough: it closes only the sockets the context still tracks
    (weakly), and during garbage collection those references are already cleared, so `term()`
    would then wait for ever on sockets nobody closed. With every socket closed here, `term()`
    returns once `linger_ms` has let queued messages out; a daemon thread runs it so that even
    a socket opened elsewhere in the context cannot hold this caller past the deadline."""
    for socket in sockets:
        if not socket.closed:
            socket.close(linger=linger_ms)
    done = threading.Thread(target=ctx.term, daemon=True, name="zmq-term")
    done.start()
    done.join(linger_ms / 1000 + 2.0)
    if done.is_alive():
        logger.warning("a ZeroMQ context did not terminate: some socket of it is still open")
