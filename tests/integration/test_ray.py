"""Ray, on a local cluster of two simulated nodes (ray.cluster_utils.Cluster, each node with
CPUs of its own; one cluster for the module): tensor parallelism across the two nodes equals
one rank; a killed worker actor fails the engine within 5 s naming the rank and its node;
data-parallel ranks placed by Ray equal one engine through LLM, AsyncLLM and the server, and
a removed node costs no request: its rank's requests finish on the other rank, and the rank
is started again on the cluster and rejoins."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
from helpers import (
    CompletionsInFlight,
    assert_same,
    expected_completions,
    generate_async,
    httpx,
    mixed_completions,
    mixed_requests,
    require_ray,
    running_server,
)
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from tokenmill import LLM, SamplingParams

ray = require_ray()
pytestmark = pytest.mark.slow

ENGINE = dict(dtype="float32", max_model_len=1024, kv_cache_memory_bytes=128 << 20)


@pytest.fixture(scope="module")
def cluster():
    """A head without CPUs (nothing runs there) and two nodes of 2 CPUs; RAY_ADDRESS points
    every engine, in this process or another, at it."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False}
    )
    before = os.environ.get("RAY_ADDRESS")
    try:
        nodes = [cluster.add_node(num_cpus=2) for _ in range(2)]
        os.environ["RAY_ADDRESS"] = cluster.address
        yield cluster, nodes
    finally:
        if before is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = before
        ray.shutdown()
        cluster.shutdown()


def tiny_prompts() -> list[dict]:
    return [{"prompt_token_ids": [(7 * i + 3 * j) % 500 + 3 for j in range(3 + 6 * i)]}
            for i in range(12)]  # fmt: skip


def test_tp2_across_two_nodes_equals_tp1_and_a_killed_actor_names_its_rank(
    cluster, tiny_model, monkeypatch
) -> None:
    path = str(tiny_model("llama-gqa"))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    common = dict(skip_tokenizer_init=True, dtype="float32", kv_cache_memory_bytes=32 << 20,
                  max_model_len=512, multiprocess=False)  # fmt: skip
    one = LLM(path, **common)
    try:
        expected = [o.outputs[0].token_ids for o in one.generate(tiny_prompts(), params,
                                                                  use_tqdm=False)]  # fmt: skip
    finally:
        one.shutdown()
    monkeypatch.setenv("TOKENMILL_RAY_WORKER_CPUS", "2")  # a whole node per worker
    llm = LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray", **common)
    try:
        executor = llm.llm_engine.client.engine_core.executor
        nodes = {node_id for node_id, _, _ in executor.places}
        assert len(nodes) == 2, executor.places  # one rank on each node
        outputs = llm.generate(tiny_prompts(), params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected

        long = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
        failure: dict = {}

        def run() -> None:
            try:
                llm.generate(tiny_prompts(), long, use_tqdm=False)
            except Exception as e:
                failure["error"] = e
                failure["at"] = time.monotonic()

        thread = threading.Thread(target=run)
        thread.start()
        deadline = time.monotonic() + 60
        while llm.get_stats()["num_running"] == 0:  # under way, whatever the machine's speed
            assert time.monotonic() < deadline and thread.is_alive(), "generation never ran"
            time.sleep(0.01)
        ray.kill(executor.actors[1])
        killed = time.monotonic()
        thread.join(60)
        assert "error" in failure, "generation went on without a rank"
        assert failure["at"] - killed < 5.0
        message = str(failure["error"])
        assert "worker rank 1" in message and executor.places[1][1] in message, message
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def mixed(smollm2_path: str):
    prompts, params = mixed_requests(AutoTokenizer.from_pretrained(smollm2_path))
    llm = LLM(smollm2_path, **ENGINE)
    try:
        return prompts, params, llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()


def test_ray_dp2_equals_one_engine_through_llm_and_async_llm(
    cluster, smollm2_path: str, mixed
) -> None:
    prompts, params, expected = mixed
    llm = LLM(smollm2_path, data_parallel_size=2, data_parallel_backend="ray", **ENGINE)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        ranks = llm.get_stats()["data_parallel"]["ranks"]
    finally:
        llm.shutdown()
    assert_same(expected, outputs)
    assert len({r["node_id"] for r in ranks}) == 2  # spread over the nodes

    engine_args = dict(data_parallel_size=2, data_parallel_backend="ray", **ENGINE)
    assert_same(expected, asyncio.run(generate_async(smollm2_path, engine_args, prompts, params)))


def test_server_survives_a_removed_node_and_the_rank_comes_back(
    cluster, smollm2_path: str, smollm2_llm
) -> None:
    """32 greedy completions (stop strings, n = 2, half streamed) through a DP=2 server on
    Ray; the node of rank 1 is removed while they run."""
    ray_cluster, nodes = cluster
    specs = mixed_completions(smollm2_llm.get_tokenizer())
    expected = expected_completions(smollm2_llm, specs)
    extra = ("--data-parallel-size", "2", "--data-parallel-backend", "ray")
    with running_server(smollm2_path, *extra) as (_, base):
        ranks = httpx.get(f"{base}/health", timeout=10).json()["data_parallel"]["ranks"]
        victim = next(n for n in nodes if n.node_id == ranks[1]["node_id"])
        load = CompletionsInFlight(base, specs)
        load.wait_for_chunks(64)
        ray_cluster.remove_node(victim)
        removed = time.monotonic()
        seen_down = False
        while time.monotonic() - removed < 5 and not seen_down:
            status = httpx.get(f"{base}/health", timeout=10).json()["data_parallel"]
            seen_down = status["rank_failures"] == 1
            time.sleep(0.1)
        assert seen_down, status  # noticed within 5 s
        assert load.join() == expected  # streamed ones too: no piece repeated or missing
        # Rank 1 is started again on the node that is left, and serves.
        deadline = time.monotonic() + 120
        while True:
            health = httpx.get(f"{base}/health", timeout=10).json()
            if health["status"] == "ok":
                break
            assert time.monotonic() < deadline, health
            time.sleep(0.2)
        status = health["data_parallel"]
        assert status["rank_failures"] == 1 and status["resubmitted_requests"] > 0
        metrics = {
            (sample.name, sample.labels.get("engine", "")): sample.value
            for family in text_string_to_metric_families(
                httpx.get(f"{base}/metrics", timeout=10).text
            )
            for sample in family.samples
        }
        assert metrics[("tokenmill:data_parallel_rank_failures_total", "")] == 1
        assert metrics[("tokenmill:engine_up", "1")] == 1  # back up
        assert {r["node_id"] for r in status["ranks"]} == {ranks[0]["node_id"]}
        again = [
            load.client.completions.create(model="smollm2", prompt=s["prompt"], max_tokens=8,
                                           temperature=0, extra_body={"ignore_eos": True})
            for s in specs[:6]
        ]  # fmt: skip
        assert all(r.usage.completion_tokens == 8 for r in again)
