"""Async scheduling must not change results: one mixed workload (preemption, chunked
prefill, prefix hits, stop strings, max_tokens endings, logprobs, penalties, n > 1, a JSON
schema, seeded sampling) gives the same outputs with `async_scheduling` on and off: on
SmolLM2 in-process and with a spawned core, and on a random tiny model in-process and at
TP=2; with the workers running their steps in turn (the CPU's default) and overlapping them
(CUDA's)."""

from __future__ import annotations

import json
import time

import pytest
from helpers import assert_same, smollm2_prompts, workload

from tokenmill import LLM, SamplingParams
from tokenmill.worker.input_batch import InputBatch

pytestmark = pytest.mark.slow

# Small enough that requests are preempted, chunked and share cached blocks.
ENGINE = dict(
    dtype="float32",  # compared across batchings: bf16's near-ties would swap
    max_model_len=336,
    num_gpu_blocks_override=22,  # 21 usable blocks of 16: one long request fills them
    block_size=16,
    max_num_batched_tokens=64,
    max_num_seqs=8,
)


def run(path: str, prompts, params, **engine_args) -> tuple[list, dict]:
    llm = LLM(path, **{**ENGINE, **engine_args})
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return outputs, llm.get_stats()
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def smollm2_workload(smollm2_path: str):
    from transformers import AutoTokenizer

    prompts, params = workload(smollm2_prompts(AutoTokenizer.from_pretrained(smollm2_path)), True)
    expected, stats = run(smollm2_path, prompts, params, async_scheduling=False, multiprocess=False)
    assert stats["num_preemptions"] > 0, stats
    assert stats["prefix_cache_hits"] > 0, stats
    return prompts, params, expected


@pytest.mark.parametrize(
    "multiprocess,overlap",
    [(False, "0"), (False, "1"), (True, "1")],
    ids=["inproc-steps-in-turn", "inproc-overlapped", "spawned-overlapped"],
)
def test_smollm2_async_equals_sync(
    smollm2_path: str, smollm2_workload, multiprocess, overlap, monkeypatch
) -> None:
    """overlap: whether the workers prepare each step while the one before runs (as on CUDA),
    or run their steps in turn (the CPU's default)."""
    monkeypatch.setenv("TOKENMILL_OVERLAP_STEPS", overlap)
    prompts, params, expected = smollm2_workload
    outputs, stats = run(
        smollm2_path, prompts, params, async_scheduling=True, multiprocess=multiprocess
    )
    assert stats["num_preemptions"] > 0, stats
    assert_same(expected, outputs)
    # The mix exercised what it is meant to: a JSON answer, a stop string, length endings.
    answer = outputs[-1].outputs[0]
    assert answer.finish_reason == "stop" and json.loads(answer.text).keys() == {"name", "age"}
    assert outputs[-3].outputs[0].stop_reason == "."
    assert {o.outputs[0].finish_reason for o in outputs} == {"stop", "length"}


@pytest.mark.parametrize("overlap", ["0", "1"], ids=["steps-in-turn", "overlapped"])
@pytest.mark.parametrize("tp", [1, 2])
def test_tiny_model_async_equals_sync(tiny_model, tp: int, overlap: str, monkeypatch) -> None:
    monkeypatch.setenv("TOKENMILL_OVERLAP_STEPS", overlap)
    path = str(tiny_model("llama-gqa"))
    base = [[(11 * i + 5 * j) % 480 + 3 for j in range(n)] for i, n in
            enumerate((3, 9, 17, 30, 41, 66, 100, 130))]  # fmt: skip
    prompts, params = workload(base, text=False)
    common = dict(skip_tokenizer_init=True, tensor_parallel_size=tp, multiprocess=False)
    expected, stats = run(path, prompts, params, async_scheduling=False, **common)
    outputs, async_stats = run(path, prompts, params, async_scheduling=True, **common)
    assert stats["num_preemptions"] > 0 and async_stats["num_preemptions"] > 0, (stats, async_stats)
    assert stats["prefix_cache_hits"] > 0
    assert_same(expected, outputs)
    assert {o.outputs[0].finish_reason for o in outputs} == {"stop", "length"}


def test_rows_reused_only_after_the_step_that_wrote_them(tiny_model, monkeypatch) -> None:
    """Two rows in the runner's batch: a request that finishes while its extra step runs
    frees its row just as the next request needs one, so the runner waits for that step
    before giving the row away. Each step is slow to record its tokens, so that the next
    step's apply() comes first: a row reused too early then gets the old step's token."""
    path = str(tiny_model("llama-gqa"))
    prompts, params = [], []
    for i in range(12):
        prompts.append({"prompt_token_ids": [(7 * i + 3 * j) % 480 + 3 for j in range(5 + i)]})
        extra = dict(temperature=0.9, seed=i) if i % 3 == 0 else dict(temperature=0.0)
        if i % 3 == 1:
            extra.update(presence_penalty=0.7, repetition_penalty=1.3)
        # Any token but the special ones stops it once min_tokens are out: its step after
        # that one has run for nothing.
        stops = dict(min_tokens=i % 4, stop_token_ids=list(range(3, 480)))
        params.append(SamplingParams(max_tokens=8, **stops, **extra))
    common = dict(
        skip_tokenizer_init=True, multiprocess=False, max_num_seqs=4, max_num_batched_tokens=16
    )
    expected, _ = run(path, prompts, params, async_scheduling=False, **common)
    monkeypatch.setenv("TOKENMILL_OVERLAP_STEPS", "1")
    append_tokens = InputBatch.append_tokens

    def slow_append(self, rows, token_ids) -> None:
        time.sleep(0.02)
        append_tokens(self, rows, token_ids)

    monkeypatch.setattr(InputBatch, "append_tokens", slow_append)
    outputs, _ = run(path, prompts, params, async_scheduling=True, **common)
    assert_same(expected, outputs)
    assert {o.outputs[0].finish_reason for o in outputs} == {"stop"}


EXIT_SCRIPT = """
import sys
from tokenmill import LLM, SamplingParams
llm = LLM(sys.argv[1], skip_tokenizer_init=True, multiprocess=False, async_scheduling=True,
          max_model_len=256)
out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4),
                   use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 4
llm.shutdown()
"""


@pytest.mark.parametrize("overlap", ["0", "1"], ids=["steps-in-turn", "overlapped"])
def test_process_exits_cleanly_after_in_process_async_engine(tiny_model, overlap: str) -> None:
    """The executor's threads end on their own: the worker and its model are freed by the
    thread that shut the engine down, not by a daemon thread as the interpreter exits (which
    aborted the process at exit)."""
    import os
    import subprocess
    import sys

    path = str(tiny_model("llama-gqa"))
    env = {**os.environ, "TOKENMILL_OVERLAP_STEPS": overlap}
    for _ in range(2):  # it aborted in about half the runs
        done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, path], env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
