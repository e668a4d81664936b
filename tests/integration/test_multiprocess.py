"""The engine core in its own process: same results as in-process, prompt failure when it
dies, no orphan when the frontend dies, the core's own error when start-up fails, and no
busy-waiting while idle. Every process started here is stopped, whatever the outcome."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from helpers import AT_ONCE_S, PROMPTLY_S, is_running

from tokenmill import LLM, EngineDeadError, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def make_llm(path, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 32 << 20)
    kwargs.setdefault("dtype", "float32")  # compared across processes and thread counts
    return LLM(str(path), skip_tokenizer_init=True, **kwargs)


@pytest.fixture
def mp_llm(tiny_model):
    llm = make_llm(tiny_model("llama-gqa"), multiprocess=True)
    yield llm
    llm.shutdown()


def test_spawned_core_matches_in_process(tiny_model, mp_llm: LLM) -> None:
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (1, 9, 40, 130)]
    spawned = mp_llm.generate(prompts, GREEDY, use_tqdm=False)
    local = make_llm(tiny_model("llama-gqa"), multiprocess=False)
    try:
        expected = local.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        local.shutdown()
    assert [o.outputs[0].token_ids for o in spawned] == [o.outputs[0].token_ids for o in expected]
    stats = mp_llm.get_stats()  # a utility call over the same sockets
    assert stats["num_running"] == 0 and stats["prefix_cache_queries"] > 0
    assert mp_llm.llm_engine.client.call_utility("check_health") is True


def test_bad_request_fails_alone(mp_llm: LLM) -> None:
    with pytest.raises(ValueError, match="outside"):
        mp_llm.generate({"prompt_token_ids": [1, 10**6]}, GREEDY, use_tqdm=False)
    out = mp_llm.generate({"prompt_token_ids": [3, 4, 5]}, GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 12


def test_killed_core_fails_pending_and_new_calls(mp_llm: LLM, monkeypatch) -> None:
    engine = mp_llm.llm_engine
    core = engine.client.proc
    long_run = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i] * 20} for i in range(32)]
    # The core dies on the frontend's first step, when the requests have just been sent: 900
    # decode steps cannot be done by then, however fast the machine (a timer could be late).
    step = engine.step
    killed_while_pending = []

    def step_that_kills_the_core():
        if not killed_while_pending:
            killed_while_pending.append(engine.has_unfinished_requests())
            os.kill(core.pid, signal.SIGKILL)
        return step()

    monkeypatch.setattr(engine, "step", step_that_kills_the_core)
    started = time.monotonic()
    with pytest.raises(EngineDeadError):
        mp_llm.generate(prompts, long_run, use_tqdm=False)
    assert killed_while_pending == [True]
    assert time.monotonic() - started < PROMPTLY_S
    started = time.monotonic()
    with pytest.raises(EngineDeadError):
        mp_llm.generate({"prompt_token_ids": [1, 2]}, GREEDY, use_tqdm=False)
    assert time.monotonic() - started < AT_ONCE_S


def test_core_exits_when_the_frontend_is_killed(tiny_model) -> None:
    script = textwrap.dedent(
        f"""
        from tokenmill import LLM
        llm = LLM({str(tiny_model("llama-gqa"))!r}, multiprocess=True,
                  skip_tokenizer_init=True, kv_cache_memory_bytes=32 << 20)
        print(llm.llm_engine.client.proc.pid, flush=True)
        import time
        time.sleep(600)
        """
    )
    frontend = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    core_pid = None
    try:
        core_pid = int(frontend.stdout.readline())
        assert psutil.pid_exists(core_pid)
        frontend.kill()
        frontend.wait(10)
        deadline = time.monotonic() + PROMPTLY_S
        while time.monotonic() < deadline and is_running(core_pid):
            time.sleep(0.1)
        assert not is_running(core_pid), "the engine core outlived its frontend"
    finally:
        frontend.kill()
        if core_pid is not None and is_running(core_pid):
            os.kill(core_pid, signal.SIGKILL)


def test_start_up_failure_reports_the_cores_own_error(tiny_model) -> None:
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"engine core failed to start: ValueError: .*needs"):
        make_llm(tiny_model("llama-gqa"), multiprocess=True, kv_cache_memory_bytes=4096)
    assert time.monotonic() - started < 60


def test_idle_core_does_not_spin(mp_llm: LLM) -> None:
    core = psutil.Process(mp_llm.llm_engine.client.proc.pid)
    mp_llm.generate({"prompt_token_ids": [3, 4]}, GREEDY, use_tqdm=False)
    time.sleep(0.5)
    before = core.cpu_times()
    time.sleep(5.0)
    after = core.cpu_times()
    used = (after.user + after.system) - (before.user + before.system)
    assert used / 5.0 < 0.01, f"idle engine core used {100 * used / 5.0:.2f}% of a core"


def test_dropping_the_llm_stops_the_core(tiny_model) -> None:
    import gc

    llm = make_llm(tiny_model("llama-gqa"), multiprocess=True)
    llm.generate({"prompt_token_ids": [3, 4]}, GREEDY, use_tqdm=False)
    core_pid = llm.llm_engine.client.proc.pid
    del llm
    gc.collect()
    deadline = time.monotonic() + PROMPTLY_S
    while time.monotonic() < deadline and is_running(core_pid):
        time.sleep(0.1)
    try:
        assert not is_running(core_pid), "the engine core outlived its garbage-collected LLM"
    finally:
        if is_running(core_pid):
            os.kill(core_pid, signal.SIGKILL)
