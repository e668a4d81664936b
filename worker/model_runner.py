"""The ModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

Per step: update the persistent batch from the diff, lay the scheduled tokens out flat
(decodes first, then prefill chunks), build input ids, positions, slot mapping and the
attention metadata, run the model, compute logits only for requests whose prompt is now
fully computed, and sample. Owns the model, the KV cache tensors and the sampler.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from tokenmill.protocol import envs
from tokenmill.protocol.config import EngineConfig
from tokenmill.protocol.messages import LogprobsArrays
from tokenmill.protocol.scheduler_output import KVCacheSpec, ModelRunnerOutput, SchedulerOutput
from tokenmill.protocol.threads import OrderedThread
from tokenmill.protocol.utils import cdiv
from tokenmill.worker.attention.base import AttentionBackend, StepAttentionInputs, cache_torch_dtype
from tokenmill.worker.attention.registry import backend_class
from tokenmill.worker.draft_model import DraftModel
from tokenmill.worker.forward_context import set_forward_context
from tokenmill.worker.input_batch import InputBatch
from tokenmill.worker.layers.custom_op import layer_kernels
from tokenmill.worker.model_loader import get_model
from tokenmill.worker.platform import platform_of, zeroed_tensor
from tokenmill.worker.sampler import Sampler, SamplingMetadata
from tokenmill.worker.spec_decode import NgramProposer, ranks_within, rejection_sample
from tokenmill.worker.staging import HostStaging, to_device

T = TypeVar("T")

if TYPE_CHECKING:  # imports triton
    from tokenmill.worker.cuda_graph import DecodeGraphs

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.platform = platform_of(device)
        self.dtype = getattr(torch, config.model_config.dtype)
        self.cache_dtype = cache_torch_dtype(config.cache_config.cache_dtype, self.dtype)
        self.block_size = config.cache_config.block_size
        self.use_triton = config.device_config.attention_backend == "TRITON_ATTN"
        self.attn_backend = make_attention_backend(config, device)
        self.model: torch.nn.Module | None = None
        self.long_rope: tuple[int, int] | None = None  # set once the model is loaded
        self.kv_caches: list[torch.Tensor] = []
        self.input_batch: InputBatch | None = None
        self.decode_graphs: DecodeGraphs | None = None
        self.staging = HostStaging(device, torch.int64)  # the host's part of a step
        self.ids_staging = HostStaging(device, torch.int64)  # the device's part: input tokens
        self.step_timing = envs.TOKENMILL_STEP_TIMING
        self.sampler = Sampler(torch.Generator(device).manual_seed(config.model_config.seed))
        spec = config.speculative_config
        self.proposer: NgramProposer | None = None
        self.drafter: DraftModel | None = None
        if spec is not None and spec.method == "draft_model":
            self.drafter = DraftModel(config, device, make_attention_backend)
        elif spec is not None:
            assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
            self.proposer = NgramProposer(
                spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
            )
        # Called as each step's forward starts (the in-process executor's async scheduling
        # times the core's work to it; see UniProcExecutor).
        self.on_forward: Callable[[], None] | None = None
        # Steps overlapped (async scheduling, submit_model): the thread that runs the steps'
        # device parts, and the last step submitted. Only where the forward leaves the CPU
        # free (CUDA): on the CPU the forward needs every core.
        overlap = envs.TOKENMILL_OVERLAP_STEPS
        self.overlap_steps = config.scheduler_config.async_scheduling and (
            self.platform.overlaps_steps if overlap is None else overlap
        )
        self._device_thread: OrderedThread | None = None
        if self.overlap_steps:
            self._device_thread = OrderedThread("device", self.platform.thread_setup(device))
        self._in_flight: _Step | None = None

    def on_device(self, fn: Callable[[], T]) -> T:
        """Runs fn (loading, profiling, allocating the cache) on the device thread when steps
        overlap, so that one thread runs all the heavy torch work. On the CPU a second thread
        running parallel ops would give libgomp more threads than cores, and its threads then
        sleep between parallel regions instead of spinning: a small op costs about 5x."""
        if self._device_thread is None:
            return fn()
        return self._device_thread.submit(fn).result()

    def load_model(self) -> None:
        resident = self.platform.resident_bytes(self.device)
        start = time.perf_counter()
        with layer_kernels(self.layer_kernels()):
            self.model = get_model(self.config, self.device, self.attn_backend)
            if self.drafter is not None:
                self.drafter.load()
        # LongRoPE's (threshold, offset of the long rotary rows), see _rope_positions.
        self.long_rope = getattr(self.model, "long_rope", None)
        self.platform.after_load()
        self.model_memory = {
            "weights_bytes": model_tensor_bytes(self.model),
            "load_bytes": self.platform.resident_bytes(self.device) - resident,
        }
        logger.info(
            "Model loading took %.1f MiB (weights %.1f MiB) and %.1f s",
            self.model_memory["load_bytes"] / 2**20,
            self.model_memory["weights_bytes"] / 2**20,
            time.perf_counter() - start,
        )

    def layer_kernels(self) -> str:
        """Which implementation the model's layers run (see worker/layers/custom_op.py)."""
        if self.use_triton:
            return "triton"
        # The CPU kernels take fp32 and bf16 (fp16 runs on the torch path).
        own = self.platform.cpu_kernels() and self.dtype in (torch.float32, torch.bfloat16)
        return "cpu" if own else "native"

    def get_kv_cache_specs(self) -> list[KVCacheSpec]:
        """Every attention layer's needs: the target's, then the draft model's (whose cache
        has as many blocks)."""
        drafts = [] if self.drafter is None else self.drafter.kv_cache_specs()
        return self._target_kv_cache_specs() + drafts

    def _target_kv_cache_specs(self) -> list[KVCacheSpec]:
        assert self.model is not None
        layers = self.model.attention_layers()
        return [a.kv_cache_spec(self.block_size, self.cache_dtype) for a in layers]

    def initialize_kv_cache(self, config: EngineConfig, num_blocks: int) -> None:
        """Allocates the cache under the config as the core settled it (its max_model_len
        sizes the persistent batch)."""
        assert self.model is not None
        self.config = config
        self.attn_backend.set_block_bytes(
            max(spec.page_size_bytes for spec in self._target_kv_cache_specs())
        )
        self.kv_caches = []
        for attn in self.model.attention_layers():
            # Zeroed: attention reads whole blocks, including slots not yet written (masked
            # out, but NaN garbage would survive the masking).
            shape = self.attn_backend.kv_cache_shape(
                num_blocks, self.block_size, attn.num_kv_heads, attn.head_size
            )
            cache = zeroed_tensor(shape, self.cache_dtype, self.device)
            attn.kv_cache = cache
            self.kv_caches.append(cache)
        if self.drafter is not None:
            self.kv_caches += self.drafter.allocate(num_blocks, zeroed_tensor)
        self.platform.commit(self.kv_caches)
        self.input_batch = InputBatch(
            config.scheduler_config.max_num_seqs,
            config.model_config.max_model_len,
            self.block_size,
            self.config.model_config.vocab_size,
            self.device,
        )
        device_config = config.device_config
        if self.platform.has_graphs and self.use_triton and not device_config.enforce_eager:
            self.enable_decode_graphs(capture=True)

    def enable_decode_graphs(self, capture: bool) -> None:
        """Decode-only steps run at padded batch sizes from persistent buffers, replayed from
        CUDA graphs captured now (capture=False: the same buffers, run eagerly)."""
        from tokenmill.worker.cuda_graph import DecodeGraphs

        assert self.model is not None and self.attn_backend.captures_steps, (
            f"CUDA graphs need a backend that captures steps (TRITON_ATTN), not "
            f"{self.attn_backend.name}"
        )
        sched = self.config.scheduler_config
        largest = min(sched.max_num_seqs, sched.max_num_batched_tokens)
        sizes = [s for s in self.config.device_config.cudagraph_capture_sizes if s <= largest]
        if not sizes:
            return
        spec = self.config.speculative_config
        verify_len = 1 if spec is None else 1 + spec.num_speculative_tokens
        # A verify shape's padded rows read up to verify_len - 1 keys past the request's own.
        max_len = self.config.model_config.max_model_len + verify_len - 1
        self.decode_graphs = DecodeGraphs(
            self.model, self.attn_backend, sizes, cdiv(max_len, self.block_size), self.device,
            capture, verify_len=verify_len, max_tokens=sched.max_num_batched_tokens,
        )  # fmt: skip
        self.decode_graphs.capture()

    @torch.inference_mode()
    def profile_run(self) -> None:
        """Runs the largest steps the scheduler may send before the KV cache exists, so that
        the device's peak memory includes their activations and scratch: a full token budget
        of prefill, then max_num_seqs decodes with long contexts (the attention backend's
        per-step scratch grows with them), then logits and sampling for max_num_seqs rows.
        Every attention layer gets a one-block stand-in cache that all slots map to."""
        assert self.model is not None
        sched = self.config.scheduler_config
        max_pos = self.config.model_config.max_position_embeddings
        num_tokens = sched.max_num_batched_tokens
        num_decodes = min(sched.max_num_seqs, num_tokens)
        # The Triton backend's decode scratch grows with the context (up to its split limit);
        # the torch backend's with the contexts' total, which the KV cache bounds, not this.
        context = self.block_size
        if self.use_triton:
            context = min(self.config.model_config.max_model_len, _PROFILE_DECODE_CONTEXT)
        steps = [
            ([num_tokens], [num_tokens], 0),  # one long prefill
            ([1] * num_decodes, [context] * num_decodes, num_decodes),  # decodes only
        ]
        # A draft model runs the same shapes (its catch-up forwards take at most the token
        # budget, its proposal steps one token per request), after the target's.
        models = [(self.model, self.attn_backend, max_pos)]
        if self.drafter is not None:
            assert self.drafter.model is not None
            draft_pos = self.drafter.config.model_config.max_position_embeddings
            models.append((self.drafter.model, self.drafter.backend, draft_pos))
        for model, backend, positions in models:
            layers = model.attention_layers()
            for attn in layers:
                attn.kv_cache = torch.zeros(
                    (1, 2, self.block_size, attn.num_kv_heads, attn.head_size),
                    dtype=self.dtype,
                    device=self.device,
                )
            try:
                for query_lens, seq_lens, decodes in steps:
                    total = sum(query_lens)
                    inputs = StepAttentionInputs(
                        num_decodes=decodes,
                        query_lens=np.array(query_lens),
                        seq_lens=np.array(seq_lens),
                        block_table=np.zeros(
                            (len(seq_lens), cdiv(max(seq_lens), self.block_size)), dtype=np.int64
                        ),
                        slot_mapping=np.zeros(total, dtype=np.int64),
                        block_size=self.block_size,
                        device=self.device,
                        dtype=self.dtype,
                    )
                    with set_forward_context(backend.build_metadata(inputs)):
                        out = model(
                            torch.zeros(total, dtype=torch.long, device=self.device),
                            torch.arange(total, device=self.device) % positions,
                        )
                    if model is self.model:
                        hidden = out
            finally:
                for attn in layers:
                    attn.kv_cache = torch.empty(0)
        rows = min(sched.max_num_seqs, hidden.shape[0])
        logits = self.model.compute_logits(hidden[:rows])
        self.sampler(logits, _profile_sampling_metadata(rows, self.device))

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Runs a step in turn: prepares it, runs it and returns its outputs."""
        step = self._prepare(out, defer_free=False)
        return _empty_output() if step is None else self._run_step(step)

    def submit_model(self, out: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Prepares a step on this thread and queues the rest (forward, sampling, outputs) on
        the runner's device thread, so that the next step's preparation overlaps this one's
        forward (async scheduling). Sampled tokens never leave the worker: a step takes its
        input tokens from the batch's record when its device part starts, after the step
        before appended its own."""
        batch = self.input_batch
        assert batch is not None, "initialize_kv_cache() first"
        assert self._device_thread is not None, "steps overlap only with async scheduling"
        last = self._in_flight
        running = False
        if last is not None:
            # It no longer reads what this step's apply() changes.
            self._wait_for_device(last.inputs_taken.wait)
            running = not last.future.done()
            if running and len(out.scheduled_new_reqs) > batch.num_reusable_rows():
                # The rows it still writes are needed now.
                self._wait_for_device(lambda t: not wait([last.future], t).not_done)
                running = False
        step = self._prepare(out, defer_free=running)
        if step is None:
            future: Future[ModelRunnerOutput] = Future()
            future.set_result(_empty_output())
            return future
        step.future = self._device_thread.submit(lambda: self._run_step(step))
        self._in_flight = step
        return step.future

    def _wait_for_device(self, done: Callable[[float], bool]) -> None:
        """Waits for done(timeout) to hold, a second at a time, for as long as the device
        thread lives (a step may rightly take long; a thread that ended never answers)."""
        while not done(1.0):
            if self._device_thread is None or not self._device_thread.alive():
                raise RuntimeError("the model runner's device thread has ended")

    def close(self, wait: float = 0.0) -> bool:
        """Ends the device thread after the steps already queued, waiting up to `wait`
        seconds for them; returns whether it has ended."""
        thread, self._device_thread = self._device_thread, None
        return thread is None or thread.close(wait)

    @torch.inference_mode()
    def _prepare(self, out: SchedulerOutput, defer_free: bool) -> _Step | None:
        """The host's part of a step: the batch brought up to date and everything the forward
        needs but the input tokens (positions, slots, attention metadata). defer_free: a step
        still running may write rows that this apply frees, so they are reused a step later."""
        batch = self.input_batch
        assert batch is not None and self.model is not None, "initialize_kv_cache() first"
        timer = _StepTimer(self.device) if self.step_timing else None
        batch.apply(out, defer_free)
        if out.total_num_scheduled_tokens == 0:
            return None

        # Decodes (one new token) first, by context length so that the attention backend's
        # decode groups pad little; then prefill chunks in schedule order.
        scheduled = out.num_scheduled_tokens
        row_of, computed = batch.row_of, batch.num_computed_tokens
        req_ids = sorted(
            scheduled,
            key=lambda r: (scheduled[r] != 1, computed[row_of[r]] if scheduled[r] == 1 else 0),
        )
        rows = np.fromiter((batch.row_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        query_lens = np.fromiter(
            (out.num_scheduled_tokens[r] for r in req_ids), dtype=np.int64, count=len(req_ids)
        )
        starts = batch.num_computed_tokens[rows]
        seq_lens = starts + query_lens
        spec = out.scheduled_spec_decode_tokens
        num_drafts = np.zeros(len(req_ids), dtype=np.int64)
        for i, req_id in enumerate(req_ids if spec else ()):
            drafts = spec.get(req_id)
            if drafts:  # after the request's last token: its input for this step
                row, n = rows[i], batch.num_tokens[rows[i]]
                batch.token_ids[row, n : n + len(drafts)] = drafts
                num_drafts[i] = len(drafts)
        cu_query = np.concatenate(([0], np.cumsum(query_lens)))
        total = int(cu_query[-1])
        token_rows = np.repeat(rows, query_lens)
        positions = np.arange(total) - np.repeat(cu_query[:-1] - starts, query_lens)
        bs = self.block_size
        slot_mapping = batch.block_table[token_rows, positions // bs] * bs + positions % bs
        rope_positions = self._rope_positions(positions, token_rows)

        # Requests produce a token this step unless the scheduler says their step is part of
        # a prompt, from the hidden state of their last token (when every token is one, no
        # gather is needed).
        done = np.ones(len(req_ids), dtype=bool)
        if out.partial_req_ids:
            partial = set(out.partial_req_ids)
            done[[i for i, r in enumerate(req_ids) if r in partial]] = False
        # The hidden states that give logits: each sampling request's last, and before it
        # one per proposed token it verifies.
        num_drafts_all, num_drafts = num_drafts, num_drafts[done]
        last_token = np.repeat(cu_query[1:][done], num_drafts + 1) - 1
        if num_drafts.any():
            last_token -= np.repeat(num_drafts, num_drafts + 1) - ranks_within(num_drafts + 1)
        gather = len(last_token) not in (0, total)

        num_decodes = int(np.count_nonzero(query_lens == 1))
        block_table = batch.block_table[rows, : cdiv(int(seq_lens.max()), bs)]
        step = _Step(
            out=out,
            req_ids=req_ids,
            rows=rows,
            token_rows=token_rows,
            positions=positions,
            rope_positions=rope_positions,
            done=done,
            sample_rows=np.repeat(rows[done], num_drafts + 1),
            num_drafts=num_drafts if num_drafts.any() else None,
            prompt_logprobs=self._prompt_logprob_chunks(rows, starts, cu_query),
            timer=timer,
        )
        # Decodes, each with the proposals it verifies and nothing else: a captured shape.
        graphs = self.decode_graphs
        shape = None
        if graphs is not None and np.array_equal(query_lens, num_drafts_all + 1):
            shape = graphs.shape_for(query_lens)
        if shape is not None:
            step.graph_inputs = (shape, query_lens, slot_mapping, seq_lens, block_table)
            last_token_t, step.sample_rows_t = self.staging.to_device(last_token, step.sample_rows)
            step.last_token_t = last_token_t if gather else None
        else:
            attn_inputs = StepAttentionInputs(
                num_decodes=num_decodes,
                query_lens=query_lens,
                seq_lens=seq_lens,
                block_table=block_table,
                slot_mapping=slot_mapping,
                block_size=bs,
                device=self.device,
                dtype=self.dtype,
            )
            step.attn_metadata = self.attn_backend.build_metadata(attn_inputs)
            step.positions_t, last_token_t, step.sample_rows_t = self.staging.to_device(
                rope_positions, last_token, step.sample_rows
            )
            step.last_token_t = last_token_t if gather else None
        batch.num_computed_tokens[rows] = seq_lens
        if timer is not None:
            timer.lap("prepare", synchronize=False)
        return step

    def _rope_positions(self, positions: np.ndarray, token_rows: np.ndarray) -> np.ndarray:
        """The rows of the rotary table each token rotates by: its position, except with
        LongRoPE, where a token takes the long frequencies' rows (`offset` further) when its
        position reaches the threshold or its request's prompt is longer than it, as HF
        rotates a sequence's forward once the sequence passes the threshold."""
        if self.long_rope is None:
            return positions
        threshold, offset = self.long_rope
        batch = self.input_batch
        assert batch is not None
        long = (positions >= threshold) | (batch.num_prompt_tokens[token_rows] > threshold)
        return positions + offset * long

    @torch.inference_mode()
    def _run_step(self, step: _Step) -> ModelRunnerOutput:
        """The device's part of a step: input tokens, forward, sampling, outputs. Steps run
        this in order; each reads the batch's token record after the one before wrote it.
        The platform may adapt the step's threads (the CPU's to contention for its cores)."""
        with self.platform.step_threads():
            return self._run_step_body(step)

    def _run_step_body(self, step: _Step) -> ModelRunnerOutput:
        batch = self.input_batch
        assert batch is not None and self.model is not None
        timer = step.timer
        if timer is not None:
            timer.restart()  # the time queued behind the step before is not this step's
        sample_rows = step.sample_rows
        try:
            input_ids = batch.token_ids[step.token_rows, step.positions]
            ranks = None if step.num_drafts is None else ranks_within(step.num_drafts + 1)
            meta = (
                batch.sampling_metadata(sample_rows, step.sample_rows_t, ranks)
                if len(sample_rows)
                else None
            )
            wants = [i for i, r in enumerate(sample_rows.tolist()) if r in batch.num_logprobs]
            top_k = max((batch.num_logprobs[int(sample_rows[i])] for i in wants), default=0)
        finally:
            step.inputs_taken.set()

        if step.graph_inputs is not None:
            graphs = self.decode_graphs
            assert graphs is not None
            if timer is not None:
                timer.lap("prepare")  # the copies into the graph's buffers count as forward
            if self.on_forward is not None:
                self.on_forward()
            shape, query_lens, *attn = step.graph_inputs
            hidden = graphs.run(shape, query_lens, input_ids, step.rope_positions, *attn)
        else:
            ids_t = self.ids_staging.to_device(input_ids)[0]
            if timer is not None:
                timer.lap("prepare")
            if self.on_forward is not None:
                self.on_forward()
            with set_forward_context(step.attn_metadata):
                hidden = self.model(ids_t, step.positions_t)
        if timer is not None:
            timer.lap("forward")

        req_ids = step.req_ids
        sampled_ids: list[list[int]] = [[] for _ in req_ids]
        spec_token_ids: dict[str, list[int]] = {}
        logprobs, logprobs_req_ids = None, []
        prompt_logprobs = {}
        for i, at, targets, k in step.prompt_logprobs:
            logits = self.model.compute_logits(hidden[at[0] : at[1]])
            targets_t = to_device(targets, hidden.device)
            prompt_logprobs[req_ids[i]] = compute_logprobs(logits, targets_t, k)
        if meta is not None:
            at = step.last_token_t
            logits = self.model.compute_logits(hidden if at is None else hidden[at])
            if timer is not None:
                timer.lap("logits")
            sampling = np.flatnonzero(step.done).tolist()  # positions in req_ids
            num_drafts = step.num_drafts
            # Per row of logits: the position in req_ids of the request it samples for.
            owners = sampling if num_drafts is None else np.repeat(sampling, num_drafts + 1)
            if step.out.grammar_req_ids:
                apply_grammar_bitmask(logits, [req_ids[i] for i in owners], step.out)
            if num_drafts is None:
                sampled = self.sampler(logits, meta)
                token_lists = [[t] for t in sampled.cpu().tolist()]
            else:
                drafts = step.out.scheduled_spec_decode_tokens
                draft_ids = [t for i in sampling for t in drafts.get(req_ids[i], ())]
                token_lists = rejection_sample(
                    self.sampler, logits, meta, num_drafts, np.array(draft_ids, dtype=np.int64)
                )
                # Per row, the token it emitted: a request's first rows emit its accepted
                # proposals, the next its last token; rows after that emit nothing.
                emitted = np.zeros(len(owners), dtype=np.int64)
                emits = np.zeros(len(owners), dtype=bool)
                at = 0
                for tokens, k in zip(token_lists, num_drafts.tolist()):
                    emitted[at : at + len(tokens)] = tokens
                    emits[at : at + len(tokens)] = True
                    at += k + 1
                sampled = to_device(emitted, logits.device)
                wants = [i for i in wants if emits[i]]  # logprobs: one row per emitted token
            if wants:  # from the raw logits, before any adjustment
                at_t = to_device(wants, logits.device)
                logprobs = compute_logprobs(logits[at_t], sampled[at_t], top_k)
                logprobs_req_ids = [req_ids[owners[i]] for i in wants]
            request_rows = sample_rows if num_drafts is None else step.rows[step.done]
            batch.append_token_lists(request_rows, token_lists)
            for i, tokens in zip(sampling, token_lists):
                sampled_ids[i] = tokens
            if step.out.propose and (self.proposer is not None or self.drafter is not None):
                spec_token_ids = self._propose(req_ids, sampling, request_rows)
        step_times = None
        if timer is not None:
            timer.lap("sample")
            step_times = timer.times
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=sampled_ids,
            step_times=step_times,
            logprobs_req_ids=logprobs_req_ids,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            spec_token_ids=spec_token_ids,
        )

    def _propose(
        self, req_ids: list[str], sampling: list[int], rows: np.ndarray
    ) -> dict[str, list[int]]:
        """The proposals (n-gram or draft model) for the requests that sampled. Every one
        may speculate: the sampler adjusts each verified position's logits by what comes
        before it, proposed tokens included (penalties, bad words, min_tokens, a grammar's
        mask from the core)."""
        batch = self.input_batch
        assert batch is not None
        eligible = list(zip(sampling, rows.tolist()))
        if not eligible:
            return {}
        at = np.array([row for _, row in eligible], dtype=np.int64)
        if self.drafter is not None:
            lists = self.drafter.propose(
                batch,
                at,
                self.config.model_config.max_model_len,
                self.config.scheduler_config.max_num_batched_tokens,
            )
        else:
            assert self.proposer is not None
            num_tokens = batch.num_tokens[at]
            tokens = batch.token_ids[at, : int(num_tokens.max())]
            lists = self.proposer.propose_batch(tokens, num_tokens)
        return {req_ids[i]: p for (i, _), p in zip(eligible, lists) if p}

    def _prompt_logprob_chunks(
        self, rows: np.ndarray, starts: np.ndarray, cu_query: np.ndarray
    ) -> list[tuple[int, tuple[int, int], np.ndarray, int]]:
        """For the requests asking for prompt logprobs: each prompt position of this step's
        chunk but the prompt's last predicts the next prompt token. Per such request: its
        position in the step, its span of hidden states, the prompt tokens they predict, and
        the top k asked for."""
        batch = self.input_batch
        assert batch is not None
        chunks = []
        for i, row in enumerate(rows.tolist()):
            k = batch.num_prompt_logprobs.get(row)
            if k is None:
                continue
            start = int(starts[i])
            last = int(batch.num_prompt_tokens[row]) - 1  # the last position that scores one
            end = min(start + int(cu_query[i + 1] - cu_query[i]), last)
            if end >= last:
                del batch.num_prompt_logprobs[row]  # the prompt is done
            if end <= start:
                continue
            targets = batch.token_ids[row, start + 1 : end + 1].copy()
            chunks.append((i, (int(cu_query[i]), int(cu_query[i]) + end - start), targets, k))
        return chunks


def apply_grammar_bitmask(
    logits: torch.Tensor, sampled_req_ids: list[str], out: SchedulerOutput
) -> None:
    """Masks, in place, the logits of the structured-output rows down to the tokens their
    grammar allows (the core's packed bitmask: bit j of word w is token 32 * w + j)."""
    assert out.grammar_bitmask is not None
    # The n-th bitmask row of a request goes to its n-th row of logits.
    rows_of: dict[str, list[int]] = {}
    for i, req_id in enumerate(sampled_req_ids):
        rows_of.setdefault(req_id, []).append(i)
    next_row = {r: iter(rows) for r, rows in rows_of.items()}
    pairs = [(next(next_row[r]), i) for i, r in enumerate(out.grammar_req_ids) if r in next_row]
    if not pairs:
        return
    at = [p for p, _ in pairs]
    words = np.ascontiguousarray(out.grammar_bitmask[[i for _, i in pairs]], dtype=np.int32)
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
    allowed = to_device(bits[:, : logits.shape[-1]].astype(bool), logits.device)
    index = to_device(at, logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def compute_logprobs(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> LogprobsArrays:
    """Log-softmax of fp32 logits [N, V]: each row's chosen token, its rank (how many tokens
    are at least as likely, itself included, as vLLM counts) and the top k."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = chosen.long().unsqueeze(1)
    chosen_lp = logprobs.gather(1, chosen)
    ranks = (logprobs >= chosen_lp).sum(dim=-1)
    if k > 0:
        top = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        chosen = torch.cat((chosen, top.indices), dim=1)
        chosen_lp = torch.cat((chosen_lp, top.values), dim=1)
    return LogprobsArrays(
        token_ids=chosen.to(torch.int32).cpu().numpy(),
        logprobs=chosen_lp.cpu().numpy(),
        ranks=ranks.to(torch.int32).cpu().numpy(),
    )


# Context length of the profiled decode step (its scratch stops growing well before this).
_PROFILE_DECODE_CONTEXT = 8192


def make_attention_backend(config: EngineConfig, device: torch.device) -> AttentionBackend:
    """The configured backend (registry.py). Triton on the CPU runs in Triton's interpreter
    (for tests: it is slow), which must be chosen before any kernel module is imported.
    CPU_ATTN gives way to TORCH_SDPA, with a log line, where tokenmill's CPU kernels are not in
    use or do not take the model's dtype."""
    platform = platform_of(device)
    name = config.device_config.attention_backend
    dtype = getattr(torch, config.model_config.dtype)
    if name == "TRITON_ATTN":
        if platform.triton_interpreted and os.environ.get("TRITON_INTERPRET") != "1":
            # The choice is the process's: made here it would also send the CUDA kernels of a
            # process that has a GPU (and its child processes) to the interpreter.
            if torch.cuda.is_available():
                raise ValueError(
                    f"attention_backend='TRITON_ATTN' with device={device.type!r} runs in "
                    "Triton's interpreter, which a process with a GPU must choose before it "
                    "starts (TRITON_INTERPRET=1); or use device='cuda'"
                )
            os.environ["TRITON_INTERPRET"] = "1"
        backend = backend_class(name)
        model, tp = config.model_config, config.parallel_config.tensor_parallel_size
        kv_heads = max(1, model.num_kv_heads // tp)  # replicated when fewer than the ranks
        return backend(model.num_attention_heads // tp, kv_heads, model.head_size, device, dtype)
    if name == "CPU_ATTN":
        if not platform.cpu_kernels():
            logger.info("attention_backend CPU_ATTN needs tokenmill's CPU kernels: TORCH_SDPA runs")
        elif dtype not in backend_class(name).dtypes:
            logger.info("attention_backend CPU_ATTN takes fp32 and bf16, not %s: TORCH_SDPA runs",
                        config.model_config.dtype)  # fmt: skip
        else:
            return backend_class(name)()
    # On a GPU every decode goes into one attention call; on the CPU into cache-sized groups.
    return backend_class("TORCH_SDPA")(platform.decode_group_bytes())


def model_tensor_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor the model holds: parameters and buffers, and the run-time forms
    quantized layers keep beside them (`qweight`, GGUF rows), each storage once."""
    seen: set[tuple[int, int]] = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        try:
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        except NotImplementedError:  # an opaque tensor (oneDNN's packed weights): no storage
            key = (id(t), t.numel() * t.element_size())
        if key not in seen and key[1]:
            seen.add(key)
            total += key[1]

    for module in model.modules():
        for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            add(t)
        for name in ("qweight", "gguf_rows", "gguf_packed"):
            held = getattr(module, name, None)
            if isinstance(held, torch.Tensor):
                add(held)
            elif held is not None:
                for value in vars(held).values():
                    if isinstance(value, torch.Tensor):
                        add(value)
    return total


def _profile_sampling_metadata(rows: int, device: torch.device) -> SamplingMetadata:
    # Top-k and top-p on every row: the sampler's most memory-hungry path.
    return SamplingMetadata(
        temperature=torch.ones(rows, device=device),
        all_greedy=False,
        top_k=torch.full((rows,), 50, dtype=torch.long, device=device),
        top_p=torch.full((rows,), 0.9, device=device),
        min_p=None,
        generators={},
        banned_token_ids={},
    )


@dataclass(eq=False)
class _Step:
    """A step as the host prepared it (ModelRunner._prepare), for its device part."""

    out: SchedulerOutput
    req_ids: list[str]  # in the step's order
    rows: np.ndarray  # the batch's rows, in that order
    token_rows: np.ndarray  # per scheduled token: its row and position
    positions: np.ndarray
    rope_positions: np.ndarray  # the rotary table's row per token (LongRoPE: see above)
    done: np.ndarray  # per request: whether it samples this step
    sample_rows: np.ndarray  # per row of logits: its batch row
    # per sampling request (in req_ids order): the proposed tokens it verifies; None: none
    num_drafts: np.ndarray | None
    prompt_logprobs: list[tuple[int, tuple[int, int], np.ndarray, int]]
    timer: _StepTimer | None
    # Either the decode graphs' inputs (the captured shape, query lengths, slot mapping,
    # sequence lengths, block table), or the attention metadata and positions on the device.
    graph_inputs: tuple | None = None
    attn_metadata: object = None
    positions_t: torch.Tensor | None = None
    last_token_t: torch.Tensor | None = None  # rows of the hidden states that sample
    sample_rows_t: torch.Tensor | None = None  # sample_rows on the device
    # Set once the device part has read the batch (the next step may then change it).
    inputs_taken: threading.Event = field(default_factory=threading.Event)
    future: Future | None = None


def _empty_output() -> ModelRunnerOutput:
    return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])


class _StepTimer:
    """Wall time of a step's stages; the device is synchronized at every lap, so that a
    stage's queued kernels count where they were launched."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.platform = platform_of(device)
        self.times: dict[str, float] = {}
        self.last = time.perf_counter()

    def restart(self) -> None:
        self.last = time.perf_counter()

    def lap(self, stage: str, synchronize: bool = True) -> None:
        if synchronize:
            self.platform.synchronize(self.device)
        now = time.perf_counter()
        self.times[stage] = self.times.get(stage, 0.0) + now - self.last
        self.last = now
