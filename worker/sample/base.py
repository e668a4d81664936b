"""What every sampling feature's state has in common, and what a step hands it.

A feature (penalties, bad words, min_tokens, ...) keeps its per-row state in a
`SamplingState` subclass: `add` when a request takes a row, `remove` when it leaves it,
`gather` once a step for the rows that sample, giving a `LogitsAdjustment` (or None where no
such row uses the feature) that the Sampler applies to the logits. Per-row float settings a
feature reads on the device are declared in `columns` and kept in one packed tensor
(`DeviceColumns`), written for the rows that changed in one copy per step.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
import torch

from tokenmill.protocol.scheduler_output import NewRequestData
from tokenmill.worker.staging import to_device

if TYPE_CHECKING:
    from tokenmill.worker.input_batch import RequestState


class LogitsAdjustment(Protocol):
    """A feature's change to one step's logits, in place on fp32 logits [R, V]."""

    def apply(self, logits: torch.Tensor) -> None: ...


@dataclass
class TokenRecord:
    """The batch's token record, shared with the states that read what was produced."""

    token_ids: np.ndarray  # [rows, max_model_len + 1]: prompt, then output tokens
    num_tokens: np.ndarray  # [rows]
    num_prompt_tokens: np.ndarray  # [rows]


class DeviceColumns:
    """Every feature's per-row float settings, one column per row in one device tensor
    [names, rows]; a step gathers its rows' columns there instead of copying settings."""

    def __init__(self, defaults: dict[str, float], max_rows: int, device: torch.device) -> None:
        self.names = tuple(defaults)
        self.index = {name: i for i, name in enumerate(self.names)}
        self.defaults = np.array(list(defaults.values()), dtype=np.float32)
        self.host = np.repeat(self.defaults[:, None], max_rows, axis=1)
        # (A copy of its own: on the CPU to_device would share the host's memory, which
        # apply() writes while a step may still read the device values.)
        self.device_values = torch.tensor(self.host, device=device)
        self.device = device
        self.stale: list[int] = []  # rows whose column the next step writes first
        # Bumped whenever columns are written: the same rows with no writes since have the
        # same settings.
        self.epoch = 0

    def host_row(self, name: str) -> np.ndarray:
        return self.host[self.index[name]]

    def reset(self, row: int) -> None:
        self.host[:, row] = self.defaults

    def mark(self, row: int) -> None:
        self.stale.append(row)  # (after the row's settings: another thread may flush it)

    def flush(self) -> None:
        """Writes the stale rows' columns, their row numbers packed in the same copy."""
        stale, self.stale = self.stale, []
        if not stale:
            return
        self.epoch += 1
        rows = np.unique(stale)
        packed = np.concatenate((rows[None].astype(np.float32), self.host[:, rows]))
        packed_t = to_device(packed, self.device)
        self.device_values[:, packed_t[0].long()] = packed_t[1:]


class StepRows:
    """The batch rows a step samples from, one per row of logits, as the states see them.
    ranks: per row that verifies a proposal, how many proposed tokens come before its
    position (written after the row's tokens in the record): they count as output."""

    def __init__(
        self,
        rows: np.ndarray,
        rows_t: torch.Tensor,
        ranks: np.ndarray | None,
        tokens: TokenRecord,
        columns: DeviceColumns,
    ) -> None:
        self.rows, self.rows_t, self.ranks, self.tokens = rows, rows_t, ranks, tokens
        self.device = rows_t.device
        self._columns = columns
        self._gathered: torch.Tensor | None = None

    def column(self, name: str) -> torch.Tensor:
        """A device setting for these rows (all columns gathered once)."""
        if self._gathered is None:
            self._gathered = self._columns.device_values[:, self.rows_t]
        return self._gathered[self._columns.index[name]]

    def host(self, name: str) -> np.ndarray:
        return self._columns.host_row(name)[self.rows]

    def positions_in(self, wanted: Collection[int]) -> np.ndarray:
        """Positions of the rows in `wanted` (a set or dict of rows)."""
        return np.flatnonzero(np.isin(self.rows, list(wanted)))

    def end(self, i: int) -> int:
        """Where the tokens before position i's prediction end in the record."""
        row = int(self.rows[i])
        return int(self.tokens.num_tokens[row]) + (0 if self.ranks is None else int(self.ranks[i]))

    def output(self, i: int) -> np.ndarray:
        """The output tokens before position i's prediction."""
        row = int(self.rows[i])
        return self.tokens.token_ids[row, self.tokens.num_prompt_tokens[row] : self.end(i)]


class SamplingState:
    """One sampling feature's per-row state. Subclasses set `columns` (per-row float
    settings kept on the device, with their defaults) and `reads_tokens` (whether a step's
    adjustment depends on the tokens produced so far: a step's metadata is then not reused)."""

    columns: ClassVar[dict[str, float]] = {}
    reads_tokens: ClassVar[bool] = False

    def __init__(
        self, max_rows: int, vocab_size: int, device: torch.device, columns: DeviceColumns
    ) -> None:
        self.max_rows, self.vocab_size, self.device = max_rows, vocab_size, device
        self.device_columns = columns

    def add(self, row: int, new: NewRequestData, request: RequestState) -> None:
        """A request takes `row` (new, or resumed after a preemption with its outputs)."""
        raise NotImplementedError

    def remove(self, row: int) -> None:
        """The request in `row` finished or was preempted."""
        raise NotImplementedError

    @property
    def active(self) -> bool:
        """Whether any row uses the feature."""
        raise NotImplementedError

    def gather(self, step: StepRows) -> LogitsAdjustment | None:
        """The step's adjustment for its rows; None where none of them uses the feature."""
        return None

    def on_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Tokens appended to rows (one each)."""


class RowDict(SamplingState):
    """A feature whose state is a value per row that uses it (most of them)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.by_row: dict[int, Any] = {}

    def remove(self, row: int) -> None:
        self.by_row.pop(row, None)

    @property
    def active(self) -> bool:
        return bool(self.by_row)


@dataclass
class Bans:
    """Tokens some rows may not sample now: row of logits -> token ids."""

    banned: dict[int, list[int]]

    def apply(self, logits: torch.Tensor) -> None:
        for row, token_ids in self.banned.items():
            logits[row, token_ids] = float("-inf")
