"""Death on every side of the process tree: a killed worker, a killed engine core, a step that
raises, a client that vanishes from a daemon, and a frontend garbage-collected after its core
died. Each failure reaches the user promptly with its cause, and no process is left behind.
Every process started here is killed at the end, whatever the outcome."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
from helpers import (
    AT_ONCE_S,
    PROMPTLY_S,
    is_running,
    kill_all,
    running_daemon,
    tokenmill_children,
    wait_until_gone,
)

from tokenmill import LLM, EngineDeadError, SamplingParams

LONG = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5 + i] * 20} for i in range(16)]


def spawned_llm(path, tp: int) -> LLM:
    return LLM(str(path), tensor_parallel_size=tp, skip_tokenizer_init=True,
               kv_cache_memory_bytes=32 << 20)  # fmt: skip


def generate_in_background(llm: LLM) -> tuple[threading.Thread, dict]:
    """Starts a long generation and returns once the engine is running it."""
    result: dict = {}

    def run() -> None:
        try:
            result["outputs"] = llm.generate(PROMPTS, LONG, use_tqdm=False)
        except BaseException as e:  # checked by the test
            result["error"] = e
        result["ended"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while llm.get_stats()["num_running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    return thread, result


def workers_of(llm: LLM) -> list[psutil.Process]:
    core = psutil.Process(llm.llm_engine.client.proc.pid)
    workers = [p for p in core.children() if "tokenmill.worker.worker_proc" in p.cmdline()]
    return sorted(workers, key=lambda p: next(a for a in p.cmdline() if a.startswith("--rank")))


@pytest.fixture
def no_leftovers():
    """Fails a test that leaves a tokenmill process behind (and kills what it left)."""
    before = {p.pid for p in tokenmill_children()}  # a module's shared daemon, say
    yield
    left = [p for p in tokenmill_children() if p.pid not in before]
    gone = wait_until_gone([p.pid for p in left], timeout=AT_ONCE_S)
    kill_all([p for p in left if p.pid in gone])
    assert not gone, f"tokenmill processes left after shutdown: {gone}"


def test_killed_worker_fails_the_frontend_with_the_cause(tiny_model, no_leftovers) -> None:
    llm = spawned_llm(tiny_model("llama-gqa"), tp=2)
    try:
        workers = workers_of(llm)
        assert len(workers) == 2
        thread, result = generate_in_background(llm)
        assert thread.is_alive(), "generation ended before the worker was killed"
        workers[1].kill()
        killed = time.monotonic()
        thread.join(PROMPTLY_S)
        assert isinstance(result.get("error"), EngineDeadError), result
        assert result["ended"] - killed < PROMPTLY_S
        message = str(result["error"])
        assert "worker rank 1" in message and "SIGKILL" in message, message
        with pytest.raises(EngineDeadError):
            llm.generate(PROMPTS[:1], LONG, use_tqdm=False)
    finally:
        llm.shutdown()


def test_killed_core_takes_its_workers_along(tiny_model, no_leftovers) -> None:
    llm = spawned_llm(tiny_model("llama-gqa"), tp=2)
    try:
        workers = [p.pid for p in workers_of(llm)]
        os.kill(llm.llm_engine.client.proc.pid, signal.SIGKILL)
        assert wait_until_gone(workers, timeout=PROMPTLY_S) == [], "workers outlived their core"
        with pytest.raises(EngineDeadError):
            llm.generate(PROMPTS[:1], LONG, use_tqdm=False)
    finally:
        llm.shutdown()


# Imported by every Python process started with the fault's folder on PYTHONPATH: the engine
# core and its workers make the model runner raise in the third step.
FAULT = """
import tokenmill.worker.model_runner as model_runner

_original = model_runner.ModelRunner.execute_model
_steps = [0]


def execute_model(self, scheduler_output):
    _steps[0] += 1
    if _steps[0] == 3:
        raise ValueError("injected fault in step 3")
    return _original(self, scheduler_output)


