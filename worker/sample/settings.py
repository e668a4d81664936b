"""Temperature, top-k, top-p and min-p (the distribution a row samples from) and seeds (the
stream it draws from). Read by SamplingStates for every step's SamplingMetadata."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from tokenmill.protocol.scheduler_output import NewRequestData
from tokenmill.worker.sample.base import RowDict, SamplingState, StepRows

if TYPE_CHECKING:
    from tokenmill.worker.input_batch import RequestState


class Settings(SamplingState):
    """Every row's temperature (0: greedy), top-k (0: off; a float, exact below 2^24), top-p
    (1: off) and min-p (0: off), on the device."""

    columns = {"temperature": 0.0, "top_k": 0.0, "top_p": 1.0, "min_p": 0.0}

    def add(self, row: int, new: NewRequestData, request: RequestState) -> None:
        params = new.sampling_params
        columns = self.device_columns
        columns.host_row("temperature")[row] = 0.0 if params.greedy else params.temperature
        columns.host_row("top_k")[row] = params.top_k
        columns.host_row("top_p")[row] = params.top_p
        columns.host_row("min_p")[row] = params.min_p

    def remove(self, row: int) -> None:
        pass  # (a row's columns are written again when the next request takes it)

    @property
    def active(self) -> bool:
        return True

    def fields(self, step: StepRows) -> dict[str, Any]:
        """SamplingMetadata's fields for these rows (None where no row uses a filter)."""
        temperature = step.host("temperature")
        top_k, top_p, min_p = step.host("top_k"), step.host("top_p"), step.host("min_p")
        return {
            "temperature": step.column("temperature"),
            "all_greedy": bool((temperature == 0).all()),
            "top_k": step.column("top_k").long() if (top_k > 0).any() else None,
            "top_p": step.column("top_p") if (top_p < 1).any() else None,
            "min_p": step.column("min_p") if (min_p > 0).any() else None,
        }


class Seeds(RowDict):
    """The rows of seeded sampled requests -> the request's own generator (which lives with
    the request: a resumed request goes on drawing where it stopped)."""

    def add(self, row: int, new: NewRequestData, request: RequestState) -> None:
        if request.generator is not None:
            self.by_row[row] = request.generator

    def generators(self, step: StepRows) -> dict[int, torch.Generator]:
        """Row of logits -> its generator, in row order (a request's draws in turn)."""
        if not self.by_row:
            return {}
        at = step.positions_in(self.by_row)
        return {int(i): self.by_row[int(step.rows[i])] for i in at}
