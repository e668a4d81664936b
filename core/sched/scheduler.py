"""The Scheduler: decides which requests run each step and with how many tokens.

There are no prefill and decode phases: each request has `num_computed_tokens` and catches up
to its token count under one per-step budget (`max_num_batched_tokens`), running requests
first, then waiting ones (FCFS, or by priority). A waiting request starts from its longest
prefix-cache hit; long prompts are chunked across steps. When KV blocks run out the last
running request (the most recently admitted under FCFS, the lowest priority under the
priority policy) is preempted: freed, re-queued, recomputed later, reusing whatever of its
blocks is still cached. EngineCore calls `schedule()` then, with the workers' sampled tokens,
`update_from_output()`, which applies stop conditions and builds `EngineCoreOutputs`.

A pooling model's requests are prompts only: scheduled chunk by chunk like any prompt, each
ends (stopped) with the step that ran its last chunk, carrying the vector the workers pooled;
its blocks go back to the pool, full ones still registered in the prefix cache.

With speculative decoding a running request that holds proposed tokens (from the workers'
last output) is scheduled for 1 + len(proposal) tokens, the proposal cut to the budget and
to what `max_tokens` and `max_model_len` leave; the update appends the tokens the workers
accepted, applying stop conditions to each in order, and takes the rejected ones back from
`num_computed_tokens` (their K/V slots are written again later; no block holding one is
hashed for the prefix cache, the hashes being made from accepted tokens only).

Under async scheduling the next `schedule()` comes before the last step's update: a request
whose step samples holds a placeholder for that token (counted as computed, so its next step
is one more token, which the workers fill in themselves) until the update brings it. Stop
conditions apply when the real token arrives, so a request that stopped had one step too many
scheduled, whose token is dropped. Steps are updated in the order they were scheduled.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque

from tokenmill.core.kv_cache.manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sched.request_queue import make_queue
from tokenmill.core.sched.spec_governor import SpeculationGovernor
from tokenmill.protocol.config import EngineConfig
from tokenmill.protocol.messages import EngineCoreOutput, EngineCoreOutputs, LogprobsArrays
from tokenmill.protocol.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int) -> None:
        sched = config.scheduler_config
        self.max_num_seqs = sched.max_num_seqs
        self.max_num_batched_tokens = sched.max_num_batched_tokens
        self.enable_chunked_prefill = sched.enable_chunked_prefill
        self.long_prefill_token_threshold = sched.long_prefill_token_threshold
        self.max_model_len = config.model_config.max_model_len
        self.policy = sched.policy
        self.pooling = config.model_config.runner_type == "pooling"
        lora = config.lora_config
        self.max_loras = 0 if lora is None else lora.max_loras  # 0: LoRA off
        spec = config.speculative_config
        self.num_spec_tokens = 0 if spec is None else spec.num_speculative_tokens
        self.spec_disable_by_batch_size = None if spec is None else spec.disable_by_batch_size
        # Measures where speculation pays and turns it off where it does not.
        self.spec_governor = (
            SpeculationGovernor() if spec is not None and spec.auto_disable else None
        )
        # Speculative decoding's counters, vLLM's: steps of a request with a proposal, tokens
        # proposed, tokens accepted, and accepted by position in the proposal.
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos = [0] * self.num_spec_tokens
        # A draft model writes its proposal's K/V after a request's sampled token.
        self.num_lookahead_tokens = 0
        if spec is not None and spec.method == "draft_model":
            self.num_lookahead_tokens = self.num_spec_tokens
        cache = config.cache_config
        # Where every layer slides, blocks behind the window go back to the pool.
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            cache.block_size,
            cache.enable_prefix_caching,
            lookback=config.kv_lookback,
            rollback=self.num_spec_tokens,  # rejected proposals: their queries start earlier
        )
        self.requests: dict[str, Request] = {}
        self.waiting = make_queue(sched.policy)
        # Under the priority policy, kept sorted by (priority, arrival): the last one is always
        # the one to preempt, under both policies.
        self.running: list[Request] = []
        # Ended, or preempted, since the last step; the workers drop these on the next one.
        self.finished_req_ids: set[str] = set()
        self.preempted_req_ids: set[str] = set()
        self.num_preemptions = 0
        # The requests of every step scheduled and not yet updated, oldest first: an update
        # applies to these objects only (an id may be reused once its request finished).
        self.in_flight: deque[dict[str, Request]] = deque()

    # ----------------------------------------------------------------------------- requests
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Ends requests from outside the step (aborts); unknown ids are ignored."""
        finished = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.status.finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._free(request, status)
            finished.append(request)
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(len(self.waiting) or self.running)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ----------------------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        num_scheduled: dict[str, int] = {}
        cached = CachedRequestData()
        new_reqs: list[NewRequestData] = []
        spec: dict[str, list[int]] = {}
        budget, preempted = self._schedule_running(num_scheduled, cached, spec)
        # A step that had to preempt admits nobody: the pool is already short.
        if not preempted:
            budget = self._schedule_waiting(budget, num_scheduled, new_reqs)
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            finished_req_ids=list(self.finished_req_ids),
            preempted_req_ids=list(self.preempted_req_ids),
            scheduled_spec_decode_tokens=spec,
        )
        output.propose = self._speculates_next()
        self.finished_req_ids = set()
        self.preempted_req_ids = set()
        scheduled = {req_id: self.requests[req_id] for req_id in num_scheduled}
        for request in scheduled.values():
            # A step that reaches the end of the request's tokens samples the next one (a
            # pooling request's last chunk gives its vector instead).
            if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                if request.pooling_params is None:
                    request.num_output_placeholders += 1
            else:
                output.partial_req_ids.append(request.request_id)
        self.in_flight.append(scheduled)
        return output

    def _schedule_running(
        self, num_scheduled: dict[str, int], cached: CachedRequestData, spec: dict[str, list[int]]
    ) -> tuple[int, bool]:
        """Running requests first: a decode needs one token (plus its proposal, if any), a
        chunked prompt its next chunk. Preempts from the back of `running` while blocks are
        short. Returns the budget left and whether anything was preempted."""
        budget = self.max_num_batched_tokens
        kv = self.kv_cache_manager
        preempted = False
        limit = self.spec_disable_by_batch_size
        speculate = self.num_spec_tokens > 0 and (limit is None or len(self.running) <= limit)
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.num_output_placeholders and (
                request.num_tokens + request.num_output_placeholders >= request.max_num_tokens
            ):
                i += 1  # the step in flight brings its last token (max_tokens): nothing to run
                continue
            proposal = self._proposal(request, budget) if speculate else []
            request.spec_token_ids = proposal
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0:
                i += 1
                continue
            lookahead = self._lookahead(request, request.num_computed_tokens + num_new)
            while (new_blocks := kv.allocate_slots(request, num_new, None, lookahead)) is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if new_blocks is None:
                break
            num_scheduled[request.request_id] = num_new
            if proposal:
                spec[request.request_id] = proposal
            budget -= num_new
            cached.req_ids.append(request.request_id)
            cached.new_block_ids.append(new_blocks)
            cached.num_computed_tokens.append(request.num_computed_tokens)
            request.num_computed_tokens += num_new
            i += 1
        return budget, preempted

    def _schedule_waiting(
        self, budget: int, num_scheduled: dict[str, int], new_reqs: list[NewRequestData]
    ) -> int:
        """Then waiting ones, in queue order, each from its prefix-cache hit on, while the
        budget, max_num_seqs and the free blocks allow. Returns the budget left."""
        kv = self.kv_cache_manager
        # LoRA: a step runs at most max_loras distinct adapters; a request whose adapter would
        # be one more waits (skipped, in order) for a step with room.
        adapters = self.running_adapters() if self.max_loras else set()
        skipped: list[Request] = []
        while len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            if request.num_output_placeholders:
                break  # preempted while its step ran: it resumes once that token is in
            lora_id = request.lora_id
            if lora_id and lora_id not in adapters and len(adapters) >= self.max_loras:
                skipped.append(self.waiting.pop())
                continue
            # A request asking for prompt logprobs computes its whole prompt (as in vLLM).
            hits, num_hit_tokens = (
                ([], 0) if request.wants_prompt_logprobs else kv.get_computed_blocks(request)
            )
            request.num_computed_tokens = num_hit_tokens
            num_new = request.num_tokens - num_hit_tokens
            if not self.enable_chunked_prefill and num_new > budget:
                request.num_computed_tokens = 0
                break
            num_new = self._num_new_tokens(request, budget)
            lookahead = self._lookahead(request, num_hit_tokens + num_new)
            if kv.allocate_slots(request, num_new, hits, lookahead) is None:
                request.num_computed_tokens = 0
                break
            kv.record_lookup(request, num_hit_tokens)
            self.waiting.pop()
            if lora_id:
                adapters.add(lora_id)
            self._add_running(request)
            request.status = RequestStatus.RUNNING
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
                request.queue_time = time.monotonic() - request.added_time
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    sampling_params=request.sampling_params,
                    eos_token_ids=list(request.eos_token_ids),
                    block_ids=kv.get_block_ids(request.request_id),
                    num_computed_tokens=num_hit_tokens,
                    output_token_ids=list(request.output_token_ids),
                    pooling_params=request.pooling_params,
                    lora_request=request.lora_request,
                )
            )
            request.num_computed_tokens += num_new
        for request in reversed(skipped):
            self.waiting.requeue(request)
        return budget

    def running_adapters(self) -> set[int]:
        """The LoRA adapters of the running requests (by lora_int_id)."""
        return {r.lora_id for r in self.running if r.lora_id}

    def lora_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """Requests per adapter name, running and waiting (vLLM's lora_requests_info)."""
        counts: tuple[dict[str, int], dict[str, int]] = ({}, {})
        for requests, found in zip((self.running, self.waiting), counts):
            for request in requests:
                if request.lora_request is not None:
                    name = request.lora_request.lora_name
                    found[name] = found.get(name, 0) + 1
        return counts

    def _add_running(self, request: Request) -> None:
        if self.policy == "fcfs":
            self.running.append(request)
            return
        keys = [(r.priority, r.arrival_time) for r in self.running]
        self.running.insert(
            bisect.bisect_right(keys, (request.priority, request.arrival_time)), request
        )

    def _speculates_next(self) -> bool:
        """Whether the workers propose tokens after this step, for the next to verify."""
        if not self.num_spec_tokens or not self.running:
            return False
        limit = self.spec_disable_by_batch_size
        if limit is not None and len(self.running) > limit:
            return False
        return self.spec_governor is None or self.spec_governor.decide(len(self.running))

    def record_step_time(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput, seconds: float
    ) -> None:
        """A step's duration, for the governor: decode-only steps count (tokens out per
        second, with and without speculation)."""
        governor = self.spec_governor
        if governor is None:
            return
        scheduled = scheduler_output.num_scheduled_tokens
        spec = scheduler_output.scheduled_spec_decode_tokens
        decode_only = all(n == 1 + len(spec.get(r, ())) for r, n in scheduled.items())
        if not scheduled or not decode_only:
            governor.interrupt()
            return
        tokens = sum(len(t) for t in runner_output.sampled_token_ids)
        governor.record(len(scheduled), scheduler_output.propose, tokens, seconds)

    def _lookahead(self, request: Request, num_computed_after: int) -> int:
        """Slots past this step for the draft model's proposal: only after a step that
        samples, and never past max_model_len."""
        if not self.num_lookahead_tokens or num_computed_after < request.num_tokens:
            return 0
        return max(0, min(self.num_lookahead_tokens, self.max_model_len - num_computed_after))

    def _proposal(self, request: Request, budget: int) -> list[int]:
        """The part of the request's proposal it verifies this step: none unless it is a
        decode; no more than the budget leaves beside its own token, and no token past
        max_tokens or max_model_len (a step emits up to len(proposal) + 1 tokens)."""
        proposal = request.spec_token_ids
        if not proposal or request.num_computed_tokens != request.num_tokens - 1:
            return []
        room = request.max_num_tokens - request.num_tokens - 1
        return proposal[: max(0, min(room, budget - 1))]

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        num_new = (
            request.num_tokens
            + request.num_output_placeholders
            + len(request.spec_token_ids)
            - request.num_computed_tokens
        )
        if self.long_prefill_token_threshold > 0:
            num_new = min(num_new, self.long_prefill_token_threshold)
        return min(num_new, budget)

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        if not request.num_output_placeholders:
            # Recomputed from the start; unless the step in flight completes the prompt: its
            # token is kept, and the prompt logprobs go out with it.
            request.prompt_logprob_parts = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.requeue(request)
        self.preempted_req_ids.add(request.request_id)

    # ------------------------------------------------------------------------------ outputs
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        outputs: list[EngineCoreOutput] = []
        stopped: list[Request] = []
        scheduled = self.in_flight.popleft()
        self._finish_pooled(scheduler_output, runner_output, scheduled, outputs, stopped)
        for req_id, part in runner_output.prompt_logprobs.items():
            request = scheduled.get(req_id)
            # A request preempted mid-prompt computes it (and these logprobs) again later; one
            # preempted while its last chunk ran keeps them with its token.
            kept = request is not None and (
                request.status == RequestStatus.RUNNING
                or (request.status == RequestStatus.PREEMPTED and request.num_output_placeholders)
            )
            if kept and not request.prompt_logprobs_sent:
                request.prompt_logprob_parts.append(part)
        # Each request's rows of logprobs, one per token it emitted: (first, count).
        logprob_rows: dict[str, tuple[int, int]] = {}
        for i, r in enumerate(runner_output.logprobs_req_ids):
            first, count = logprob_rows.get(r, (i, 0))
            logprob_rows[r] = (first, count + 1)
        for req_id, token_ids in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            request = scheduled.get(req_id)
            # Finished (stopped, aborted) while the step ran: its token is moot. A request
            # preempted meanwhile keeps its token, as in vLLM, and resumes after it.
            if request is None or request.status.finished or not token_ids:
                continue
            request.num_output_placeholders -= 1  # one per step that samples
            proposal = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if proposal:
                self._count_accepted(request, proposal, len(token_ids) - 1)
            # What its next step verifies (a preempted request proposes again once resumed).
            if request.status == RequestStatus.RUNNING:
                request.spec_token_ids = runner_output.spec_token_ids.get(req_id, [])
            new_tokens = []
            finish_reason = None
            error = None
            for token_id in token_ids:
                request.append_output_token(token_id)
                new_tokens.append(token_id)
                status = None
                if request.grammar is not None and not request.grammar.accept_token(token_id):
                    # Other constraints (allowed_token_ids, bad_words, min_tokens) left the
                    # grammar no token to allow: the request cannot go on.
                    error = f"the structured output could not continue (token {token_id})"
                    logger.warning("request %s: %s", req_id, error)
                    status = RequestStatus.FINISHED_ERROR
                status = status or self._check_stop(request, token_id)
                if status is not None:
                    if request.status == RequestStatus.PREEMPTED:
                        self.waiting.remove(request)
                    request.status = status
                    finish_reason = status.finish_reason
                    stopped.append(request)
                    break
            output = EngineCoreOutput(
                request_id=req_id,
                new_token_ids=new_tokens,
                finish_reason=finish_reason,
                stop_reason=request.stop_reason,
                num_cached_tokens=max(request.num_cached_tokens, 0),
                error=error,
                # Once, with the first output token.
                queue_time=request.queue_time
                if request.num_output_tokens == len(new_tokens)
                else None,
            )
            params = request.sampling_params
            if req_id in logprob_rows and params.logprobs is not None:
                first, count = logprob_rows[req_id]
                arrays = runner_output.logprobs
                assert arrays is not None
                row = slice(first, first + min(count, len(new_tokens)))  # to a stop inside
                output.new_logprobs = LogprobsArrays(
                    arrays.token_ids[row], arrays.logprobs[row], arrays.ranks[row]
                ).first(params.logprobs if params.logprobs >= 0 else arrays.token_ids.shape[1])
            if request.prompt_logprob_parts and not request.prompt_logprobs_sent:
                k = params.prompt_logprobs
                assert k is not None
                parts = LogprobsArrays.concat(request.prompt_logprob_parts)
                output.prompt_logprobs = parts.first(k if k >= 0 else parts.token_ids.shape[1])
                request.prompt_logprob_parts = []
                request.prompt_logprobs_sent = True
            outputs.append(output)
        if stopped:
            stopped_ids = {r.request_id for r in stopped}
            self.running = [r for r in self.running if r.request_id not in stopped_ids]
            for request in stopped:
                self._free(request, request.status)
        return EngineCoreOutputs(outputs=outputs, timestamp=time.monotonic())

    def _finish_pooled(
        self,
        scheduler_output: SchedulerOutput,
        runner_output: ModelRunnerOutput,
        scheduled: dict[str, Request],
        outputs: list[EngineCoreOutput],
        stopped: list[Request],
    ) -> None:
        """Pooling requests whose last prompt chunk ran end here, stopped (as vLLM ends
        them), with their vector; one the workers gave none for ends with an error."""
        if not self.pooling:
            return
        pooled = runner_output.pooler_output
        partial = set(scheduler_output.partial_req_ids)
        for req_id, request in scheduled.items():
            if request.pooling_params is None or req_id in partial or request.status.finished:
                continue
            vector = pooled.get(req_id)
            output = EngineCoreOutput(
                request_id=req_id,
                new_token_ids=[],
                num_cached_tokens=max(request.num_cached_tokens, 0),
                queue_time=request.queue_time,
                pooling_output=vector,
            )
            if vector is None:
                request.status = RequestStatus.FINISHED_ERROR
                output.error = "the workers returned no pooled output for this request"
                logger.error("request %s: %s", req_id, output.error)
            else:
                request.status = RequestStatus.FINISHED_STOPPED
            output.finish_reason = request.status.finish_reason
            outputs.append(output)
            stopped.append(request)

    def _count_accepted(self, request: Request, proposal: list[int], num_accepted: int) -> None:
        """A verified proposal: the rejected tokens' K/V slots are computed again later."""
        request.num_computed_tokens -= len(proposal) - num_accepted
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += len(proposal)
        self.spec_num_accepted_tokens += num_accepted
        if self.spec_governor is not None:
            self.spec_governor.verified(num_accepted)
        for pos in range(num_accepted):
            self.spec_accepted_per_pos[pos] += 1

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        if request.grammar is not None and request.grammar.is_terminated():
            return RequestStatus.FINISHED_STOPPED  # the structure is complete
        if request.num_output_tokens > request.min_tokens:
            if request.eos_stops and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in request.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if len(request.all_token_ids) >= request.max_num_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _free(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
