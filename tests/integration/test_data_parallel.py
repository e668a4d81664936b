"""Data parallelism with engine-core processes (data_parallel_size=2): the same outputs as one
engine through LLM, AsyncLLM and the server, whatever the routing; and a rank lost under
load (its core killed, or one of its workers) costs no request: every one finishes equal to
an uninterrupted run, streams show no repeated or missing text, the other rank keeps
serving, and /health and /metrics say which rank is down."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import psutil
import pytest
from helpers import (
    PROMPTLY_S,
    CompletionsInFlight,
    assert_same,
    assert_same_greedy_tokens,
    expected_completions,
    free_port_pair,
    generate_async,
    httpx,
    mixed_completions,
    mixed_requests,
    running_daemon,
    running_server,
)
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.frontend.dp_ranks import Registry
from tokenmill.frontend.dp_router import PrefixRecord, RankLoad, Router
from tokenmill.protocol.messages import SchedulerStats

pytestmark = pytest.mark.slow

# fp32: ranks batch the requests otherwise than one engine, and bf16's near-ties would swap.
ENGINE = dict(dtype="float32", max_model_len=1024, kv_cache_memory_bytes=128 << 20)


@pytest.fixture(scope="module")
def mixed(smollm2_path: str):
    """32 mixed requests (every sampling feature of the async tests, stop strings and a JSON
    schema included) and one engine's outputs for them."""
    prompts, params = mixed_requests(AutoTokenizer.from_pretrained(smollm2_path))
    llm = LLM(smollm2_path, **ENGINE)
    try:
        expected = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    return prompts, params, expected


def test_llm_dp2_equals_one_engine(smollm2_path: str, mixed) -> None:
    prompts, params, expected = mixed
    llm = LLM(smollm2_path, data_parallel_size=2, **ENGINE)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.get_stats()
    finally:
        llm.shutdown()
    assert_same(expected, outputs)
    ranks = stats["data_parallel"]["ranks"]
    assert [r["state"] for r in ranks] == ["up", "up"]
    # Both ranks served some, and the totals are the ranks' sums.
    served = [r["stats"]["prefix_cache_queries"] for r in ranks]
    assert min(served) > 0 and stats["prefix_cache_queries"] == sum(served)


def test_async_llm_dp2_equals_one_engine(smollm2_path: str, mixed) -> None:
    prompts, params, expected = mixed

    engine_args = dict(data_parallel_size=2, data_parallel_routing="load", **ENGINE)
    assert_same(expected, asyncio.run(generate_async(smollm2_path, engine_args, prompts, params)))


