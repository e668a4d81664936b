"""OutputProcessor: `EngineCoreOutputs` -> `RequestOutput`s, on the frontend side.

Tracks every request in flight: appends new token ids, detokenizes incrementally, applies
stop strings (which the core does not see: a match ends the request here and the caller
aborts it in the core), and builds vLLM-shaped outputs. Called by LLMEngine after each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.frontend.detokenizer import IncrementalDetokenizer
from tokenmill.frontend.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestOutput,
    SampleLogprobs,
)
from tokenmill.protocol.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    LogprobsArrays,
)


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: Any
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: PromptLogprobs | None = None

    def to_output(self) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=self.text,
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=self.finish_reason is not None,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
            error=self.error,
        )


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(self, request: EngineCoreRequest, prompt: str | None) -> None:
        params = request.sampling_params
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                params.skip_special_tokens,
                params.spaces_between_special_tokens,
            )
        state = RequestState(
            request_id=request.request_id,
            prompt=prompt,
            prompt_token_ids=request.prompt_token_ids,
            params=params,
            detokenizer=detokenizer,
        )
        if params.logprobs is not None:
            state.logprobs, state.cumulative_logprob = [], 0.0
        self.requests[request.request_id] = state

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def abort_requests(self, request_ids: list[str]) -> None:
        for req_id in request_ids:
            self.requests.pop(req_id, None)

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the updated RequestOutputs and the ids that stopped on a stop string
        (still running in the core, so the caller must abort them there)."""
        results: list[RequestOutput] = []
        to_abort: list[str] = []
        for out in outputs:
            state = self.requests.get(out.request_id)
            if state is None:  # aborted here while the core was still working on it
                continue
            state.token_ids.extend(out.new_token_ids)
            state.num_cached_tokens = out.num_cached_tokens
            if out.new_logprobs is not None and state.logprobs is not None:
                state.logprobs.extend(self._logprob_dicts(out.new_logprobs))
                state.cumulative_logprob = (state.cumulative_logprob or 0.0) + float(
                    out.new_logprobs.logprobs[:, 0].sum()
                )
            if out.prompt_logprobs is not None:
                state.prompt_logprobs = [None, *self._logprob_dicts(out.prompt_logprobs)]
            elif state.params.prompt_logprobs is not None and state.prompt_logprobs is None:
                state.prompt_logprobs = [None]  # a one-token prompt has nothing to score
            if state.detokenizer is not None:
                previous_len = len(state.text)
                state.detokenizer.update(out.new_token_ids)
                state.text = state.detokenizer.output_text
                if self._check_stop_strings(state, previous_len) and out.finish_reason is None:
                    to_abort.append(out.request_id)
            if state.finish_reason is None and out.finish_reason is not None:
                state.finish_reason = str(out.finish_reason)
                state.stop_reason = out.stop_reason
                state.error = out.error
            results.append(state.to_output())
            if state.finish_reason is not None:
                del self.requests[out.request_id]
        return results, to_abort

    def _logprob_dicts(self, arrays: LogprobsArrays) -> SampleLogprobs:
        """One dict per position: the chosen token first (with its rank), then the top k
        (ranked 1..k); a chosen token among the top k appears once."""
        token_ids, logprobs = arrays.token_ids.tolist(), arrays.logprobs.tolist()
        ranks = arrays.ranks.tolist()
        decode = self._decode_token
        result = []
        for ids, values, rank in zip(token_ids, logprobs, ranks):
            entry = {ids[0]: Logprob(values[0], rank, decode(ids[0]))}
            for r, (t, v) in enumerate(zip(ids[1:], values[1:]), start=1):
                entry.setdefault(t, Logprob(v, r, decode(t)))
            result.append(entry)
        return result

    def _decode_token(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])

    def _check_stop_strings(self, state: RequestState, previous_len: int) -> bool:
        """Ends the request at the earliest stop string that the new text completed."""
        params = state.params
        stops: list[str] = params.stop
        if not stops or state.finish_reason is not None:
            return False
        if len(state.token_ids) <= params.min_tokens:
            return False
        best: tuple[int, str] | None = None
        for stop in stops:
            # A new match must end inside the new text.
            index = state.text.find(stop, max(previous_len - len(stop) + 1, 0))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return False
        index, stop = best
        end = index + len(stop) if params.include_stop_str_in_output else index
        state.text = state.text[:end]
        state.finish_reason = str(FinishReason.STOP)
        state.stop_reason = stop
        return True
