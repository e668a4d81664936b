"""The model runner's persistent batch: one row per request scheduled in the workers.

What belongs to a request lives in its `RequestState`, kept by request id from its first
step until it finishes or is aborted, through any number of preemptions: its sampling
parameters and its own random generator, which a resumed request goes on drawing from where
it stopped. Rows hold what a step reads, in numpy arrays, so that a step only gathers from
them: tokens, block table, sampling settings. `apply(scheduler_output)` keeps the rows in step
with the scheduler's diff: finished requests leave with their state, preempted ones leave
their row only, new and resumed ones take a free row, known ones get their new block ids and
progress. The runner appends each sampled token itself. Every sampling feature keeps its
per-row state in `sampling` (worker/sample/: one class per feature), told when a request takes
or leaves a row and when tokens are appended. With async scheduling the next step's apply()
runs while a step still samples: a row that step may write is not given to another request
until the apply() after.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill.protocol.lora import LoRARequest
from tokenmill.protocol.messages import PoolingParams, SamplingParams
from tokenmill.protocol.scheduler_output import NewRequestData, SchedulerOutput
from tokenmill.protocol.utils import cdiv
from tokenmill.worker.sample import SamplingStates, TokenRecord


@dataclass(eq=False)
class RequestState:
    """A request as the workers know it, whether it holds a row or is preempted."""

    req_id: str
    sampling_params: SamplingParams | None  # None: a pooling request
    # A seeded sampled request's own stream of draws (None: the sampler's shared one).
    generator: torch.Generator | None
    # A draft model's K/V for this request: written for its first `draft_computed` tokens,
    # then for these proposed tokens (kept where they were accepted). Reset on preemption,
    # which frees the blocks.
    draft_computed: int = 0
    draft_pending: list[int] = field(default_factory=list)
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        vocab_size: int,
        device: torch.device = torch.device("cpu"),
    ) -> None:
        """device: where the sampler draws (seeded requests' generators live there)."""
        self.device = device
        max_blocks = cdiv(max_model_len, block_size)
        # One spare column: a request at max_model_len still appends its last sampled token.
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        tokens = TokenRecord(self.token_ids, self.num_tokens, self.num_prompt_tokens)
        self.sampling = SamplingStates(max_num_reqs, vocab_size, tokens, device)
        self.row_of: dict[str, int] = {}
        self.req_ids: list[str | None] = [None] * max_num_reqs  # row -> its request
        # Every request from its first step until it finishes or is aborted, preempted or not.
        self.requests: dict[str, RequestState] = {}
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))
        # Rows freed while a step that may still write them was running (async scheduling):
        # free from the next apply() on, when that step has read and written its rows.
        self.released_rows: list[int] = []

    def apply(self, out: SchedulerOutput, defer_free: bool = False) -> None:
        """defer_free: a step still running may write the rows this frees (async scheduling),
        so they are reused from the next apply() on."""
        self.free_rows += self.released_rows
        self.released_rows.clear()
        freed = self.released_rows if defer_free else self.free_rows
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        for req_id in itertools.chain(out.finished_req_ids, out.preempted_req_ids):
            row = self.row_of.pop(req_id, None)
            if row is not None:
                self.sampling.remove(row)
                freed.append(row)
        for new in out.scheduled_new_reqs:
            self._add(new)
        cached = out.scheduled_cached_reqs
        for req_id, block_ids, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            row = self.row_of[req_id]
            if block_ids:
                start = self.num_blocks[row]
                self.block_table[row, start : start + len(block_ids)] = block_ids
                self.num_blocks[row] = start + len(block_ids)
            self.num_computed_tokens[row] = computed

    def num_reusable_rows(self) -> int:
        """Rows the next apply() may give to new requests, whether or not it defers."""
        return len(self.free_rows) + len(self.released_rows)

    def _add(self, new: NewRequestData) -> None:
        if new.req_id in self.row_of:
            raise ValueError(f"request {new.req_id!r} is already in the batch")
        params = new.sampling_params
        state = self.requests.get(new.req_id)
        if state is None:  # its first step (otherwise it resumes after a preemption)
            generator = None
            if params is not None and params.seed is not None and not params.greedy:
                generator = torch.Generator(self.device).manual_seed(params.seed)
            state = self.requests[new.req_id] = RequestState(
                new.req_id,
                params,
                generator,
                pooling_params=new.pooling_params,
                lora_request=new.lora_request,
            )
        else:
            state.draft_computed, state.draft_pending = 0, []
        row = self.free_rows.pop()
        self.row_of[new.req_id] = row
        self.req_ids[row] = new.req_id
        tokens = new.prompt_token_ids + new.output_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = len(new.prompt_token_ids)
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.block_table[row] = 0
        self.block_table[row, : len(new.block_ids)] = new.block_ids
        self.num_blocks[row] = len(new.block_ids)
        if params is not None:  # (a pooling request samples nothing)
            self.sampling.add(row, new, state)

    def append_token_lists(self, rows: np.ndarray, token_lists: list[list[int]]) -> None:
        """Appends each row's tokens (one or more), in order."""
        if all(len(t) == 1 for t in token_lists):
            self.append_tokens(rows, np.array([t[0] for t in token_lists], dtype=np.int64))
            return
        for depth in range(max(len(t) for t in token_lists)):
            have = [i for i, t in enumerate(token_lists) if len(t) > depth]
            tokens = np.array([token_lists[i][depth] for i in have], dtype=np.int64)
            self.append_tokens(rows[have], tokens)

    def append_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1
        self.sampling.on_tokens(rows, token_ids)
