"""Helpers shared by the integration tests: a daemon that is always killed, free ports, and
finding (and waiting out) tokenmill processes."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil


def free_port_pair() -> int:
    """A port p with p and p+1 free on loopback (the daemon's input and output sockets)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


@contextmanager
def running_daemon(
    model_path, *extra: str, kv_cache_bytes: int = 32 << 20
) -> Iterator[tuple[subprocess.Popen, str]]:
    """An `engine-core` daemon on a free loopback port; killed (with its workers, who watch
    it) on the way out, whatever happened."""
    address = f"tcp://127.0.0.1:{free_port_pair()}"
    command = [
        sys.executable, "-m", "tokenmill.core.daemon",
        "--model", str(model_path), "--address", address,
        "--skip-tokenizer-init", "true", "--kv-cache-memory-bytes", str(kv_cache_bytes),
        *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(command)
    try:
        yield proc, address
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def is_running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_until_gone(pids: list[int], timeout: float) -> list[int]:
    """Waits up to `timeout` s for the processes to exit; returns those still running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(is_running(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if is_running(p)]


def tokenmill_children() -> list[psutil.Process]:
    """This process's descendants that run tokenmill code (cores, daemons, workers)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and any(
                "tokenmill" in part for part in child.cmdline()
            ):
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def kill_all(processes: list[psutil.Process]) -> None:
    for proc in processes:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
