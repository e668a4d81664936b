"""The runner's persistent batch: rows freed while a step may still write them (async
scheduling) go to new requests only from the next apply() on."""

from __future__ import annotations

import numpy as np

from tokenmill.protocol.messages import SamplingParams
from tokenmill.protocol.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from tokenmill.worker.input_batch import InputBatch


def new(req_id: str, tokens: list[int]) -> NewRequestData:
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(temperature=0.0),
        eos_token_ids=[0],
        block_ids=[0],
        num_computed_tokens=0,
    )


def output(new_reqs=(), finished=()) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=list(new_reqs),
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={r.req_id: len(r.prompt_token_ids) for r in new_reqs},
        total_num_scheduled_tokens=sum(len(r.prompt_token_ids) for r in new_reqs),
        finished_req_ids=list(finished),
    )


def make_batch() -> InputBatch:
    return InputBatch(max_num_reqs=3, max_model_len=32, block_size=16, vocab_size=64)


def test_deferred_row_is_reused_from_the_next_apply() -> None:
    batch = make_batch()
    batch.apply(output([new("a", [1, 2]), new("b", [3])]))
    row_a = batch.row_of["a"]
    # a finishes while a step that samples for it still runs: its row is not given to c.
    batch.apply(output([new("c", [4, 5, 6])], finished=["a"]), defer_free=True)
    assert batch.row_of["c"] != row_a
    assert batch.num_reusable_rows() == 1 and batch.released_rows == [row_a]
    # That step appends a's token to a's row, as it would have done.
    batch.append_tokens(np.array([row_a]), np.array([9]))
    assert batch.token_ids[row_a, :3].tolist() == [1, 2, 9]
    batch.apply(output([new("d", [7])]))
    assert batch.row_of["d"] == row_a and batch.released_rows == []
    assert batch.token_ids[row_a, 0] == 7 and batch.num_tokens[row_a] == 1


def test_row_freed_in_turn_is_reused_at_once() -> None:
    batch = make_batch()
    batch.apply(output([new("a", [1]), new("b", [2]), new("c", [3])]))
    row_a = batch.row_of["a"]
    batch.apply(output([new("d", [4])], finished=["a"]))
    assert batch.row_of["d"] == row_a and batch.num_reusable_rows() == 0


def new_with(req_id: str, tokens: list[int], **params) -> NewRequestData:
    request = new(req_id, tokens)
    request.sampling_params = SamplingParams(**params)
    return request


def test_a_steps_sampling_metadata_is_the_last_ones_only_while_nothing_changed() -> None:
    batch = make_batch()
    batch.apply(output([new_with("a", [1, 2], temperature=0.5), new("b", [3])]))
    rows = np.array([batch.row_of["a"], batch.row_of["b"]])
    first = batch.sampling.metadata(rows)
    assert first.temperature.tolist() == [0.5, 0.0]
    assert batch.sampling.metadata(rows) is first  # the same rows, no settings written since
    assert batch.sampling.metadata(rows[:1]) is not first  # other rows
    # b finishes and c takes its row with other settings: that row's column is rewritten.
    batch.apply(output([new_with("c", [4], temperature=0.9, top_k=5)], finished=["b"]))
    assert batch.row_of["c"] == rows[1]
    fresh = batch.sampling.metadata(rows)
    assert fresh is not first
    assert fresh.temperature.tolist() == [0.5, 0.8999999761581421]
    assert fresh.top_k is not None and fresh.top_k.tolist() == [0, 5]
    # A penalty depends on the tokens so far: computed every step.
    batch.apply(output([new_with("d", [5], repetition_penalty=1.3)]))
    with_penalty = np.array([batch.row_of["a"], batch.row_of["d"]])
    assert batch.sampling.metadata(with_penalty) is not batch.sampling.metadata(with_penalty)
