"""EngineCore: the scheduling loop around one executor, independent of any socket.

Start-up follows vLLM's order: executor (workers load the model) -> KV cache sizing -> the
scheduler. `step()` runs one schedule -> execute -> update cycle and returns the outputs that
the clients turn into RequestOutputs; a step that raises is logged with a summary of what it
was running, then re-raised (the engine is dead). The InprocClient calls it directly; the
engine-core process wraps it in a socket loop.

With async scheduling (vLLM's batch queue of two) `step()` schedules and submits step N+1
before it waits for step N, so that scheduling, bitmasks and the last step's update overlap
the workers' forward; it returns step N's outputs (none on the call that starts the queue).
A step whose structured-output requests still wait for a token in flight is submitted only
after that step's update: its bitmask needs the grammar's state after that token.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future, wait
from typing import Any, NamedTuple

import msgspec

from tokenmill.core.executor.base import Executor
from tokenmill.core.kv_cache.sizing import KVCacheSizing, compute_kv_cache_sizing
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sched.scheduler import Scheduler
from tokenmill.core.structured_output import StructuredOutputManager
from tokenmill.protocol import envs
from tokenmill.protocol.config import EngineConfig, ModelConfig
from tokenmill.protocol.lora import LoRARequest
from tokenmill.protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from tokenmill.protocol.scheduler_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.protocol.utils import StageTimes

logger = logging.getLogger(__name__)

_GRAMMAR_WAIT_S = 0.05  # an otherwise idle step waits this long for a grammar to compile
_FORWARD_WAIT_S = 0.05  # the longest the core gives the next step to reach its forward
_LORA_RPC_S = 120.0  # reading an adapter from a slow disk; a worker that hangs fails the call


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        start = time.perf_counter()
        self.executor = Executor.get_class(config)(config)
        loaded = time.perf_counter()
        try:
            # rank 0's model (get_stats)
            self.model_memory = self.executor.collective_rpc("model_memory", unique_reply_rank=0)
            self.kv_sizing = self._initialize_kv_cache(config)
        except BaseException:
            self.executor.shutdown()
            raise
        allocated = time.perf_counter()
        self.config = config.with_max_model_len(self.kv_sizing.max_model_len)
        self.scheduler = Scheduler(self.config, self.kv_sizing.num_blocks)
        # Under the torchrun launcher every rank schedules for itself: grammars compile in
        # step, so that all ranks admit a request at the same step.
        launcher = config.parallel_config.distributed_executor_backend == "external_launcher"
        self.structured = StructuredOutputManager(self.config, synchronous=launcher)
        self._compiling: dict[str, tuple[Request, Future]] = {}  # waiting for their grammar
        self._grammar_req_ids: set[str] = set()  # live requests with a grammar
        self._rejected: list[EngineCoreOutput] = []
        # LoRA adapters the workers have read (by lora_int_id), with enable_lora.
        self.loras: dict[int, LoRARequest] = {}
        # Removed while requests still ran them: dropped from the workers once none does.
        self._loras_leaving: dict[int, LoRARequest] = {}
        self.async_scheduling = self.config.scheduler_config.async_scheduling
        # Steps submitted to the executor and not yet updated, oldest first (at most two).
        self._batches: deque[_Batch] = deque()
        self._num_token_steps = 0
        self._last_update = 0.0  # perf_counter() when a step was last updated
        self._stats = _StepStats()
        # With TOKENMILL_STEP_TIMING: seconds per stage, summed over steps (see envs).
        self.timing = StageTimes(envs.TOKENMILL_STEP_TIMING)
        # Seconds of start-up by stage (get_stats; scripts/startup_time.py prints them).
        self.startup_s = {
            "workers + torch + model": loaded - start,
            "kv cache": allocated - loaded,
            "scheduler + grammar": time.perf_counter() - allocated,
        }

    def _initialize_kv_cache(self, config: EngineConfig) -> KVCacheSizing:
        specs = self.executor.get_kv_cache_specs()
        available = self.executor.determine_available_memory()
        model, sched = config.model_config, config.scheduler_config
        max_fit_len = model.max_position_embeddings
        if not sched.enable_chunked_prefill:  # a whole prompt must fit in one step
            max_fit_len = min(max_fit_len, sched.max_num_batched_tokens)
        window_tokens = config.kv_lookback
        if window_tokens is not None:
            # One step may add max_num_batched_tokens (plus rejected proposals) to what a
            # request holds behind its window.
            spec = config.speculative_config
            window_tokens += sched.max_num_batched_tokens
            window_tokens += spec.num_speculative_tokens if spec else 0
        sizing = compute_kv_cache_sizing(
            specs, available, config.cache_config, model.max_model_len, max_fit_len, window_tokens
        )
        # The workers get the config as settled here (max_model_len after auto-fit).
        settled = config.with_max_model_len(sizing.max_model_len)
        self.executor.initialize_kv_cache(settled, sizing.num_blocks)
        return sizing

    # ------------------------------------------------------------------------------ requests
    def add_request(self, request: EngineCoreRequest) -> None:
        if self.is_live(request.request_id):
            # An error output under this id would end the live request at its client.
            logger.warning("ignored a second request with the live id %r", request.request_id)
            return
        error = self._validate(request)
        if error is not None:
            self.reject_request(request.request_id, error)
            return
        lora = request.lora_request
        if lora is not None:
            try:
                self.add_lora(lora)
            except Exception as e:  # its adapter cannot run (or be read): it fails alone
                self.reject_request(request.request_id, str(e) or type(e).__name__)
                return
        core_request = Request(request, self.config.model_config.max_model_len)
        threshold = self.config.model_config.long_rope_threshold
        if threshold is not None and core_request.num_prompt_tokens > threshold:
            # LongRoPE: a prompt past the original context rotates every position by the
            # long frequencies (the workers' rule), unlike a shorter one's first positions.
            core_request.cache_salt = b"long-rope"
        if lora is not None:
            core_request.cache_salt += lora.cache_salt
        params = request.sampling_params
        structured = None if params is None else params.structured_outputs
        if structured is not None:
            # Waits outside the scheduler (blocking no one) until its grammar is compiled.
            future = self.structured.compile(structured)
            self._compiling[request.request_id] = (core_request, future)
            return
        self.scheduler.add_request(core_request)

    def reject_request(self, request_id: str, error: str) -> None:
        """Ends a request that cannot run (it failed validation, or its message did not
        decode) with an error output at the next step: no request ends unanswered."""
        if self.is_live(request_id):
            logger.warning("ignored a second request with the live id %r", request_id)
            return
        logger.warning("rejected request %s: %s", request_id, error)
        self._rejected.append(
            EngineCoreOutput(request_id, [], finish_reason=FinishReason.ERROR, error=error)
        )

    def is_live(self, request_id: str) -> bool:
        """Whether this request will still get an output (running, waiting, compiling its
        grammar, or rejected with its error output not yet sent)."""
        return (
            request_id in self.scheduler.requests
            or request_id in self._compiling
            or any(out.request_id == request_id for out in self._rejected)
        )

    def _admit_compiled(self) -> None:
        """Requests whose grammar is ready join the scheduler; a grammar that failed to
        compile fails its request alone."""
        for req_id, (request, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[req_id]
            error = future.exception()
            if error is not None:
                message = f"structured_outputs could not be compiled: {error}"
                logger.warning("rejected request %s: %s", req_id, message)
                self._rejected.append(
                    EngineCoreOutput(req_id, [], finish_reason=FinishReason.ERROR, error=message)
                )
                continue
            request.grammar = self.structured.matcher(future.result())
            refused = next((t for t in request.output_token_ids
                            if not request.grammar.accept_token(t)), None)  # fmt: skip
            if refused is not None:  # a resumed request whose outputs break its grammar
                message = f"resumed_token_ids: token {refused} does not follow the grammar"
                self._rejected.append(
                    EngineCoreOutput(req_id, [], finish_reason=FinishReason.ERROR, error=message)
                )
                continue
            self._grammar_req_ids.add(req_id)
            self.scheduler.add_request(request)

    def _validate(self, request: EngineCoreRequest) -> str | None:
        model = self.config.model_config
        n = len(request.prompt_token_ids)
        if n == 0:
            return "prompt_token_ids is empty"
        if n > model.max_model_len:
            return f"the prompt has {n} tokens, more than max_model_len={model.max_model_len}"
        bad = [t for t in request.prompt_token_ids if not 0 <= t < model.vocab_size]
        if bad:
            return f"prompt_token_ids holds ids outside [0, {model.vocab_size}): {bad[:8]}"
        resumed = request.resumed_token_ids
        bad = [t for t in resumed if not 0 <= t < model.vocab_size]
        if bad:
            return f"resumed_token_ids holds ids outside [0, {model.vocab_size}): {bad[:8]}"
        if n + len(resumed) > model.max_model_len:
            return (
                f"the prompt and resumed_token_ids have {n + len(resumed)} tokens, more than "
                f"max_model_len={model.max_model_len}"
            )
        mismatch = _runner_mismatch(request, model)
        if mismatch is not None:
            return mismatch
        params = request.sampling_params
        if params is None:
            return None
        # A client that builds its own requests is checked too: a token id outside the
        # vocabulary would fail the whole step.
        bad = [t for t in params.token_ids_used() if not 0 <= t < model.vocab_size]
        if bad:
            return f"sampling_params name token ids outside [0, {model.vocab_size}): {bad[:8]}"
        bad = [t for t in request.eos_token_ids if not 0 <= t < model.vocab_size]
        if bad:  # they are banned while min_tokens holds
            return f"eos_token_ids holds ids outside [0, {model.vocab_size}): {bad[:8]}"
        return None

    def abort_requests(self, request_ids: list[str]) -> None:
        for req_id in request_ids:
            self._compiling.pop(req_id, None)
            self._grammar_req_ids.discard(req_id)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return (
            bool(self._rejected)
            or bool(self._compiling)
            or bool(self._batches)
            or self.scheduler.has_unfinished_requests()
            or bool(self._loras_leaving)  # a step drops them from the workers
        )

    # ---------------------------------------------------------------------------------- step
    def step(self) -> EngineCoreOutputs:
        if self._compiling:
            self._admit_compiled()
        rejected, self._rejected = self._rejected, []
        if not self.scheduler.has_unfinished_requests() and not self._batches:
            if self._loras_leaving:
                self._drop_unused_loras()
            if self._compiling and not rejected:  # nothing to run until a grammar is ready
                _, future = next(iter(self._compiling.values()))
                wait([future], timeout=_GRAMMAR_WAIT_S)
            return EngineCoreOutputs(
                outputs=rejected, timestamp=time.monotonic(), scheduler_stats=self.make_stats()
            )
        if self.async_scheduling:
            outputs = self._step_overlapped()
        else:
            scheduler_output = self._schedule()
            self._fill_bitmask(scheduler_output)
            self._submit(scheduler_output)
            outputs = self._collect()
        if outputs is None:
            outputs = EngineCoreOutputs(timestamp=time.monotonic())
        outputs.outputs.extend(rejected)
        outputs.scheduler_stats = self.make_stats()
        if self._loras_leaving:
            self._drop_unused_loras()
        return outputs

    def _step_overlapped(self) -> EngineCoreOutputs | None:
        """Schedules and submits the next step, then updates the oldest one in flight once
        two are (or once there is nothing new to run). None: nothing was updated."""
        outputs = None
        if self._batches and speculates(self._batches[-1].scheduler_output):
            # Its proposals and accepted tokens decide what the next step computes.
            return self._collect()
        if self.scheduler.has_unfinished_requests():
            scheduler_output = self._schedule()
            if self._batches and self._waits_for_grammar_token(scheduler_output):
                outputs = self._collect()
            self._fill_bitmask(scheduler_output)
            self._submit(scheduler_output)
            if outputs is not None:
                return outputs
            if len(self._batches) < 2 and scheduler_output.total_num_scheduled_tokens:
                return None  # the next call schedules while this step runs
        return self._collect()

    def _schedule(self) -> SchedulerOutput:
        with self.timing.stage("schedule"):
            return self.scheduler.schedule()

    def _fill_bitmask(self, scheduler_output: SchedulerOutput) -> None:
        if self._grammar_req_ids:
            with self.timing.stage("schedule"):
                self.structured.fill_bitmask(
                    scheduler_output, self._grammar_req_ids, self.scheduler.requests
                )

    def _waits_for_grammar_token(self, scheduler_output: SchedulerOutput) -> bool:
        """Whether a constrained request of this step still waits for its last token (its
        second placeholder: one from the step in flight, one from this one)."""
        scheduled = scheduler_output.num_scheduled_tokens
        requests = self.scheduler.requests
        return any(
            req_id in scheduled and requests[req_id].num_output_placeholders > 1
            for req_id in self._grammar_req_ids
        )

    def _submit(self, scheduler_output: SchedulerOutput) -> None:
        submitted = time.perf_counter()
        try:
            future = self.executor.execute_model(scheduler_output, non_block=True)
        except Exception:
            logger.exception("the step failed; it ran %s", summarize(scheduler_output))
            raise
        number = 0
        if scheduler_output.total_num_scheduled_tokens:
            self._num_token_steps += 1
            number = self._num_token_steps
        self._batches.append(_Batch(scheduler_output, future, submitted, number))

    def _collect(self) -> EngineCoreOutputs:
        """Waits for the oldest step in flight and applies its tokens."""
        scheduler_output, future, submitted, _ = self._batches.popleft()
        start = time.perf_counter()
        try:
            runner_output = future.result()
        except Exception:
            logger.exception("the step failed; it ran %s", summarize(scheduler_output))
            raise
        if self._batches and self._batches[0].forward_number:
            # Let the next step's inputs be prepared before this update takes the GIL.
            self.executor.wait_for_forward(self._batches[0].forward_number, _FORWARD_WAIT_S)
        self._time_execution(runner_output, submitted, start)
        with self.timing.stage("update"):
            outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
            # The step's share of the time: since it was submitted, or, overlapped, since
            # the step before it was updated.
            now = time.perf_counter()
            self.scheduler.record_step_time(
                scheduler_output, runner_output, now - max(submitted, self._last_update)
            )
            self._last_update = now
            if self._grammar_req_ids:
                for out in outputs.outputs:
                    if out.finished:
                        self._grammar_req_ids.discard(out.request_id)
        self.timing.num_steps += 1
        self._stats.record(self, scheduler_output, outputs)
        return outputs

    def _time_execution(
        self, runner_output: ModelRunnerOutput, submitted: float, waited: float
    ) -> None:
        """With step timing: the runner's stages, and how long the core waited for the
        workers (async scheduling) or what the runner did not time (the executor's
        transport, mostly)."""
        if not self.timing.on:
            return
        executed = time.perf_counter()
        runner_times = runner_output.step_times or {}
        for stage, seconds in runner_times.items():
            self.timing.add(stage, seconds)
        if self.async_scheduling:
            self.timing.add("wait", executed - waited)
        else:
            self.timing.add("executor", executed - submitted - sum(runner_times.values()))

    def make_stats(self) -> SchedulerStats:
        scheduler = self.scheduler
        kv = scheduler.kv_cache_manager
        running_loras, waiting_loras = scheduler.lora_counts() if scheduler.max_loras else ({}, {})
        return SchedulerStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting + len(self._compiling),
            kv_cache_usage=kv.usage(),
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=scheduler.num_preemptions,
            running_lora_adapters=running_loras,
            waiting_lora_adapters=waiting_loras,
            spec_decode_num_drafts=scheduler.spec_num_drafts,
            spec_decode_num_draft_tokens=scheduler.spec_num_draft_tokens,
            spec_decode_num_accepted_tokens=scheduler.spec_num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(scheduler.spec_accepted_per_pos),
        )

    def get_stats(self) -> dict[str, Any]:
        """The scheduler stats every output carries (make_stats; the prefix-cache figures
        are token counts since start-up), plus the cache's size; with speculative decoding
        the acceptance rate (accepted / proposed tokens) and mean acceptance length (tokens
        emitted per verifying step, the bonus token included), as vLLM reports them."""
        stats = self.make_stats()
        spec = {}
        if self.config.speculative_config is not None:
            drafts, proposed = stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens
            accepted = stats.spec_decode_num_accepted_tokens
            spec = {
                "spec_decode_acceptance_rate": accepted / proposed if proposed else 0.0,
                "spec_decode_mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
            }
        return {
            **msgspec.structs.asdict(stats),
            **spec,
            "num_blocks": self.kv_sizing.num_blocks,
            "block_size": self.kv_sizing.block_size,
            "max_model_len": self.config.model_config.max_model_len,
            "startup_s": dict(self.startup_s),
            "model_memory": dict(self.model_memory),
            **(
                {"step_time_s": dict(self.timing.times), "num_timed_steps": self.timing.num_steps}
                if self.timing.on
                else {}
            ),
        }

    def check_health(self) -> bool:
        self.executor.check_health()
        return True

    def add_lora(self, lora_request: LoRARequest | dict | list) -> bool:
        """Reads the adapter into every worker (vLLM's add_lora); False if it was there. A
        ValueError says why an adapter cannot run (its rank, its folder, LoRA off)."""
        if self.config.lora_config is None:
            raise ValueError("LoRA is not enabled: start the engine with enable_lora=True")
        if not isinstance(lora_request, LoRARequest):  # a utility call's argument
            lora_request = msgspec.convert(lora_request, LoRARequest)
        lora_id = lora_request.lora_int_id
        known = self.loras.get(lora_id)
        if known is not None and known.lora_path == lora_request.lora_path:
            return False
        leaving = self._loras_leaving.get(lora_id)
        if leaving is not None and leaving.lora_path == lora_request.lora_path:
            # Removed while requests still ran it, so still in the workers: it stays.
            del self._loras_leaving[lora_id]
            self.loras[lora_id] = leaving
            return True
        # A worker's ValueError (rank, folder, shapes) comes back as one.
        self.executor.collective_rpc("add_lora", args=(lora_request,), timeout=_LORA_RPC_S)
        self.loras[lora_request.lora_int_id] = lora_request
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forgets the adapter in every worker; False if it was not added. Requests running
        it finish with it: the workers drop it once the last of them ends (so no step has to
        read its folder again, which may be gone by then)."""
        if self.config.lora_config is None:
            raise ValueError("LoRA is not enabled: start the engine with enable_lora=True")
        lora = self.loras.pop(lora_id, None)
        if lora is None:
            return False
        if lora_id in self._lora_ids_in_use():
            self._loras_leaving[lora_id] = lora
        else:
            self.executor.collective_rpc("remove_lora", args=(lora_id,), timeout=_LORA_RPC_S)
        return True

    def _lora_ids_in_use(self) -> set[int]:
        """The adapters of the requests still to run a step: scheduled, waiting, compiling
        their grammar."""
        requests = [*self.scheduler.requests.values()]
        requests += [request for request, _ in self._compiling.values()]
        return {r.lora_id for r in requests if r.lora_id}

    def _drop_unused_loras(self) -> None:
        """Removes from the workers the adapters removed while requests ran them, once none
        does (and no step in flight may)."""
        if self._batches:
            return
        in_use = self._lora_ids_in_use()
        for lora_id in [i for i in self._loras_leaving if i not in in_use]:
            del self._loras_leaving[lora_id]
            self.executor.collective_rpc("remove_lora", args=(lora_id,), timeout=_LORA_RPC_S)

    def list_loras(self) -> list[int]:
        """The adapters added (by lora_int_id)."""
        return sorted(self.loras)

    def reset_prefix_cache(self) -> bool:
        """Forgets the cached prefixes; False (with a warning, nothing cleared) while
        requests are running, as vLLM refuses."""
        if self.scheduler.reset_prefix_cache():
            return True
        logger.warning("reset_prefix_cache refused: some KV blocks are still in use")
        return False

    def shutdown(self) -> None:
        self.structured.shutdown()
        self.executor.shutdown()


def _runner_mismatch(request: EngineCoreRequest, model: ModelConfig) -> str | None:
    """Why a request cannot run on this model's runner (None: it can): a pooling model pools
    and never samples, a generative one the reverse."""
    if model.runner_type == "pooling":
        if request.pooling_params is None:
            return "this is a pooling model (runner='pooling'): it takes pooling_params only"
        dims = request.pooling_params.dimensions
        if dims is not None and not 1 <= dims <= model.hidden_size:
            return f"pooling_params.dimensions={dims} is outside [1, {model.hidden_size}]"
        return None
    if request.pooling_params is not None:
        return "this is a generative model (runner='generate'): it takes sampling_params only"
    return None


def speculates(out: SchedulerOutput) -> bool:
    """Whether a step proposes or verifies tokens: under async scheduling the next step is
    scheduled only once it is updated (a step scheduled before would not know its tokens)."""
    return out.propose or bool(out.scheduled_spec_decode_tokens)


def summarize(out: SchedulerOutput) -> str:
    """One line on what a step ran, for the log of a step that failed."""
    new = [
        (r.req_id, len(r.prompt_token_ids), r.num_computed_tokens) for r in out.scheduled_new_reqs
    ]
    cached = out.scheduled_cached_reqs
    return (
        f"{out.total_num_scheduled_tokens} tokens for {len(out.num_scheduled_tokens)} requests; "
        f"new (id, prompt tokens, cached tokens): {new[:8]}{' ...' if len(new) > 8 else ''}; "
        f"running: {len(cached.req_ids)} (first {cached.req_ids[:8]}); tokens per request: "
        f"{dict(list(out.num_scheduled_tokens.items())[:16])}; finished {out.finished_req_ids}, "
        f"preempted {out.preempted_req_ids}"
    )


class _Batch(NamedTuple):
    """A step submitted to the executor and not yet updated."""

    scheduler_output: SchedulerOutput
    future: Future
    submitted: float  # perf_counter() when it was submitted
    forward_number: int  # its number among the steps with tokens, from 1 (0: none)


class _StepStats:
    """Throughput counters for the periodic one-line log while the engine is busy."""

    def __init__(self) -> None:
        self.interval = envs.TOKENMILL_LOG_STATS_INTERVAL
        self.last_log = time.monotonic()
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.last_queries = 0
        self.last_hits = 0
        self.last_spec = (0, 0, 0)  # drafts, proposed and accepted tokens at the last log

    def record(self, core: EngineCore, out: SchedulerOutput, outputs: EngineCoreOutputs) -> None:
        generated = sum(len(o.new_token_ids) for o in outputs.outputs)
        self.generated_tokens += generated
        # Scheduled tokens: prompt tokens, one per request that samples, verified proposals.
        proposed = sum(len(t) for t in out.scheduled_spec_decode_tokens.values())
        sampled = sum(1 for o in outputs.outputs if o.new_token_ids)
        self.prompt_tokens += max(0, out.total_num_scheduled_tokens - proposed - sampled)
        now = time.monotonic()
        elapsed = now - self.last_log
        if elapsed < self.interval:
            return
        stats = core.get_stats()
        queries = int(stats["prefix_cache_queries"]) - self.last_queries
        hits = int(stats["prefix_cache_hits"]) - self.last_hits
        caching = core.scheduler.kv_cache_manager.enable_caching
        line = stats_line(
            self.prompt_tokens / elapsed,
            self.generated_tokens / elapsed,
            stats,
            None if not caching else hits / queries if queries else 0.0,
        )
        if "spec_decode_num_drafts" in stats and core.config.speculative_config is not None:
            spec = (
                int(stats["spec_decode_num_drafts"]),
                int(stats["spec_decode_num_draft_tokens"]),
                int(stats["spec_decode_num_accepted_tokens"]),
            )
            drafts, proposed, accepted = (a - b for a, b in zip(spec, self.last_spec))
            line += ", " + spec_line(drafts, proposed, accepted)
            self.last_spec = spec
        logger.info("%s", line)
        self.last_log, self.prompt_tokens, self.generated_tokens = now, 0, 0
        self.last_queries += queries
        self.last_hits += hits


def spec_line(drafts: int, proposed: int, accepted: int) -> str:
    """Speculative decoding since the last line: vLLM's acceptance rate (accepted / proposed
    tokens) and mean acceptance length (tokens per verifying step, the bonus counted)."""
    if not drafts:
        return "speculation off"
    return (
        f"spec acceptance {accepted / proposed:.1%}, mean acceptance length "
        f"{1 + accepted / drafts:.2f}, {drafts} drafts"
    )


def stats_line(
    prompt_rate: float, generation_rate: float, stats: dict, hit_rate: float | None
) -> str:
    """The busy engine's periodic one-line summary; `hit_rate` None: prefix caching is off."""
    cache = "prefix caching off" if hit_rate is None else f"prefix cache hit rate {hit_rate:.1%}"
    return (
        f"prompt {prompt_rate:.1f} tok/s, generation {generation_rate:.1f} tok/s, "
        f"running {stats['num_running']}, waiting {stats['num_waiting']}, "
        f"KV usage {stats['kv_cache_usage']:.1%}, {cache}"
    )
