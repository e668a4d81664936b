"""allowed_token_ids (only they may be sampled) and logit_bias (added to the logits, clamped
to [-100, 100] by SamplingParams): per-row state that does not change while a request runs."""

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
class AllowedMask:
    rows: torch.Tensor  # [A] rows of logits
    mask: torch.Tensor  # [A, V] bool, True where allowed

    def apply(self, logits: torch.Tensor) -> None:
        logits[self.rows] = logits[self.rows].masked_fill(~self.mask, float("-inf"))


class AllowedTokens(RowDict):
    def add(self, row: int, new: NewRequestData, request: RequestState) -> None:
        allowed = new.sampling_params.allowed_token_ids
        if allowed:
            mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            mask[allowed] = True
            self.by_row[row] = mask

    def gather(self, step: StepRows) -> AllowedMask | None:
        at = step.positions_in(self.by_row)
        if not len(at):
            return None
        masks = torch.stack([self.by_row[r] for r in step.rows[at].tolist()])
        return AllowedMask(to_device(at, self.device), masks)


@dataclass
class Bias:
    rows: torch.Tensor  # [B] rows of logits, one per biased token
    token_ids: torch.Tensor  # [B]
    values: torch.Tensor  # [B] fp32

    def apply(self, logits: torch.Tensor) -> None:
        # Accumulated: two biases on one token add up.
        logits.index_put_((self.rows, self.token_ids), self.values, accumulate=True)


class LogitBias(RowDict):
    def add(self, row: int, new: NewRequestData, request: RequestState) -> None:
        bias = new.sampling_params.logit_bias
        if bias:
            self.by_row[row] = (list(bias), list(bias.values()))

    def gather(self, step: StepRows) -> Bias | None:
        at = step.positions_in(self.by_row)
        if not len(at):
            return None
        entries = [(i, self.by_row[r]) for i, r in zip(at.tolist(), step.rows[at].tolist())]
        return Bias(
            rows=to_device([i for i, (ids, _) in entries for _ in ids], self.device),
            token_ids=to_device([t for _, (ids, _) in entries for t in ids], self.device),
            values=to_device([v for _, (_, vals) in entries for v in vals], self.device,
                             torch.float32),
        )  # fmt: skip
