"""Every sampling feature's state for the persistent batch, and the step's SamplingMetadata
built from them. InputBatch owns one `SamplingStates`: it adds a request's row to every
feature, removes it, reports appended tokens; the model runner asks for a step's metadata.

A new feature is a SamplingState subclass in its own module, listed in ADJUSTERS in the
order the Sampler applies it (vLLM's: allowed tokens, bans, logit bias, penalties).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from tokenmill.protocol.scheduler_output import NewRequestData
from tokenmill.worker.sample.bad_words import BadWords
from tokenmill.worker.sample.base import DeviceColumns, SamplingState, StepRows, TokenRecord
from tokenmill.worker.sample.logit_bias import AllowedTokens, LogitBias
from tokenmill.worker.sample.logprobs import Logprobs
from tokenmill.worker.sample.min_tokens import MinTokens
from tokenmill.worker.sample.penalties import PenaltyState
from tokenmill.worker.sample.settings import Seeds, Settings
from tokenmill.worker.sample.trace import TraceReplay
from tokenmill.worker.sampler import SamplingMetadata
from tokenmill.worker.staging import to_device

if TYPE_CHECKING:
    from tokenmill.worker.input_batch import RequestState

S = TypeVar("S", bound=SamplingState)

# The features that adjust the logits, in the order they are applied. Trace replay comes
# last: it overrides whatever the others did to its rows.
ADJUSTERS: tuple[type[SamplingState], ...] = (
    AllowedTokens,
    MinTokens,
    BadWords,
    LogitBias,
    PenaltyState,
    TraceReplay,
)


class SamplingStates:
    def __init__(
        self, max_rows: int, vocab_size: int, tokens: TokenRecord, device: torch.device
    ) -> None:
        classes = (Settings, Seeds, Logprobs, *ADJUSTERS)
        defaults: dict[str, float] = {}
        for cls in classes:
            defaults.update(cls.columns)
        self.columns = DeviceColumns(defaults, max_rows, device)
        self.tokens = tokens
        self.device = device

        def make(cls: type[S]) -> S:
            return cls(max_rows, vocab_size, device, self.columns)

        self.settings: Settings = make(Settings)
        self.seeds: Seeds = make(Seeds)
        self.logprobs: Logprobs = make(Logprobs)
        self.adjusters: list[SamplingState] = [make(cls) for cls in ADJUSTERS]
        self.features = [self.settings, self.seeds, self.logprobs, *self.adjusters]
        self._token_readers = [s for s in self.adjusters if s.reads_tokens]
        self._last: tuple[tuple[bytes, int], SamplingMetadata] | None = None

    def add(self, row: int, new: NewRequestData, request: RequestState) -> None:
        self.columns.reset(row)
        for feature in self.features:
            feature.add(row, new, request)
        self.columns.mark(row)

    def remove(self, row: int) -> None:
        for feature in self.features:
            feature.remove(row)

    def on_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        for feature in self.adjusters:
            feature.on_tokens(rows, token_ids)

    def metadata(
        self,
        rows: np.ndarray,
        rows_t: torch.Tensor | None = None,
        ranks: np.ndarray | None = None,
    ) -> SamplingMetadata:
        """rows: the batch row of every row of logits; rows_t: them on the device, if the
        step copied them already. ranks: per row of logits that verifies a proposal, how many
        proposed tokens come before its position (None: none)."""
        self.columns.flush()
        # The last step's metadata where nothing in it depends on the tokens so far (banned
        # stop tokens before min_tokens, bad words, penalties, proposed tokens): the same rows
        # with the same settings give the same metadata (a decode step's usual case, ~0.1 ms
        # of torch ops saved at one request).
        reusable = ranks is None and not any(s.active for s in self._token_readers)
        key = (rows.tobytes(), self.columns.epoch)
        if reusable and self._last is not None and self._last[0] == key:
            return self._last[1]
        rows_t = to_device(rows, self.device) if rows_t is None else rows_t
        step = StepRows(rows, rows_t, ranks, self.tokens, self.columns)
        adjustments = [
            part
            for feature in self.adjusters
            if feature.active and (part := feature.gather(step)) is not None
        ]
        metadata = SamplingMetadata(
            **self.settings.fields(step),
            generators=self.seeds.generators(step),
            adjustments=adjustments,
        )
        self._last = (key, metadata) if reusable else None
        return metadata
