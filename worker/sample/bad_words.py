"""bad_words: the last token of a bad word may not be sampled right after the word's other
tokens (vLLM's semantics; the frontend turns the words into token sequences)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tokenmill.protocol.scheduler_output import NewRequestData
from tokenmill.worker.sample.base import Bans, RowDict, StepRows

if TYPE_CHECKING:
    from tokenmill.worker.input_batch import RequestState


class BadWords(RowDict):
    reads_tokens = True

    def add(self, row: int, new: NewRequestData, request: RequestState) -> None:
        if new.sampling_params.bad_words_token_ids:
            self.by_row[row] = new.sampling_params.bad_words_token_ids

    def gather(self, step: StepRows) -> Bans | None:
        banned: dict[int, list[int]] = {}
        for i in step.positions_in(self.by_row).tolist():
            ends = bad_word_ends(self.by_row[int(step.rows[i])], step.output(i))
            if ends:
                banned[i] = ends
        return Bans(banned) if banned else None


def bad_word_ends(sequences: list[list[int]], output: np.ndarray) -> list[int]:
    """The last token of every bad word whose other tokens the output has just produced."""
    ends = []
    for seq in sequences:
        prefix = seq[:-1]
        if len(prefix) <= len(output) and (
            not prefix or output[len(output) - len(prefix) :].tolist() == prefix
        ):
            ends.append(seq[-1])
    return ends
