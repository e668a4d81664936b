"""Trace replay (SamplingParams.trace_decode_token_ids, vLLM's): a request's k-th output
token is the trace's k-th, whatever the logits say. Applied last to the logits, so every
sampler path (greedy, sampled, rejection sampling of proposals) emits it, while logprobs,
taken from the logits before any adjustment, stay the model's own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenmill.protocol.scheduler_output import NewRequestData
from tokenmill.worker.sample.base import RowDict, StepRows
from tokenmill.worker.staging import to_device

if TYPE_CHECKING:
    from tokenmill.worker.input_batch import RequestState


@dataclass
class Forced:
    rows: torch.Tensor  # [F] rows of logits
    token_ids: torch.Tensor  # [F] the token each must emit

    def apply(self, logits: torch.Tensor) -> None:
        logits[self.rows] = float("-inf")
        logits[self.rows, self.token_ids] = 0.0


class TraceReplay(RowDict):
    reads_tokens = True  # which trace token is due depends on the output so far

    def add(self, row: int, new: NewRequestData, request: RequestState) -> None:
        trace = new.sampling_params.trace_decode_token_ids
        if trace:
            self.by_row[row] = trace

    def gather(self, step: StepRows) -> Forced | None:
        rows, tokens = [], []
        for i in step.positions_in(self.by_row).tolist():
            trace = self.by_row[int(step.rows[i])]
            done = len(step.output(i))
            if done < len(trace):
                rows.append(i)
                tokens.append(trace[done])
        if not rows:
            return None
        return Forced(to_device(rows, self.device), to_device(tokens, self.device))
