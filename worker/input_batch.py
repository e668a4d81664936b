"""The model runner's persistent batch: one row per request scheduled in the workers.

What belongs to a request lives in its `RequestState`, kept by request id from its first
step until it finishes or is aborted, through any number of preemptions: its sampling
parameters and its own random generator, which a resumed request goes on drawing from where
it stopped. Rows hold what a step reads, in numpy arrays, so that a step only gathers from
them: tokens, block table, sampling settings. `apply(scheduler_output)` keeps the rows in step
with the scheduler's diff: finished requests leave with their state, preempted ones leave
their row only, new and resumed ones take a free row, known ones get their new block ids and
progress. The runner appends each sampled token itself. The rows' sampling settings are
also kept on the device (`settings`), written when a request takes its row: a step gathers
its rows' columns there instead of copying its settings. With async scheduling the next step's
apply() runs while a step still samples: a row that step may write is not given to another
request until the apply() after.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill.protocol.messages import SamplingParams
from tokenmill.protocol.scheduler_output import NewRequestData, SchedulerOutput
from tokenmill.protocol.utils import cdiv
from tokenmill.worker.sampler import Penalties, SamplingMetadata
from tokenmill.worker.staging import to_device


@dataclass(eq=False)
class RequestState:
    """A request as the workers know it, whether it holds a row or is preempted."""

    req_id: str
    sampling_params: SamplingParams
    # A seeded sampled request's own stream of draws (None: the sampler's shared one).
    generator: torch.Generator | None
    # A draft model's K/V for this request: written for its first `draft_computed` tokens,
    # then for these proposed tokens (kept where they were accepted). Reset on preemption,
    # which frees the blocks.
    draft_computed: int = 0
    draft_pending: list[int] = field(default_factory=list)


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
        # Penalties: per-row settings, and token statistics kept up to date on the device
        # (allocated when the first request with a penalty arrives).
        self.presence = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition = np.ones(max_num_reqs, dtype=np.float32)
        self.penalty_rows: set[int] = set()
        # The settings above on the device, one column per row (rows: _SETTINGS), and the
        # rows whose column the next step must write first.
        self.settings = torch.zeros((len(_SETTINGS), max_num_reqs), device=device)
        self.stale_settings: list[int] = []
        # Bumped whenever columns are written: a step with the rows of the one before and no
        # writes since takes that step's sampling metadata again (when nothing in it depends
        # on the tokens so far: see sampling_metadata).
        self.settings_epoch = 0
        self._last_metadata: tuple[tuple[bytes, int], SamplingMetadata] | None = None
        self.output_counts: torch.Tensor | None = None  # [rows, V] int32
        self.prompt_mask: torch.Tensor | None = None  # [rows, V] bool
        self.allowed_masks: dict[int, torch.Tensor] = {}  # row -> [V] bool, True where allowed
        self.logit_bias: dict[int, tuple[list[int], list[float]]] = {}
        self.bad_words: dict[int, list[list[int]]] = {}
        # row -> top-k asked for (the vocabulary size for -1)
        self.num_logprobs: dict[int, int] = {}
        self.num_prompt_logprobs: dict[int, int] = {}
        self.row_of: dict[str, int] = {}
        self.req_ids: list[str | None] = [None] * max_num_reqs  # row -> its request
        # Every request from its first step until it finishes or is aborted, preempted or not.
        self.requests: dict[str, RequestState] = {}
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))
        # Rows freed while a step that may still write them was running (async scheduling):
        # free from the next apply() on, when that step has read and written its rows.
        self.released_rows: list[int] = []

    def apply(self, out: SchedulerOutput, defer_free: bool = False) -> None:
        """defer_free: a step still running may write the rows this frees (async scheduling),
        so they are reused from the next apply() on."""
        self.free_rows += self.released_rows
        self.released_rows.clear()
        freed = self.released_rows if defer_free else self.free_rows
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        for req_id in itertools.chain(out.finished_req_ids, out.preempted_req_ids):
            row = self.row_of.pop(req_id, None)
            if row is not None:
                for per_row in (
                    self.generators,
                    self.stop_ids_until_min,
                    self.allowed_masks,
                    self.logit_bias,
                    self.bad_words,
                    self.num_logprobs,
                    self.num_prompt_logprobs,
                ):
                    per_row.pop(row, None)
                self.penalty_rows.discard(row)
                freed.append(row)
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

    def num_reusable_rows(self) -> int:
        """Rows the next apply() may give to new requests, whether or not it defers."""
        return len(self.free_rows) + len(self.released_rows)

    def _add(self, new: NewRequestData) -> None:
        if new.req_id in self.row_of:
            raise ValueError(f"request {new.req_id!r} is already in the batch")
        params: SamplingParams = new.sampling_params
        state = self.requests.get(new.req_id)
        if state is None:  # its first step (otherwise it resumes after a preemption)
            generator = None
            if params.seed is not None and not params.greedy:
                generator = torch.Generator(self.device).manual_seed(params.seed)
            state = self.requests[new.req_id] = RequestState(new.req_id, params, generator)
        else:
            state.draft_computed, state.draft_pending = 0, []
        row = self.free_rows.pop()
        self.row_of[new.req_id] = row
        self.req_ids[row] = new.req_id
        tokens = new.prompt_token_ids + new.output_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = len(new.prompt_token_ids)
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.block_table[row] = 0
        self.block_table[row, : len(new.block_ids)] = new.block_ids
        self.num_blocks[row] = len(new.block_ids)
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
        if params.has_penalties:
            self._track_tokens(row, new.prompt_token_ids, new.output_token_ids)
            self.presence[row] = params.presence_penalty
            self.frequency[row] = params.frequency_penalty
            self.repetition[row] = params.repetition_penalty
        if params.allowed_token_ids:
            mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            mask[params.allowed_token_ids] = True
            self.allowed_masks[row] = mask
        if params.logit_bias:
            self.logit_bias[row] = (list(params.logit_bias), list(params.logit_bias.values()))
        if params.bad_words_token_ids:
            self.bad_words[row] = params.bad_words_token_ids
        if params.logprobs is not None:
            self.num_logprobs[row] = self.vocab_size if params.logprobs == -1 else params.logprobs
        if params.prompt_logprobs is not None and not new.output_token_ids:
            # (A request resumed after its first token has sent its prompt logprobs.)
            k = params.prompt_logprobs
            self.num_prompt_logprobs[row] = self.vocab_size if k == -1 else k
        if state.generator is not None:
            self.generators[row] = state.generator
        self.stale_settings.append(row)  # (after its settings: another thread may flush it)

    def _track_tokens(self, row: int, prompt: list[int], outputs: list[int]) -> None:
        if self.output_counts is None:
            shape = (len(self.num_tokens), self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        assert self.prompt_mask is not None
        self.prompt_mask[row] = False
        self.prompt_mask[row, prompt] = True
        self.output_counts[row] = 0
        if outputs:  # a preempted request resumes with the tokens it had produced
            ids = to_device(outputs, self.device)
            self.output_counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        self.penalty_rows.add(row)

    def append_token_lists(self, rows: np.ndarray, token_lists: list[list[int]]) -> None:
        """Appends each row's tokens (one or more), in order."""
        if all(len(t) == 1 for t in token_lists):
            self.append_tokens(rows, np.array([t[0] for t in token_lists], dtype=np.int64))
            return
        for depth in range(max(len(t) for t in token_lists)):
            have = [i for i, t in enumerate(token_lists) if len(t) > depth]
            tokens = np.array([token_lists[i][depth] for i in have], dtype=np.int64)
            self.append_tokens(rows[have], tokens)

    def append_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1
        if self.penalty_rows:
            counted = np.isin(rows, list(self.penalty_rows))
            if counted.any():
                assert self.output_counts is not None
                index = (
                    to_device(rows[counted], self.device),
                    to_device(token_ids[counted].astype(np.int64), self.device),
                )
                one = torch.ones(1, dtype=torch.int32, device=self.device)
                self.output_counts.index_put_(index, one.expand(len(index[0])), accumulate=True)

    def _write_settings(self) -> None:
        """The device columns of the rows that took a request since the last step: their
        settings and their row numbers packed into one copy."""
        stale, self.stale_settings = self.stale_settings, []
        if not stale:
            return
        self.settings_epoch += 1
        rows = np.unique(stale)
        packed = np.stack(
            [rows.astype(np.float32)]
            + [getattr(self, name)[rows].astype(np.float32) for name in _SETTINGS]
        )
        packed_t = to_device(packed, self.device)
        self.settings[:, packed_t[0].long()] = packed_t[1:]

    def sampling_metadata(
        self,
        rows: np.ndarray,
        rows_t: torch.Tensor | None = None,
        ranks: np.ndarray | None = None,
    ) -> SamplingMetadata:
        """rows_t: `rows` on the device, if the step copied them already. ranks: per row of
        logits that verifies a proposal, how many proposed tokens come before its position
        (written after the row's tokens, in token_ids): min_tokens, bad words and penalties
        see them as output (None: none)."""
        self._write_settings()
        # The last step's metadata where nothing in it depends on the tokens so far (banned
        # stop tokens before min_tokens, bad words, penalties, proposed tokens): the same rows
        # with the same settings give the same metadata (a decode step's usual case, ~0.1 ms
        # of torch ops saved at one request).
        reusable = ranks is None and not (
            self.stop_ids_until_min or self.bad_words or self.penalty_rows
        )
        key = (rows.tobytes(), self.settings_epoch)
        if reusable and self._last_metadata is not None and self._last_metadata[0] == key:
            return self._last_metadata[1]
        metadata = self._sampling_metadata(rows, rows_t, ranks)
        self._last_metadata = (key, metadata) if reusable else None
        return metadata

    def _sampling_metadata(
        self, rows: np.ndarray, rows_t: torch.Tensor | None, ranks: np.ndarray | None
    ) -> SamplingMetadata:
        rows_t = to_device(rows, self.device) if rows_t is None else rows_t
        column = dict(zip(_SETTINGS, self.settings[:, rows_t]))
        temperature = self.temperature[rows]
        top_k, top_p, min_p = self.top_k[rows], self.top_p[rows], self.min_p[rows]
        # Per-row Python work only for the rows that need it (usually none).
        banned: dict[int, list[int]] = {}
        generators = {}
        if self.stop_ids_until_min or self.generators or self.bad_words:
            for i, row in enumerate(rows.tolist()):
                end = self.num_tokens[row] + (0 if ranks is None else ranks[i])
                stop_ids = self.stop_ids_until_min.get(row)
                num_output = end - self.num_prompt_tokens[row]
                if stop_ids is not None and num_output < self.min_tokens[row]:
                    banned[i] = list(stop_ids)
                if row in self.generators:
                    generators[i] = self.generators[row]
                if row in self.bad_words:
                    output = self.token_ids[row, self.num_prompt_tokens[row] : end]
                    for token in _bad_word_ends(self.bad_words[row], output):
                        banned.setdefault(i, []).append(token)
        return SamplingMetadata(
            temperature=column["temperature"],
            all_greedy=bool((temperature == 0).all()),
            top_k=column["top_k"].long() if (top_k > 0).any() else None,
            top_p=column["top_p"] if (top_p < 1).any() else None,
            min_p=column["min_p"] if (min_p > 0).any() else None,
            generators=generators,
            banned_token_ids=banned,
            allowed=self._allowed(rows),
            bias=self._bias(rows),
            penalties=self._penalties(rows, rows_t, column, ranks),
        )

    def _allowed(self, rows: np.ndarray):
        if not self.allowed_masks:
            return None
        at = _positions_in(rows, self.allowed_masks)
        if not len(at):
            return None
        masks = torch.stack([self.allowed_masks[r] for r in rows[at].tolist()])
        return to_device(at, self.device), masks

    def _bias(self, rows: np.ndarray):
        if not self.logit_bias:
            return None
        at = _positions_in(rows, self.logit_bias)
        if not len(at):
            return None
        entries = [(i, self.logit_bias[r]) for i, r in zip(at.tolist(), rows[at].tolist())]
        positions = [i for i, (ids, _) in entries for _ in ids]
        token_ids = [t for _, (ids, _) in entries for t in ids]
        values = [v for _, (_, vals) in entries for v in vals]
        return (
            to_device(positions, self.device),
            to_device(token_ids, self.device),
            to_device(values, self.device, torch.float32),
        )

    def _penalties(
        self, rows: np.ndarray, rows_t: torch.Tensor, column: dict, ranks: np.ndarray | None
    ) -> Penalties | None:
        if not self.penalty_rows:
            return None
        at = _positions_in(rows, self.penalty_rows)
        if not len(at):
            return None
        assert self.output_counts is not None and self.prompt_mask is not None
        at_t = to_device(at, self.device)
        index = rows_t[at_t]
        output_counts = self.output_counts[index]  # (a copy)
        if ranks is not None and ranks[at].any():
            # A position after proposed tokens counts them as output too.
            which, tokens = [], []
            for p, (row, rank) in enumerate(zip(rows[at].tolist(), ranks[at].tolist())):
                n = self.num_tokens[row]
                tokens += self.token_ids[row, n : n + rank].tolist()
                which += [p] * rank
            one = torch.ones(1, dtype=output_counts.dtype, device=self.device)
            where = (to_device(which, self.device), to_device(tokens, self.device))
            output_counts.index_put_(where, one.expand(len(which)), accumulate=True)
        return Penalties(
            rows=at_t,
            presence=column["presence"][at_t].unsqueeze(1),
            frequency=column["frequency"][at_t].unsqueeze(1),
            repetition=column["repetition"][at_t].unsqueeze(1),
            output_counts=output_counts,
            prompt_mask=self.prompt_mask[index],
        )


# The per-row settings kept on the device (InputBatch.settings; top_k as a float, exact
# below 2^24).
_SETTINGS = ("temperature", "top_k", "top_p", "min_p", "presence", "frequency", "repetition")


def _positions_in(rows: np.ndarray, wanted) -> np.ndarray:
    """Positions in `rows` of the rows in `wanted` (a set or dict of rows)."""
    return np.flatnonzero(np.isin(rows, list(wanted)))


def _bad_word_ends(sequences: list[list[int]], output: np.ndarray) -> list[int]:
    """The last token of every bad word whose other tokens the output has just produced."""
    ends = []
    for seq in sequences:
        prefix = seq[:-1]
        if len(prefix) <= len(output) and (
            not prefix or output[len(output) - len(prefix) :].tolist() == prefix
        ):
            ends.append(seq[-1])
    return ends
