"""The engine core's view of one request: its tokens, progress and status.

Built by EngineCore from an `EngineCoreRequest`; owned and mutated by the Scheduler (which
appends sampled tokens and decides when it stops); read by the KV cache manager.
"""

from __future__ import annotations

import enum
import time
from typing import Any

from tokenmill.protocol.messages import (
    EngineCoreRequest,
    FinishReason,
    LogprobsArrays,
    PoolingParams,
    SamplingParams,
)


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


# A pooling request's stop rules: its step limit as one token's (it never samples one).
_POOLING_STOPS = SamplingParams(max_tokens=1, ignore_eos=True)


class Request:
    def __init__(self, request: EngineCoreRequest, max_model_len: int) -> None:
        self.request_id = request.request_id
        # Exactly one is set: a pooling request runs its prompt only, and ends with the step
        # of its last chunk (it has no tokens to sample, no stop rules).
        self.sampling_params: SamplingParams | None = request.sampling_params
        self.pooling_params: PoolingParams | None = request.pooling_params
        # The LoRA adapter it runs (None: the base model); lora_id 0 for none.
        self.lora_request = request.lora_request
        self.lora_id = 0 if request.lora_request is None else request.lora_request.lora_int_id
        self.eos_token_ids = frozenset(request.eos_token_ids)
        self.arrival_time = request.arrival_time
        self.priority = request.priority
        self.prompt_token_ids = request.prompt_token_ids
        self.num_prompt_tokens = len(request.prompt_token_ids)
        # A resumed request starts with the outputs it produced elsewhere.
        self.output_token_ids: list[int] = list(request.resumed_token_ids)
        self.all_token_ids = request.prompt_token_ids + self.output_token_ids
        # Tokens whose K/V are in the cache (or scheduled to be written this step).
        self.num_computed_tokens = 0
        # Tokens that scheduled steps will sample but that have not arrived yet (at most one
        # per step in flight): counted as computed, and as the input of the next step, which
        # the workers take from their own record of what they sampled.
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.added_time = time.monotonic()
        self.queue_time: float | None = None  # seconds from added to first scheduled
        # Prefix-cache keys of its full blocks, extended as tokens are appended, and how many
        # of its blocks are registered in the cache.
        self.block_hashes: list[bytes] = []
        self.num_cached_blocks = 0
        # Mixed into its first block's key: requests whose K/V are computed otherwise for
        # the same tokens never share blocks (set by the engine; see EngineCore.add_request).
        self.cache_salt = b""
        room = max_model_len - self.num_prompt_tokens
        params = self.sampling_params or _POOLING_STOPS
        max_tokens = params.max_tokens
        self.max_tokens = room if max_tokens is None else min(max_tokens, room)
        # Stop rules, precomputed for the per-token check: the sampler bans these ids until
        # min_tokens are out; the request ends at max_tokens or max_model_len, whichever is first.
        self.min_tokens = params.min_tokens
        self.stop_token_ids = frozenset(params.stop_token_ids or ())
        self.eos_stops = not params.ignore_eos
        self.max_num_tokens = self.num_prompt_tokens + max(self.max_tokens, 1)
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # Prompt logprobs arrive chunk by chunk and leave with the first output token.
        self.prompt_logprob_parts: list[LogprobsArrays] = []
        self.prompt_logprobs_sent = False
        # Structured outputs: the xgrammar matcher, advanced on every accepted token.
        self.grammar: Any = None
        # Speculative decoding: the tokens proposed for its next step (from the workers).
        self.spec_token_ids: list[int] = []

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether it still owes its prompt logprobs (computed over its whole prompt)."""
        params = self.sampling_params
        return params is not None and params.prompt_logprobs is not None and (
            not self.prompt_logprobs_sent
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
