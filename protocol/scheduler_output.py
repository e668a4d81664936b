"""What EngineCore sends its workers each step, and what rank 0 sends back.

`SchedulerOutput` is a diff: full data only for requests the workers have not seen, then
new block ids and token counts for the rest; the model runner keeps its persistent batch in
step with it. `ModelRunnerOutput` carries the sampled tokens (a pooling model's vectors).
`KVCacheSpec` is what each worker reports about its attention layers so that the core can
size the KV cache.
These cross the core/worker boundary, so they live in protocol/ (worker/ may not import core/).
"""

from __future__ import annotations

import msgspec
import numpy as np

from tokenmill.protocol.lora import LoRARequest
from tokenmill.protocol.messages import LogprobsArrays, PoolingParams, SamplingParams


class NewRequestData(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None  # None: a pooling request (pooling_params)
    eos_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    # Tokens already produced: a preempted request comes back as new, with its outputs so far.
    output_token_ids: list[int] = []
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs


class CachedRequestData(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    """Requests the workers already hold, as parallel lists."""

    req_ids: list[str] = []
    new_block_ids: list[list[int]] = []
    num_computed_tokens: list[int] = []


class SchedulerOutput(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that ended (finished or aborted) since the last step: workers drop their state.
    finished_req_ids: list[str] = []
    # Requests preempted since the last step: workers free their rows but keep their state
    # (its random generator, above all); each comes back later as a new request carrying the
    # tokens it had produced, and goes on from that state.
    preempted_req_ids: list[str] = []
    # Structured outputs: the requests whose token this step is constrained, and their rows
    # of allowed tokens (xgrammar's packed bitmask: [n, ceil(V / 32)] int32, bit j of word w
    # allows token 32 * w + j). A request verifying a proposal is listed once per position
    # it scores (1 + len(proposal) rows, in order).
    grammar_req_ids: list[str] = []
    grammar_bitmask: np.ndarray | None = None
    # Speculative decoding: the proposed tokens each request verifies this step (it is
    # scheduled for 1 + len(proposal) tokens: its last sampled token, then the proposal).
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}
    # Whether the workers propose tokens after this step's sampling, for the next step to
    # verify (the scheduler's choice: speculation is off where it does not pay).
    propose: bool = False
    # The scheduled requests that sample nothing this step (a prompt chunk short of the
    # prompt's end): every other one samples. The scheduler decides it once; the workers and
    # the structured outputs read it here.
    partial_req_ids: list[str] = []


class ModelRunnerOutput(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    req_ids: list[str]
    # One list per request in req_ids: empty while a prompt is still being prefilled.
    sampled_token_ids: list[list[int]]
    # With TOKENMILL_STEP_TIMING: seconds in "prepare", "forward", "logits", "sample" (a
    # pooling model's: "prepare", "forward", "pool").
    step_times: dict[str, float] | None = None
    # Rows for the requests that sampled a token and asked for logprobs, in req_ids order
    # (top k = the largest k asked for in the step).
    logprobs_req_ids: list[str] = []
    logprobs: LogprobsArrays | None = None
    # Prompt logprobs of this step's prefill chunks, per request asking for them.
    prompt_logprobs: dict[str, LogprobsArrays] = {}
    # Speculative decoding: the tokens proposed for each request's next step, made once its
    # tokens of this step are known (requests that may speculate only).
    spec_token_ids: dict[str, list[int]] = {}
    # Pooling models: the vector (float32) of each request whose last prompt chunk ran.
    pooler_output: dict[str, np.ndarray] = {}


class KVCacheSpec(msgspec.Struct, frozen=True, array_like=True):  # type: ignore[call-arg]
    """One full-attention layer's KV needs: `2 * block_size * num_kv_heads * head_size`."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_bytes: int

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype_bytes
