"""AsyncLLM: step-by-step streaming, concurrent streams, cancellation that aborts in the core,
and EngineDeadError in every open stream when the core dies."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time

import psutil
import pytest
from helpers import PROMPTLY_S

from tokenmill import LLM, AsyncLLM, EngineDeadError, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


@pytest.fixture
def engine(tiny_model):
    engine = AsyncLLM(
        str(tiny_model("llama-gqa")),
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=32 << 20,
        dtype="float32",  # the runs compared batch differently (bf16 rounds by batch shape)
    )
    yield engine
    engine.shutdown()


def test_streams_match_offline_generation(tiny_model, engine: AsyncLLM) -> None:
    prompts = [{"prompt_token_ids": list(range(9, 9 + n))} for n in (3, 30, 70)]

    async def collect(i: int) -> list:
        return [out async for out in engine.generate(prompts[i], GREEDY, request_id=f"r{i}")]

    async def main() -> list:
        return await asyncio.gather(*(collect(i) for i in range(3)))

    streams = asyncio.run(main())
    offline = LLM(str(tiny_model("llama-gqa")), multiprocess=False, skip_tokenizer_init=True,
                  kv_cache_memory_bytes=32 << 20, dtype="float32")  # fmt: skip
    try:
        expected = offline.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        offline.shutdown()
    for stream, reference in zip(streams, expected):
        assert len(stream) > 1, "outputs should arrive step by step"
        lengths = [len(o.outputs[0].token_ids) for o in stream]
        assert lengths == sorted(lengths) and stream[-1].finished
        assert not any(o.finished for o in stream[:-1])
        assert stream[-1].outputs[0].token_ids == reference.outputs[0].token_ids


def test_cancelling_a_stream_aborts_the_request(engine: AsyncLLM) -> None:
    long_run = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)

    async def main() -> dict:
        seen = 0
        async for _ in engine.generate({"prompt_token_ids": [5, 6, 7]}, long_run, "long"):
            seen += 1
            if seen == 3:
                break  # leaving the loop closes the generator: the request is aborted
        deadline = time.monotonic() + PROMPTLY_S  # the abort reaches the core meanwhile
        while True:
            stats = await engine.get_stats()
            if stats["num_running"] == stats["num_waiting"] == 0 or time.monotonic() > deadline:
                return stats
            await asyncio.sleep(0.05)

    stats = asyncio.run(main())
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_dead_core_fails_open_streams(engine: AsyncLLM) -> None:
    long_run = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)

    async def main() -> None:
        streaming = [asyncio.Event() for _ in range(3)]

        async def consume(i: int) -> None:
            async for _ in engine.generate({"prompt_token_ids": [5 + i] * 10}, long_run):
                streaming[i].set()

        tasks = [asyncio.create_task(consume(i)) for i in range(3)]
        # Killed as soon as every stream is under way (900 tokens take far longer).
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in streaming)), timeout=30.0)
        os.kill(engine.client.proc.pid, signal.SIGKILL)
        results = await asyncio.wait_for(
            asyncio.gather(*tasks, return_exceptions=True), timeout=PROMPTLY_S
        )
        assert all(isinstance(r, EngineDeadError) for r in results), results
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate({"prompt_token_ids": [1]}, GREEDY):
                pass

    asyncio.run(main())


def test_dropping_the_engine_stops_the_core(tiny_model) -> None:
    engine = AsyncLLM(
        str(tiny_model("llama-gqa")),
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=32 << 20,
        dtype="float32",  # the runs compared batch differently (bf16 rounds by batch shape)
    )

    async def one(e: AsyncLLM) -> None:
        async for _ in e.generate({"prompt_token_ids": [3, 4]}, GREEDY):
            pass

    asyncio.run(one(engine))
    core = psutil.Process(engine.client.proc.pid)
    del engine
    gc.collect()
    try:
        core.wait(timeout=PROMPTLY_S)
    except psutil.TimeoutExpired:
        core.kill()
        pytest.fail("the engine core outlived its garbage-collected AsyncLLM")
