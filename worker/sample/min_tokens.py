"""min_tokens: a request's stop tokens (its EOS unless ignore_eos, and stop_token_ids) may
not be sampled before it has produced that many tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.protocol.scheduler_output import NewRequestData
from tokenmill.worker.sample.base import Bans, RowDict, StepRows

if TYPE_CHECKING:
    from tokenmill.worker.input_batch import RequestState


class MinTokens(RowDict):
    reads_tokens = True

    def add(self, row: int, new: NewRequestData, request: RequestState) -> None:
        params = new.sampling_params
        if params.min_tokens <= 0:
            return
        stop_ids = list(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids += new.eos_token_ids
        if stop_ids:
            self.by_row[row] = (params.min_tokens, stop_ids)

    def gather(self, step: StepRows) -> Bans | None:
        banned: dict[int, list[int]] = {}
        for i in step.positions_in(self.by_row).tolist():
            min_tokens, stop_ids = self.by_row[int(step.rows[i])]
            if len(step.output(i)) < min_tokens:
                banned[i] = list(stop_ids)
        return Bans(banned) if banned else None