def metric_values(base: str) -> dict[tuple[str, str], float]:
    """(sample name, engine label) -> value."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {
        (sample.name, sample.labels.get("engine", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.mark.parametrize("victim", ["core", "worker"])
def test_server_keeps_serving_when_a_rank_is_killed(
    smollm2_path: str, smollm2_llm, victim: str
) -> None:
    """32 greedy completions (stop strings, n = 2, half of them streamed) through a DP=2
    server; while they run, rank 1's core is killed (SIGKILL), or its worker (the ranks'
    workers are processes of their own then: the mp executor)."""
    specs = mixed_completions(smollm2_llm.get_tokenizer())
    expected = expected_completions(smollm2_llm, specs)
    extra = ["--data-parallel-size", "2"]
    if victim == "worker":
        extra += ["--distributed-executor-backend", "mp"]
    with running_server(smollm2_path, *extra) as (_, base):
        health = httpx.get(f"{base}/health", timeout=10).json()
        assert health["status"] == "ok"
        pid = health["data_parallel"]["ranks"][1]["pid"]
        if victim == "worker":
            (worker,) = [p for p in psutil.Process(pid).children()
                         if "worker_proc" in " ".join(p.cmdline())]  # fmt: skip
            pid = worker.pid
        load = CompletionsInFlight(base, specs)
        load.wait_for_chunks(64)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        while time.monotonic() - killed < 5:
            ranks = httpx.get(f"{base}/health", timeout=10).json()["data_parallel"]["ranks"]
            if ranks[1]["state"] == "down":
                break
            time.sleep(0.1)
        assert ranks[1]["state"] == "down", ranks  # noticed within 5 s
        if victim == "worker":
            assert "worker rank 0" in ranks[1]["cause"], ranks[1]
        assert load.join() == expected  # streamed ones too: no piece repeated or missing

        more = load.client.completions.create(model="smollm2", prompt=specs[0]["prompt"],
                                              max_tokens=8, temperature=0)  # fmt: skip
        assert more.usage.completion_tokens > 0
        health = httpx.get(f"{base}/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        status = health.json()["data_parallel"]
        assert status["ranks_up"] == 1 and status["rank_failures"] == 1
        assert status["resubmitted_requests"] > 0
        values = metric_values(base)
        assert values[("tokenmill:engine_up", "0")] == 1
        assert values[("tokenmill:engine_up", "1")] == 0
        assert values[("tokenmill:data_parallel_rank_failures_total", "")] == 1
        assert values[("tokenmill:data_parallel_resubmitted_requests_total", "")] > 0
        assert values[("tokenmill:num_requests_running", "0")] >= 0


def test_no_rank_left_is_engine_dead(tiny_model) -> None:
    from tokenmill.frontend.core_client import EngineDeadError

    llm = LLM(str(tiny_model("llama-gqa")), data_parallel_size=2, skip_tokenizer_init=True,
              kv_cache_memory_bytes=16 << 20)  # fmt: skip
    try:
        for rank in llm.llm_engine.client.data_parallel_status()["ranks"]:
            os.kill(rank["pid"], signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="every data-parallel rank is down"):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                llm.generate({"prompt_token_ids": [5, 6, 7]}, use_tqdm=False)
                time.sleep(0.1)
    finally:
        llm.shutdown()


# ---------------------------------------------------------------------------- routing
def loads(*scores: tuple[int, int], blocks: int = 100) -> list[RankLoad]:
    ranks = []
    for i, (waiting, running) in enumerate(scores):
        rank = RankLoad(i, blocks)
        rank.stats = SchedulerStats(num_running=running, num_waiting=waiting)
        rank.unfinished = waiting + running
        ranks.append(rank)
    return ranks


def test_router_prefers_the_rank_holding_the_prefix_within_the_margin() -> None:
    router = Router("prefix", margin=8, block_size=4)
    prompt = list(range(40))  # 10 full blocks
    hashes = router.block_hashes(prompt)
    a, b = loads((0, 2), (0, 0))  # scores 2 and 0
    a.record.add(hashes[:6])
    assert router.choose([a, b], hashes) is a  # 6 blocks held, 2 more load: within 8
    a.stats = SchedulerStats(num_running=3, num_waiting=2)  # score 4 x 2 + 3 = 11 > 0 + 8
    a.unfinished = 5
    assert router.choose([a, b], hashes) is b
    # A prompt that shares nothing goes to the least loaded; "load" routing ignores prefixes.
    assert router.choose([a, b], router.block_hashes(list(range(100, 140)))) is b
    a.stats, a.unfinished = SchedulerStats(num_running=2), 2
    assert Router("load", 8, 4).choose([a, b], Router("load", 8, 4).block_hashes(prompt)) is b
    # Requests sent but not yet in the stats count as waiting.
    b.unfinished = 3
    assert b.score() == 12
    # The same prompt under a LoRA adapter shares no block with the base model's (the ranks'
    # prefix caches keep them apart), nor with another adapter's.
    salted = [router.block_hashes(prompt, salt=LoRARequest(n, i, "/a").cache_salt)
              for n, i in (("sql", 1), ("chat", 2))]  # fmt: skip
    assert a.record.matched(salted[0]) == 0 and len(salted[0]) == len(hashes)
    assert salted[0] != salted[1]


def test_prefix_record_is_bounded_and_matches_leading_blocks_only() -> None:
    router = Router("prefix", 8, 2)
    record = PrefixRecord(capacity=4)
    hashes = router.block_hashes(list(range(12)))  # 6 blocks
    record.add(hashes)
    assert len(record.blocks) == 4  # the oldest two were evicted
    assert record.matched(hashes) == 0  # the first block is gone: no prefix matches
    assert record.matched(hashes[2:]) == 4
    other = router.block_hashes([99] + list(range(1, 12)))  # differs in block 0
    assert record.matched(other) == 0


def test_data_parallel_config_errors_name_the_field(tiny_model) -> None:
    path = str(tiny_model("llama-gqa"))
    with pytest.raises(ValueError, match="data_parallel_rpc_port must be the port headless"):
        LLM(path, data_parallel_size=2, data_parallel_size_local=1)
    with pytest.raises(ValueError, match="data_parallel_routing must be"):
        LLM(path, data_parallel_size=2, data_parallel_routing="random")
    with pytest.raises(ValueError, match="cannot run with multiprocess=False"):
        LLM(path, data_parallel_size=2, multiprocess=False)


def test_dp_status_is_json(tiny_model) -> None:
    llm = LLM(str(tiny_model("llama-gqa")), data_parallel_size=2, skip_tokenizer_init=True,
              kv_cache_memory_bytes=16 << 20)  # fmt: skip
    try:
        status = json.loads(json.dumps(llm.llm_engine.client.data_parallel_status()))
        assert [r["state"] for r in status["ranks"]] == ["up", "up"]
        assert all(psutil.pid_exists(r["pid"]) for r in status["ranks"])
        pids = [r["pid"] for r in status["ranks"]]
    finally:
        llm.shutdown()
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
              for p in pids) and time.monotonic() < deadline:  # fmt: skip
        time.sleep(0.1)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in pids)  # fmt: skip


# ------------------------------------------------------------------------ headless ranks
def headless_rank(model, rank: int, rpc_port: int, *extra: str):
    """`engine-core` as headless data-parallel rank `rank` of 2, joining a frontend on
    loopback (a context manager: stopped on the way out)."""
    return running_daemon(
        model, "--data-parallel-size", "2", "--data-parallel-rank", str(rank),
        "--data-parallel-rpc-port", str(rpc_port), *extra, kv_cache_bytes=32 << 20,
    )  # fmt: skip


def test_headless_rank_joins_leaves_and_rejoins(tiny_model) -> None:
    path = tiny_model("llama-gqa")
    prompts = [{"prompt_token_ids": [(5 * i + 3 * j) % 500 + 3 for j in range(4 + 5 * i)]}
               for i in range(16)]  # fmt: skip
    # Long enough that rank 1 is still generating when the test looks (a tiny model's 200
    # tokens were once all done on a busy machine between two looks).
    params = SamplingParams(temperature=0.0, max_tokens=800, ignore_eos=True)
    common = dict(skip_tokenizer_init=True, dtype="float32", kv_cache_memory_bytes=32 << 20)
    one = LLM(str(path), **common)
    try:
        with_top_two = SamplingParams(temperature=0.0, max_tokens=800, ignore_eos=True, logprobs=2)
        expected = one.generate(prompts, with_top_two, use_tqdm=False)
    finally:
        one.shutdown()
    rpc_port = free_port_pair()
    with headless_rank(path, 1, rpc_port) as (daemon, _):
        llm = LLM(str(path), data_parallel_size=2, data_parallel_size_local=1,
                  data_parallel_rpc_port=rpc_port, **common)  # fmt: skip
        try:
            status = llm.get_stats()["data_parallel"]
            assert [r["state"] for r in status["ranks"]] == ["up", "up"]
            assert "pid" not in status["ranks"][1]  # a daemon this frontend did not start
            result: dict = {}
            thread = threading.Thread(
                target=lambda: result.update(out=llm.generate(prompts, params, use_tqdm=False))
            )
            thread.start()
            deadline = time.monotonic() + 60
            while llm.get_stats()["data_parallel"]["ranks"][1]["stats"]["num_running"] == 0:
                assert thread.is_alive(), "the generation ended before rank 1 was seen running"
                assert time.monotonic() < deadline
                time.sleep(0.05)
            daemon.kill()
            thread.join(300)
            assert_same_greedy_tokens(result["out"], expected)
            deadline = time.monotonic() + PROMPTLY_S  # (rank 1 may have finished its share)
            while llm.get_stats()["data_parallel"]["ranks"][1]["state"] != "down":
                assert time.monotonic() < deadline, "the killed rank is not marked down"
                time.sleep(0.05)
            # Started again, the rank registers again and takes requests.
            with headless_rank(path, 1, rpc_port):
                deadline = time.monotonic() + 120
                while llm.get_stats()["data_parallel"]["ranks_up"] < 2:
                    assert time.monotonic() < deadline, "the restarted rank did not rejoin"
                    time.sleep(0.2)
                outputs = llm.generate(prompts, params, use_tqdm=False)
                assert_same_greedy_tokens(outputs, expected)
                ranks = llm.get_stats()["data_parallel"]["ranks"]
                assert ranks[1]["stats"]["prefix_cache_queries"] > 0  # it served some
        finally:
            llm.shutdown()


def test_headless_rank_with_a_wrong_token_is_refused(tiny_model) -> None:
    path = tiny_model("llama-gqa")
    rpc_port = free_port_pair()
    registry = Registry("127.0.0.1", rpc_port, "right", 2)
    try:
        with headless_rank(path, 1, rpc_port, "--auth-token", "wrong") as (daemon, _):
            assert daemon.wait(120) != 0  # it stops itself, saying why
        with pytest.raises(TimeoutError, match="rank 1 did not register"):
            registry.wait_for(1, -1.0, 0.5)
    finally:
        registry.close()
    with pytest.raises(ValueError, match="is not loopback: headless ranks must present"):
        Registry("0.0.0.0", rpc_port, "", 2)
