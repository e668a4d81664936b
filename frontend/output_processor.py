"""OutputProcessor: `EngineCoreOutputs` -> `RequestOutput`s, on the frontend side.

Tracks every request in flight: appends new token ids, detokenizes incrementally, applies
stop strings (which the core does not see: a match ends the request here and the caller
aborts it in the core), and builds vLLM-shaped outputs as each request's output_kind asks
(cumulative, delta, final only). A request with n > 1 goes to the core as n children (child i
seeded with seed + i) and comes back as one RequestOutput with n completions. Called by
LLMEngine and AsyncLLM after each step. A pooling request gets one PoolingRequestOutput, with
its vector, when the core ends it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from tokenmill.frontend.detokenizer import IncrementalDetokenizer
from tokenmill.frontend.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestOutput,
    SampleLogprobs,
)
from tokenmill.protocol.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    LogprobsArrays,
    PoolingParams,
    RequestOutputKind,
)


@dataclass
class RequestState:
    """One request in the core: a user's request, or one of the n children of one."""

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
    # What earlier outputs carried (for output_kind=DELTA).
    sent_tokens: int = 0
    sent_text: int = 0
    sent_finished: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def has_news(self) -> bool:
        return len(self.token_ids) > self.sent_tokens or (self.finished and not self.sent_finished)

    def completion(self, index: int, delta: bool) -> CompletionOutput:
        """This request's completion so far; with `delta`, only what no output carried yet.

        While it runs, text that a stop string could still turn out to begin is held back
        (the longest stop string's length - 1 characters, as vLLM does), so that no output
        ever shows text the stop string then cuts."""
        visible = len(self.text)
        params = self.params
        if not self.finished and params.stop and not params.include_stop_str_in_output:
            visible = max(self.sent_text, visible - (max(map(len, params.stop)) - 1))
        tokens, text, logprobs = self.token_ids, self.text[:visible], self.logprobs
        if delta:
            tokens, text = tokens[self.sent_tokens :], text[self.sent_text :]
            logprobs = None if logprobs is None else logprobs[self.sent_tokens :]
        self.sent_tokens, self.sent_text = len(self.token_ids), visible
        self.sent_finished = self.finished
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=list(tokens),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if logprobs is None else list(logprobs),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclass
class ParentRequest:
    """A request with n > 1: n children in the core (child i samples with seed + i), one
    RequestOutput with n completions for the user (as vLLM's ParentRequest)."""

    request_id: str
    child_ids: list[str]


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}  # by the id the core knows
        self.parents: dict[str, ParentRequest] = {}
        self.parent_of: dict[str, str] = {}  # child id -> parent id
        self._token_texts: dict[int, str] = {}  # logprob tokens, decoded once each

    def add_request(
        self, request: EngineCoreRequest, prompt: str | None
    ) -> list[EngineCoreRequest]:
        """Starts tracking a request; returns what to send to the core (its n children when
        n > 1, else the request itself)."""
        params = request.sampling_params
        if request.request_id in self.requests or request.request_id in self.parents:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if params is None or params.n == 1:
            self._track(request, prompt)
            return [request]
        children = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            # Only child 0 reports prompt logprobs; the others read the prompt from the cache.
            prompt_logprobs = params.prompt_logprobs if i == 0 else None
            child_params = msgspec.structs.replace(
                params, n=1, seed=seed, prompt_logprobs=prompt_logprobs
            )
            child_id = f"{i}_{request.request_id}"
            if child_id in self.requests:
                raise ValueError(f"request id {child_id!r} is already in use")
            children.append(
                msgspec.structs.replace(request, request_id=child_id, sampling_params=child_params)
            )
        for child in children:  # built them all first: a failure leaves nothing tracked
            self._track(child, prompt)
            self.parent_of[child.request_id] = request.request_id
        self.parents[request.request_id] = ParentRequest(
            request.request_id, [c.request_id for c in children]
        )
        return children

    def _track(self, request: EngineCoreRequest, prompt: str | None) -> None:
        params = request.sampling_params
        if params is None:  # a pooling request: its vector comes with its finish
            self.requests[request.request_id] = RequestState(
                request.request_id, prompt, request.prompt_token_ids, request.pooling_params, None
            )
            return
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

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forgets the requests (a parent with its children); returns the ids to abort in
        the core."""
        core_ids = []
        for req_id in request_ids:
            parent = self.parents.pop(req_id, None)
            ids = parent.child_ids if parent is not None else [req_id]
            for core_id in ids:
                self.requests.pop(core_id, None)
                self.parent_of.pop(core_id, None)
            core_ids.extend(ids)
        return core_ids

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput | PoolingRequestOutput], list[str]]:
        """Returns the updated RequestOutputs (one per user request, whatever the number of
        its children that moved; a PoolingRequestOutput for a pooling request) and the core
        ids that stopped on a stop string (still running in the core, so the caller must
        abort them there)."""
        to_abort: list[str] = []
        touched: dict[str, None] = {}  # user request ids, in order
        pooled: dict[str, PoolingRequestOutput] = {}
        for out in outputs:
            state = self.requests.get(out.request_id)
            # Aborted here while the core was still working on it, or finished here (a stop
            # string) while it ran ahead.
            if state is None or state.finished:
                continue
            if isinstance(state.params, PoolingParams):
                pooled[out.request_id] = self._pooling_output(state, out)
            elif self._update(state, out):
                to_abort.append(out.request_id)
            touched[self.parent_of.get(out.request_id, out.request_id)] = None
        results: list[RequestOutput | PoolingRequestOutput] = []
        for user_id in touched:
            output = pooled[user_id] if user_id in pooled else self._output(user_id)
            if output is not None:
                results.append(output)
        return results, to_abort

    def _pooling_output(self, state: RequestState, out: EngineCoreOutput) -> PoolingRequestOutput:
        """A pooling request's one output (its vector, or its error); the request is done."""
        del self.requests[state.request_id]
        vector = out.pooling_output
        if vector is None:  # (rejected by the engine: `error` says why)
            vector = np.zeros(0, dtype=np.float32)
        return PoolingRequestOutput(
            request_id=state.request_id,
            outputs=PoolingOutput.from_array(vector),
            prompt_token_ids=state.prompt_token_ids,
            num_cached_tokens=out.num_cached_tokens,
            finished=True,
            error=out.error,
        )

    def _update(self, state: RequestState, out: EngineCoreOutput) -> bool:
        """Applies one core output; True when a stop string ended the request here."""
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
        stopped = False
        if state.detokenizer is not None:
            previous_len = len(state.text)
            shown = out.new_token_ids
            if (
                out.finish_reason == FinishReason.STOP
                and not state.params.include_stop_str_in_output
            ):
                # The core stops on a token (EOS, a stop token id, a grammar's end): it ends
                # the text without being in it, also when special tokens are kept (vLLM's).
                shown = shown[:-1]
            state.detokenizer.update(shown)
            if out.finish_reason is not None:
                state.detokenizer.finish()
            state.text = state.detokenizer.output_text
            stopped = self._check_stop_strings(state, previous_len) and out.finish_reason is None
        if state.finish_reason is None and out.finish_reason is not None:
            state.finish_reason = str(out.finish_reason)
            state.stop_reason = out.stop_reason
            state.error = out.error
        return stopped

    def _output(self, user_id: str) -> RequestOutput | None:
        """The RequestOutput of a user request as its output_kind asks (None: nothing to
        show yet); forgets the request once it is finished."""
        parent = self.parents.get(user_id)
        core_ids = parent.child_ids if parent is not None else [user_id]
        states = [self.requests[i] for i in core_ids]
        first = states[0]
        finished = all(s.finished for s in states)
        kind = first.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        prompt_logprobs = first.prompt_logprobs
        if delta and first.sent_tokens > 0:
            prompt_logprobs = None  # went with the first delta
        completions = [
            s.completion(i, delta) for i, s in enumerate(states) if not delta or s.has_news()
        ]
        if finished:
            self.abort_requests([user_id])
        return RequestOutput(
            request_id=user_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=first.num_cached_tokens,
            error=next((s.error for s in states if s.error), None),
        )

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
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

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
