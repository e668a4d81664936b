"""Presence, frequency and repetition penalties (vLLM's semantics): per-row settings on the
device, and each row's token statistics kept up to date there as tokens are appended
(allocated when the first request with a penalty arrives)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tokenmill.protocol.scheduler_output import NewRequestData
from tokenmill.worker.sample.base import SamplingState, StepRows
from tokenmill.worker.staging import to_device

if TYPE_CHECKING:
    from tokenmill.worker.input_batch import RequestState


@dataclass
class Penalties:
    """The rows (of the sampled batch) with a penalty, and what they need."""

    rows: torch.Tensor  # [P]
    presence: torch.Tensor  # [P, 1] fp32
    frequency: torch.Tensor  # [P, 1]
    repetition: torch.Tensor  # [P, 1]
    output_counts: torch.Tensor  # [P, V] int32: how often each token was generated
    prompt_mask: torch.Tensor  # [P, V] bool: tokens in the prompt

    def apply(self, logits: torch.Tensor) -> None:
        x = logits[self.rows]
        seen = self.prompt_mask | (self.output_counts > 0)
        # Repetition: positive logits are divided by the penalty, negative ones multiplied.
        scaled = torch.where(x > 0, x / self.repetition, x * self.repetition)
        x = torch.where(seen, scaled, x)
        x -= self.frequency * self.output_counts + self.presence * (self.output_counts > 0)
        logits[self.rows] = x


class PenaltyState(SamplingState):
    columns = {"presence": 0.0, "frequency": 0.0, "repetition": 1.0}
    reads_tokens = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rows: set[int] = set()
        self.output_counts: torch.Tensor | None = None  # [rows, V] int32
        self.prompt_mask: torch.Tensor | None = None  # [rows, V] bool

    @property
    def active(self) -> bool:
        return bool(self.rows)

    def add(self, row: int, new: NewRequestData, request: RequestState) -> None:
        params = new.sampling_params
        if not params.has_penalties:
            return
        if self.output_counts is None:
            shape = (self.max_rows, self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        assert self.prompt_mask is not None
        self.prompt_mask[row] = False
        self.prompt_mask[row, new.prompt_token_ids] = True
        self.output_counts[row] = 0
        if new.output_token_ids:  # a preempted request resumes with the tokens it produced
            ids = to_device(new.output_token_ids, self.device)
            self.output_counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        self.rows.add(row)
        columns = self.device_columns
        columns.host_row("presence")[row] = params.presence_penalty
        columns.host_row("frequency")[row] = params.frequency_penalty
        columns.host_row("repetition")[row] = params.repetition_penalty

    def remove(self, row: int) -> None:
        self.rows.discard(row)

    def on_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        if not self.rows:
            return
        counted = np.isin(rows, list(self.rows))
        if counted.any():
            assert self.output_counts is not None
            index = (
                to_device(rows[counted], self.device),
                to_device(token_ids[counted].astype(np.int64), self.device),
            )
            one = torch.ones(1, dtype=torch.int32, device=self.device)
            self.output_counts.index_put_(index, one.expand(len(index[0])), accumulate=True)

    def gather(self, step: StepRows) -> Penalties | None:
        at = step.positions_in(self.rows)
        if not len(at):
            return None
        assert self.output_counts is not None and self.prompt_mask is not None
        at_t = to_device(at, self.device)
        index = step.rows_t[at_t]
        output_counts = self.output_counts[index]  # (a copy)
        ranks = step.ranks
        if ranks is not None and ranks[at].any():
            # A position after proposed tokens counts them as output too.
            which, tokens = [], []
            for p, (row, rank) in enumerate(zip(step.rows[at].tolist(), ranks[at].tolist())):
                n = step.tokens.num_tokens[row]
                tokens += step.tokens.token_ids[row, n : n + rank].tolist()
                which += [p] * rank
            one = torch.ones(1, dtype=output_counts.dtype, device=self.device)
            where = (to_device(which, self.device), to_device(tokens, self.device))
            output_counts.index_put_(where, one.expand(len(which)), accumulate=True)
        return Penalties(
            rows=at_t,
            presence=step.column("presence")[at_t].unsqueeze(1),
            frequency=step.column("frequency")[at_t].unsqueeze(1),
            repetition=step.column("repetition")[at_t].unsqueeze(1),
            output_counts=output_counts,
            prompt_mask=self.prompt_mask[index],
        )
