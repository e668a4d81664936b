"""The model runner's persistent batch: one row per request the workers know about.

Rows hold each request's tokens, block table and sampling settings in numpy arrays, so a
step only gathers from them. `apply(scheduler_output)` keeps the rows in step with the
scheduler's diff: finished and preempted requests leave, new ones take a free row, known
ones get their new block ids and progress. The runner appends each sampled token itself.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from tokenmill.protocol.messages import SamplingParams
from tokenmill.protocol.scheduler_output import NewRequestData, SchedulerOutput
from tokenmill.protocol.utils import cdiv
from tokenmill.worker.sampler import SamplingMetadata


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
        self.vocab_size = vocab_size
        self.device = device
        max_blocks = cdiv(max_model_len, block_size)
        # One spare column: a request at max_model_len still appends its last sampled token.
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.stop_ids_until_min: dict[int, list[int]] = {}
        self.generators: dict[int, torch.Generator] = {}
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))

    def apply(self, out: SchedulerOutput) -> None:
        for req_id in itertools.chain(out.finished_req_ids, out.preempted_req_ids):
            row = self.row_of.pop(req_id, None)
            if row is not None:
                self.generators.pop(row, None)
                self.stop_ids_until_min.pop(row, None)
                self.free_rows.append(row)
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

    def _add(self, new: NewRequestData) -> None:
        if new.req_id in self.row_of:
            raise ValueError(f"request {new.req_id!r} is already in the batch")
        row = self.free_rows.pop()
        self.row_of[new.req_id] = row
        tokens = new.prompt_token_ids + new.output_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = len(new.prompt_token_ids)
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.block_table[row] = 0
        self.block_table[row, : len(new.block_ids)] = new.block_ids
        self.num_blocks[row] = len(new.block_ids)
        params: SamplingParams = new.sampling_params
        self.temperature[row] = 0.0 if params.greedy else params.temperature
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.min_tokens[row] = params.min_tokens
        if params.min_tokens > 0:
            stop_ids = list(params.stop_token_ids or [])
            if not params.ignore_eos:
                stop_ids += new.eos_token_ids
            if stop_ids:
                self.stop_ids_until_min[row] = stop_ids
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(self.device).manual_seed(params.seed)
            # A preempted request comes back with outputs: replay the draws the sampler made
            # for them (one vocabulary-sized draw per token) so it continues where it was.
            for _ in new.output_token_ids:
                torch.empty(self.vocab_size, device=self.device).exponential_(generator=generator)
            self.generators[row] = generator

    def append_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1

    def sampling_metadata(self, rows: np.ndarray, device: torch.device) -> SamplingMetadata:
        temperature = self.temperature[rows]
        top_k, top_p, min_p = self.top_k[rows], self.top_p[rows], self.min_p[rows]
        # Per-row Python work only for the rows that need it (usually none).
        banned, generators = {}, {}
        if self.stop_ids_until_min or self.generators:
            for i, row in enumerate(rows.tolist()):
                stop_ids = self.stop_ids_until_min.get(row)
                num_output = self.num_tokens[row] - self.num_prompt_tokens[row]
                if stop_ids is not None and num_output < self.min_tokens[row]:
                    banned[i] = stop_ids
                if row in self.generators:
                    generators[i] = self.generators[row]
        return SamplingMetadata(
            temperature=torch.from_numpy(temperature).to(device),
            all_greedy=bool((temperature == 0).all()),
            top_k=torch.from_numpy(top_k).to(device) if (top_k > 0).any() else None,
            top_p=torch.from_numpy(top_p).to(device) if (top_p < 1).any() else None,
            min_p=torch.from_numpy(min_p).to(device) if (min_p > 0).any() else None,
            generators=generators,
            banned_token_ids=banned,
        )