model_runner.ModelRunner.execute_model = execute_model
"""


@pytest.mark.parametrize("tp", [1, 2])
def test_a_step_that_raises_kills_the_engine_with_its_error(
    tiny_model, tmp_path, monkeypatch, no_leftovers, tp: int
) -> None:
    (tmp_path / "sitecustomize.py").write_text(FAULT)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    llm = spawned_llm(tiny_model("llama-gqa"), tp=tp)
    try:
        started = time.monotonic()
        with pytest.raises(EngineDeadError) as info:
            llm.generate(PROMPTS, LONG, use_tqdm=False)
        assert time.monotonic() - started < PROMPTLY_S
        message = str(info.value)
        assert "ValueError: injected fault in step 3" in message, message
        if tp == 2:
            assert "worker rank" in message and "submit_model" in message, message
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def slow_daemon(smollm2_path: str):
    """SmolLM2 one request at a time: the vanishing client's 16 x 900 tokens would take
    minutes, so an empty engine seconds later can only mean they were aborted."""
    extra = ("--max-num-seqs", "1", "--max-model-len", "1024")
    with running_daemon(smollm2_path, *extra, kv_cache_bytes=64 << 20) as (_, address):
        yield address


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_vanished_daemon_client_has_its_requests_aborted(slow_daemon: str, how) -> None:
    """A killed client's socket goes away; a frozen one stops its heartbeats."""
    script = textwrap.dedent(
        """
        import sys
        from tokenmill import LLM, SamplingParams
        llm = LLM(engine_address=sys.argv[1])
        params = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
        llm.generate([{"prompt_token_ids": [5 + i] * 20} for i in range(16)], params)
        """
    )
    observer = LLM(engine_address=slow_daemon)
    client = subprocess.Popen([sys.executable, "-c", script, slow_daemon])
    try:
        deadline = time.monotonic() + 60
        while observer.get_stats()["num_running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = observer.get_stats()
        assert stats["num_running"] == 1 and stats["num_waiting"] == 15, stats
        client.send_signal(how)
        vanished = time.monotonic()
        while time.monotonic() - vanished < PROMPTLY_S:
            stats = observer.get_stats()
            if stats["num_running"] == stats["num_waiting"] == 0:
                break
            time.sleep(0.1)
        assert stats["num_running"] == stats["num_waiting"] == 0, stats
        assert stats["kv_cache_usage"] == 0.0
    finally:
        client.kill()
        client.wait(10)
        observer.shutdown()


def test_garbage_collecting_a_dead_engines_frontend_does_not_hang(tiny_model) -> None:
    """The EngineDeadError's traceback holds the LLM in a reference cycle; once both are
    dropped, the collector runs the client's finalizer, which must not wait on sockets."""
    script = textwrap.dedent(
        f"""
        import gc, os, signal, threading, time
        from tokenmill import LLM, EngineDeadError, SamplingParams
        llm = LLM({str(tiny_model("llama-gqa"))!r}, skip_tokenizer_init=True,
                  kv_cache_memory_bytes=32 << 20)
        core = llm.llm_engine.client.proc.pid

        def kill_when_running():
            while llm.get_stats()["num_running"] == 0:
                time.sleep(0.01)
            os.kill(core, signal.SIGKILL)

        threading.Thread(target=kill_when_running, daemon=True).start()
        params = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
        try:
            llm.generate([{{"prompt_token_ids": [5] * 20}}] * 16, params, use_tqdm=False)
        except EngineDeadError as e:
            kept = e
        time.sleep(0.5)
        del llm, kept
        started = time.monotonic()
        gc.collect()
        print("collected in", time.monotonic() - started, flush=True)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    seconds = float(result.stdout.split("collected in")[1])
    assert seconds < AT_ONCE_S


def test_no_process_outlives_a_clean_shutdown(tiny_model, no_leftovers) -> None:
    llm = spawned_llm(tiny_model("llama-gqa"), tp=2)
    pids = [llm.llm_engine.client.proc.pid, *(p.pid for p in workers_of(llm))]
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    llm.shutdown()
    assert not any(is_running(pid) for pid in pids)
