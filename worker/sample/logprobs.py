"""Which rows want logprobs of their sampled tokens, or of their prompt, and how many top
tokens. Read by the model runner's logprobs stage (not an adjustment of the logits)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from tokenmill.protocol.scheduler_output import NewRequestData
from tokenmill.worker.sample.base import SamplingState

if TYPE_CHECKING:
    from tokenmill.worker.input_batch import RequestState


class Logprobs(SamplingState):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sampled: dict[int, int] = {}  # row -> top k asked for (the vocabulary for -1)
        self.prompt: dict[int, int] = {}  # row -> the same, for its prompt, until it is done

    def add(self, row: int, new: NewRequestData, request: RequestState) -> None:
        params = new.sampling_params
        if params.logprobs is not None:
            self.sampled[row] = self.vocab_size if params.logprobs == -1 else params.logprobs
        if params.prompt_logprobs is not None and not new.output_token_ids:
            # (A request resumed after its first token has sent its prompt logprobs.)
            k = params.prompt_logprobs
            self.prompt[row] = self.vocab_size if k == -1 else k

    def remove(self, row: int) -> None:
        self.sampled.pop(row, None)
        self.prompt.pop(row, None)

    @property
    def active(self) -> bool:
        return bool(self.sampled or self.prompt)

    def wanted(self, rows: np.ndarray) -> tuple[list[int], int]:
        """The positions in `rows` that want logprobs, and the most top tokens any asks for."""
        if not self.sampled:
            return [], 0
        wants = [i for i, r in enumerate(rows.tolist()) if r in self.sampled]
        return wants, max((self.sampled[int(rows[i])] for i in wants), default=0)
