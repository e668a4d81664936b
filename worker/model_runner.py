"""The ModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

A step is a pipeline. The host's part, `_prepare`: the persistent batch brought up to date
from the diff, the scheduled tokens laid out flat (decodes first, then prefill chunks;
worker/step.py), positions, slots and the attention metadata. The device's part,
`_run_step`: inputs -> forward -> logits -> sample (or verify proposals) -> logprobs ->
propose, a method per stage, each timed from outside (StageTimes); a pooling model's forward
is followed by its pooling stage instead (worker/pooler.py). Owns the model, the KV cache
tensors, the sampler, the proposer and the pooler.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from tokenmill.kernels.batch_invariant import batch_invariant, set_batch_invariant
from tokenmill.kernels.punica import LoRAMapping
from tokenmill.protocol import envs
from tokenmill.protocol.config import EngineConfig
from tokenmill.protocol.messages import LogprobsArrays
from tokenmill.protocol.scheduler_output import KVCacheSpec, ModelRunnerOutput, SchedulerOutput
from tokenmill.protocol.threads import OrderedThread
from tokenmill.protocol.utils import StageTimes, cdiv
from tokenmill.worker.attention.base import AttentionBackend, cache_torch_dtype
from tokenmill.worker.attention.registry import make_attention_backend
from tokenmill.worker.forward_context import set_forward_context
from tokenmill.worker.input_batch import InputBatch
from tokenmill.worker.layers.custom_op import layer_kernels
from tokenmill.worker.layers.rotary import LongRope
from tokenmill.worker.lora.manager import LoRAManager
from tokenmill.worker.model_loader import get_model
from tokenmill.worker.platform import platform_of
from tokenmill.worker.pooler import Pooler
from tokenmill.worker.proposer import make_proposer
from tokenmill.worker.sampler import Sampler, SamplingMetadata
from tokenmill.worker.spec_decode import ranks_within, rejection_sample
from tokenmill.worker.staging import HostStaging, to_device
from tokenmill.worker.step import (
    GraphInputs,
    PreparedStep,
    PromptLogprobChunk,
    TokenLayout,
    allocate_kv_caches,
    kv_cache_specs,
)

T = TypeVar("T")

if TYPE_CHECKING:  # imports triton
    from tokenmill.worker.cuda_graph import DecodeGraphs

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """What a step's device part reads from the batch before the next step may change it."""

    input_ids: np.ndarray  # [T]
    metadata: SamplingMetadata | None  # None: no request samples this step
    logprob_rows: list[int]  # rows of logits whose tokens want logprobs
    top_logprobs: int  # the most top tokens any of them asks for


@dataclass
class Sampled:
    token_lists: list[list[int]]  # per sampling request: the tokens it emits
    tokens_t: torch.Tensor  # per row of logits: the token it emitted
    logprob_rows: list[int]  # rows of logits that emitted a token wanting logprobs


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.platform = platform_of(device)
        self.dtype = getattr(torch, config.model_config.dtype)
        self.cache_dtype = cache_torch_dtype(config.cache_config.cache_dtype, self.dtype)
        self.block_size = config.cache_config.block_size
        self.use_triton = config.device_config.attention_backend == "TRITON_ATTN"
        # Before anything is built: the kernels read the mode (kernels/batch_invariant.py).
        set_batch_invariant(config.batch_invariant)
        if config.batch_invariant and self.layer_kernels() == "native":
            logger.warning(
                "batch_invariant=True without tokenmill's CPU kernels (or Triton; they take "
                "fp32 and bf16, not %s): the torch path runs, whose results still depend on "
                "the batch",
                config.model_config.dtype,
            )
        self.attn_backend = make_attention_backend(config, device)
        self.model: torch.nn.Module | None = None
        self.long_rope: LongRope | None = None  # set once the model is loaded
        self.lora_manager: LoRAManager | None = None  # the adapters' slots, with enable_lora
        self.kv_caches: list[torch.Tensor] = []
        self.input_batch: InputBatch | None = None
        self.decode_graphs: DecodeGraphs | None = None
        self.staging = HostStaging(device, torch.int64)  # the host's part of a step
        self.ids_staging = HostStaging(device, torch.int64)  # the device's part: input tokens
        self.step_timing = envs.TOKENMILL_STEP_TIMING
        self._synchronize = functools.partial(self.platform.synchronize, device)  # (timing)
        self.sampler = Sampler(torch.Generator(device).manual_seed(config.model_config.seed))
        # A pooling model's last stage instead of logits and sampling.
        pooler_config = config.model_config.pooler_config
        self.pooler = None if pooler_config is None else Pooler(pooler_config)
        self.proposer = make_proposer(config, device)  # speculative decoding's, if any
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
        self._in_flight: PreparedStep | None = None

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
            if self.proposer is not None:
                self.proposer.load()
        # LongRoPE's rule for the rotary table's rows, see _rope_positions.
        self.long_rope = getattr(self.model, "long_rope", None)
        lora = self.config.lora_config
        if lora is not None:
            self.lora_manager = LoRAManager(
                self.model, lora, self.dtype, self.device, self.layer_kernels()
            )
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
        """Every attention layer's needs: the target's, then the proposer's (whose cache has
        as many blocks)."""
        assert self.model is not None
        specs = kv_cache_specs(self.model, self.block_size, self.cache_dtype)
        return specs + ([] if self.proposer is None else self.proposer.kv_cache_specs())

    def initialize_kv_cache(self, config: EngineConfig, num_blocks: int) -> None:
        """Allocates the cache under the config as the core settled it (its max_model_len
        sizes the persistent batch)."""
        assert self.model is not None
        self.config = config
        self.kv_caches = allocate_kv_caches(
            self.model, self.attn_backend, num_blocks, self.block_size, self.cache_dtype,
            self.device,
        )  # fmt: skip
        if self.proposer is not None:
            self.kv_caches += self.proposer.allocate(config, num_blocks)
        self.platform.commit(self.kv_caches)
        self.input_batch = InputBatch(
            config.scheduler_config.max_num_seqs,
            config.model_config.max_model_len,
            self.block_size,
            config.model_config.vocab_size,
            self.device,
        )
        device_config = config.device_config
        # (LoRA steps run eagerly: a graph would hold one step's adapter mapping.)
        if (self.platform.has_graphs and self.use_triton and not device_config.enforce_eager
                and self.lora_manager is None):  # fmt: skip
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
        A proposer's model runs the same shapes after the target's."""
        assert self.model is not None
        sched = self.config.scheduler_config
        num_tokens = sched.max_num_batched_tokens
        num_decodes = min(sched.max_num_seqs, num_tokens)
        # The Triton backend's decode scratch grows with the context (up to its split limit);
        # the torch backend's with the contexts' total, which the KV cache bounds, not this.
        context = self.block_size
        if self.use_triton:
            context = min(self.config.model_config.max_model_len, _PROFILE_DECODE_CONTEXT)
        steps = [  # (query lengths, starts)
            (np.array([num_tokens]), np.array([0])),  # one long prefill
            (np.ones(num_decodes, dtype=np.int64), np.full(num_decodes, context - 1)),
        ]
        max_pos = self.config.model_config.max_position_embeddings
        hidden = self._profile_forwards(self.model, self.attn_backend, max_pos, steps)
        proposers = [] if self.proposer is None else self.proposer.profiled_models()
        for model, backend, positions in proposers:
            self._profile_forwards(model, backend, positions, steps)
        if self.pooler is not None:
            return  # (no logits: the pooled vectors are a row per request)
        rows = min(sched.max_num_seqs, hidden.shape[0])
        logits = self.model.compute_logits(hidden[:rows])
        self.sampler(logits, _profile_sampling_metadata(rows, self.device))

    def _profile_forwards(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        max_positions: int,
        steps: list[tuple[np.ndarray, np.ndarray]],
    ) -> torch.Tensor:
        """The steps' forwards, every attention layer on a one-block stand-in cache that all
        slots map to; the last step's hidden states."""
        bs = self.block_size
        layers = model.attention_layers()
        for attn in layers:
            attn.kv_cache = torch.zeros((1, 2, bs, attn.num_kv_heads, attn.head_size),
                                        dtype=self.dtype, device=self.device)  # fmt: skip
        try:
            for query_lens, starts in steps:
                layout = TokenLayout.of(np.arange(len(query_lens)), starts, query_lens)
                table = np.zeros((len(query_lens), cdiv(int(layout.seq_lens.max()), bs)),
                                 dtype=np.int64)  # fmt: skip
                inputs = layout.attention_inputs(table, bs, self.device, self.dtype)
                ids = torch.zeros(layout.num_tokens, dtype=torch.long, device=self.device)
                positions = to_device(layout.positions % max_positions, self.device)
                with set_forward_context(backend.build_metadata(inputs)):
                    hidden = model(ids, positions)
        finally:
            for attn in layers:
                attn.kv_cache = torch.empty(0)
        return hidden

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

    # The host's part of a step.

    @torch.inference_mode()
    def _prepare(self, out: SchedulerOutput, defer_free: bool) -> PreparedStep | None:
        """The batch brought up to date and everything the forward needs but the input tokens
        (positions, slots, attention metadata). defer_free: a step still running may write
        rows that this apply frees, so they are reused a step later."""
        batch = self.input_batch
        assert batch is not None and self.model is not None, "initialize_kv_cache() first"
        timer = StageTimes(self.step_timing, self._synchronize)
        with timer.stage("prepare", synchronize=False):
            batch.apply(out, defer_free)
            if out.total_num_scheduled_tokens == 0:
                return None
            req_ids = self._step_order(out)
            rows = np.fromiter((batch.row_of[r] for r in req_ids), np.int64, len(req_ids))
            query_lens = np.fromiter(
                (out.num_scheduled_tokens[r] for r in req_ids), np.int64, len(req_ids)
            )
            num_drafts = self._insert_drafts(out, req_ids, rows)
            layout = TokenLayout.of(rows, batch.num_computed_tokens[rows], query_lens)
            step, logit_rows = self._plan(out, req_ids, layout, num_drafts, timer)
            if self.lora_manager is not None:
                self._plan_lora(step)
            self._device_inputs(step, num_drafts, logit_rows)
            batch.num_computed_tokens[rows] = layout.seq_lens
        return step

    def _plan_lora(self, step: PreparedStep) -> None:
        """Each request's adapter (by lora_int_id, 0 for none), where any request runs one."""
        batch = self.input_batch
        assert batch is not None
        adapters = [batch.requests[r].lora_request for r in step.req_ids]
        if not any(adapters):
            return
        step.lora_requests = {a.lora_int_id: a for a in adapters if a is not None}
        step.lora_ids = [0 if a is None else a.lora_int_id for a in adapters]

    def _lora_mapping(self, step: PreparedStep) -> LoRAMapping | None:
        """The step's rows by adapter slot, copying adapters into slots as needed (on the
        device's thread, after the steps before have run)."""
        manager = self.lora_manager
        if manager is None or step.lora_ids is None:
            return None
        slots = manager.activate(step.lora_requests)
        request_slots = np.array([slots.get(i, -1) for i in step.lora_ids], dtype=np.int64)
        row_slots = to_device(np.repeat(request_slots, step.layout.query_lens), self.device)
        return LoRAMapping.of(row_slots, manager.config.max_loras)

    def _step_order(self, out: SchedulerOutput) -> list[str]:
        """Decodes (one new token) first, by context length so that the attention backend's
        decode groups pad little; then prefill chunks in schedule order."""
        batch = self.input_batch
        assert batch is not None
        scheduled = out.num_scheduled_tokens
        row_of, computed = batch.row_of, batch.num_computed_tokens
        return sorted(
            scheduled,
            key=lambda r: (scheduled[r] != 1, computed[row_of[r]] if scheduled[r] == 1 else 0),
        )

    def _insert_drafts(
        self, out: SchedulerOutput, req_ids: list[str], rows: np.ndarray
    ) -> np.ndarray:
        """Writes the proposals each request verifies after its last token (the step's input
        for them); per request, how many."""
        batch = self.input_batch
        assert batch is not None
        spec = out.scheduled_spec_decode_tokens
        num_drafts = np.zeros(len(req_ids), dtype=np.int64)
        for i, req_id in enumerate(req_ids if spec else ()):
            drafts = spec.get(req_id)
            if drafts:
                row, n = rows[i], batch.num_tokens[rows[i]]
                batch.token_ids[row, n : n + len(drafts)] = drafts
                num_drafts[i] = len(drafts)
        return num_drafts

    def _plan(
        self,
        out: SchedulerOutput,
        req_ids: list[str],
        layout: TokenLayout,
        num_drafts: np.ndarray,
        timer: StageTimes,
    ) -> tuple[PreparedStep, np.ndarray]:
        """The step, and the hidden states that give logits: each sampling request's last,
        and before it one per proposed token it verifies. A request samples unless the
        scheduler says its step is part of a prompt."""
        # (A pooling model samples nothing: its requests' last chunks are pooled instead.)
        samples = np.full(len(req_ids), self.pooler is None)
        if out.partial_req_ids and self.pooler is None:
            partial = set(out.partial_req_ids)
            samples[[i for i, r in enumerate(req_ids) if r in partial]] = False
        drafts = num_drafts[samples]
        logit_rows = np.repeat(layout.cu_query[1:][samples], drafts + 1) - 1
        if drafts.any():
            logit_rows -= np.repeat(drafts, drafts + 1) - ranks_within(drafts + 1)
        step = PreparedStep(
            out=out,
            req_ids=req_ids,
            layout=layout,
            rope_positions=self._rope_positions(layout),
            samples=samples,
            sample_rows=np.repeat(layout.rows[samples], drafts + 1),
            num_drafts=drafts if drafts.any() else None,
            prompt_logprobs=self._prompt_logprob_chunks(layout),
            timer=timer,
        )
        return step, logit_rows

    def _device_inputs(
        self, step: PreparedStep, num_drafts: np.ndarray, logit_rows: np.ndarray
    ) -> None:
        """The step's inputs on the device: a captured shape's (decodes, each with the
        proposals it verifies and nothing else), or the attention metadata and positions."""
        batch = self.input_batch
        assert batch is not None
        layout, table, bs = step.layout, batch.block_table, self.block_size
        graphs = self.decode_graphs
        shape = None
        if graphs is not None and np.array_equal(layout.query_lens, num_drafts + 1):
            shape = graphs.shape_for(layout.query_lens)
        if shape is not None:
            step.graph_inputs = GraphInputs(
                shape, layout.query_lens, layout.slot_mapping(table, bs), layout.seq_lens,
                layout.block_table(table, bs),
            )  # fmt: skip
            logit_rows_t, step.sample_rows_t = self.staging.to_device(logit_rows, step.sample_rows)
        else:
            inputs = layout.attention_inputs(table, bs, self.device, self.dtype)
            step.attn_metadata = self.attn_backend.build_metadata(inputs)
            step.positions_t, logit_rows_t, step.sample_rows_t = self.staging.to_device(
                step.rope_positions, logit_rows, step.sample_rows
            )
        # (When every token gives logits, no gather is needed.)
        step.logit_rows_t = logit_rows_t if len(logit_rows) not in (0, layout.num_tokens) else None

    def _rope_positions(self, layout: TokenLayout) -> np.ndarray:
        """The rows of the rotary table each token rotates by: its position, except where the
        model's rotary layer says otherwise (LongRoPE: worker/layers/rotary.py)."""
        if self.long_rope is None:
            return layout.positions
        batch = self.input_batch
        assert batch is not None
        prompt_lens = batch.num_prompt_tokens[layout.token_rows]
        return self.long_rope.table_rows(layout.positions, prompt_lens)

    def _prompt_logprob_chunks(self, layout: TokenLayout) -> list[PromptLogprobChunk]:
        """For the requests asking for prompt logprobs: each prompt position of this step's
        chunk but the prompt's last predicts the next prompt token."""
        batch = self.input_batch
        assert batch is not None
        wanted = batch.sampling.logprobs.prompt
        if not wanted:
            return []
        chunks = []
        starts, cu = layout.seq_lens - layout.query_lens, layout.cu_query
        for i, row in enumerate(layout.rows.tolist()):
            k = wanted.get(row)
            if k is None:
                continue
            start = int(starts[i])
            last = int(batch.num_prompt_tokens[row]) - 1  # the last position that scores one
            end = min(start + int(layout.query_lens[i]), last)
            if end >= last:
                del wanted[row]  # the prompt is done
            if end <= start:
                continue
            targets = batch.token_ids[row, start + 1 : end + 1].copy()
            chunks.append(PromptLogprobChunk(i, (int(cu[i]), int(cu[i]) + end - start), targets, k))
        return chunks

    # The device's part of a step.

    @torch.inference_mode()
    def _run_step(self, step: PreparedStep) -> ModelRunnerOutput:
        """Input tokens, forward, logits, sampling, outputs. Steps run this in order; each
        reads the batch's token record after the one before wrote it. The platform may adapt
        the step's threads (the CPU's to contention for its cores)."""
        timer = step.timer
        with self.platform.step_threads():
            with timer.stage("prepare"):
                inputs = self._take_inputs(step)
            with timer.stage("forward"):
                hidden = self._forward(step, inputs.input_ids)
            if self.pooler is not None:
                with timer.stage("pool"):
                    output = self._pool(step, hidden)
            else:
                output = self._sample_stages(step, hidden, inputs)
        output.step_times = timer.times if timer.on else None
        return output

    def _sample_stages(
        self, step: PreparedStep, hidden: torch.Tensor, inputs: StepInputs
    ) -> ModelRunnerOutput:
        """Logits -> sample (or verify) -> logprobs -> record -> propose."""
        timer = step.timer
        with timer.stage("logits"):
            prompt_logprobs = self._prompt_logprobs(step, hidden)
            logits = None if inputs.metadata is None else self._logits(step, hidden)
        output = ModelRunnerOutput(
            req_ids=step.req_ids,
            sampled_token_ids=[[] for _ in step.req_ids],
            prompt_logprobs=prompt_logprobs,
        )
        if logits is not None:
            with timer.stage("sample"):
                sampled = self._sample(step, logits, inputs)
                self._logprobs(step, logits, sampled, inputs.top_logprobs, output)
                self._record(step, sampled, output)
                self._propose(step, output)
        return output

    def _pool(self, step: PreparedStep, hidden: torch.Tensor) -> ModelRunnerOutput:
        """A pooling model's outputs: the vector of each request whose last prompt chunk
        ran (the scheduler lists the others as partial); no tokens."""
        pooler, batch = self.pooler, self.input_batch
        assert pooler is not None and batch is not None
        out = step.out
        pooler.drop(out.finished_req_ids + out.preempted_req_ids)  # (preempted: recomputed)
        partial = set(out.partial_req_ids)
        finals = np.array([r not in partial for r in step.req_ids], dtype=bool)
        params = {}
        for req_id in itertools.compress(step.req_ids, finals):
            pooling_params = batch.requests[req_id].pooling_params
            assert pooling_params is not None, f"request {req_id} has no pooling_params"
            params[req_id] = pooling_params
        layout = step.layout
        starts = layout.seq_lens - layout.query_lens
        vectors = pooler.pool(hidden, step.req_ids, starts, layout.cu_query, finals, params)
        return ModelRunnerOutput(
            req_ids=step.req_ids,
            sampled_token_ids=[[] for _ in step.req_ids],
            pooler_output=vectors,
        )

    def _sample(self, step: PreparedStep, logits: torch.Tensor, inputs: StepInputs) -> Sampled:
        """The tokens each sampling request emits: one sample, or its verified proposals and
        one more. Structured-output rows are first masked to what their grammar allows."""
        assert inputs.metadata is not None
        if step.out.grammar_req_ids:
            owners = self._logit_owners(step)
            apply_grammar_bitmask(logits, [step.req_ids[i] for i in owners], step.out)
        if step.num_drafts is not None:
            return self._verify(step, logits, inputs)
        tokens_t = self.sampler(logits, inputs.metadata)
        token_lists = [[t] for t in tokens_t.cpu().tolist()]
        return Sampled(token_lists, tokens_t, inputs.logprob_rows)

    def _logprobs(
        self,
        step: PreparedStep,
        logits: torch.Tensor,
        sampled: Sampled,
        top_k: int,
        output: ModelRunnerOutput,
    ) -> None:
        """The emitted tokens' logprobs, from the logits before the sampler's adjustments."""
        if not sampled.logprob_rows:
            return
        at_t = to_device(sampled.logprob_rows, logits.device)
        output.logprobs = compute_logprobs(logits[at_t], sampled.tokens_t[at_t], top_k)
        owners = self._logit_owners(step)
        output.logprobs_req_ids = [step.req_ids[owners[i]] for i in sampled.logprob_rows]

    def _record(self, step: PreparedStep, sampled: Sampled, output: ModelRunnerOutput) -> None:
        """Appends the emitted tokens to the batch's record and to the output."""
        batch = self.input_batch
        assert batch is not None
        batch.append_token_lists(step.layout.rows[step.samples], sampled.token_lists)
        for i, tokens in zip(step.sampling, sampled.token_lists):
            output.sampled_token_ids[i] = tokens

    def _propose(self, step: PreparedStep, output: ModelRunnerOutput) -> None:
        """The proposals for the requests that sampled, for the next step to verify. Every
        one may speculate: the sampler adjusts each verified position's logits by what comes
        before it, proposed tokens included (penalties, bad words, min_tokens, a grammar's
        mask from the core)."""
        batch, sampling = self.input_batch, step.sampling
        assert batch is not None
        if not step.out.propose or self.proposer is None or not sampling:
            return
        proposals = self.proposer.propose_rows(batch, step.layout.rows[step.samples])
        output.spec_token_ids = {step.req_ids[i]: p for i, p in zip(sampling, proposals) if p}

    def _take_inputs(self, step: PreparedStep) -> StepInputs:
        """Reads the input tokens and the sampling state from the batch, then lets the next
        step change it."""
        batch = self.input_batch
        assert batch is not None
        try:
            input_ids = batch.token_ids[step.layout.token_rows, step.layout.positions]
            metadata = None
            if len(step.sample_rows):
                ranks = None if step.num_drafts is None else ranks_within(step.num_drafts + 1)
                metadata = batch.sampling.metadata(step.sample_rows, step.sample_rows_t, ranks)
            logprob_rows, top_logprobs = batch.sampling.logprobs.wanted(step.sample_rows)
        finally:
            step.inputs_taken.set()
        return StepInputs(input_ids, metadata, logprob_rows, top_logprobs)

    def _forward(self, step: PreparedStep, input_ids: np.ndarray) -> torch.Tensor:
        """The hidden states of the step's tokens, replayed from a graph or run eagerly."""
        assert self.model is not None
        graph = step.graph_inputs
        if graph is not None:
            assert self.decode_graphs is not None
            if self.on_forward is not None:
                self.on_forward()
            return self.decode_graphs.run(
                graph.shape, graph.query_lens, input_ids, step.rope_positions,
                graph.slot_mapping, graph.seq_lens, graph.block_table,
            )  # fmt: skip
        ids_t = self.ids_staging.to_device(input_ids)[0]
        if self.on_forward is not None:
            self.on_forward()
        with set_forward_context(step.attn_metadata, self._lora_mapping(step)):
            return self.model(ids_t, step.positions_t)

    def _logits(self, step: PreparedStep, hidden: torch.Tensor) -> torch.Tensor:
        assert self.model is not None
        rows = step.logit_rows_t
        return self.model.compute_logits(hidden if rows is None else hidden[rows])

    def _prompt_logprobs(
        self, step: PreparedStep, hidden: torch.Tensor
    ) -> dict[str, LogprobsArrays]:
        assert self.model is not None
        found = {}
        for chunk in step.prompt_logprobs:
            logits = self.model.compute_logits(hidden[chunk.span[0] : chunk.span[1]])
            targets = to_device(chunk.targets, hidden.device)
            found[step.req_ids[chunk.index]] = compute_logprobs(logits, targets, chunk.k)
        return found

    def _verify(self, step: PreparedStep, logits: torch.Tensor, inputs: StepInputs) -> Sampled:
        """Rejection sampling of the proposals. Per row of logits, the token it emitted: a
        request's first rows emit its accepted proposals, the next its last token; rows after
        that emit nothing (and give no logprobs)."""
        num_drafts = step.num_drafts
        assert num_drafts is not None and inputs.metadata is not None
        drafts = step.out.scheduled_spec_decode_tokens
        draft_ids = [t for i in step.sampling for t in drafts.get(step.req_ids[i], ())]
        token_lists = rejection_sample(self.sampler, logits, inputs.metadata, num_drafts,
                                       np.array(draft_ids, dtype=np.int64))  # fmt: skip
        emitted = np.zeros(len(step.sample_rows), dtype=np.int64)
        emits = np.zeros(len(step.sample_rows), dtype=bool)
        at = 0
        for tokens, k in zip(token_lists, num_drafts.tolist()):
            emitted[at : at + len(tokens)] = tokens
            emits[at : at + len(tokens)] = True
            at += k + 1
        wants = [i for i in inputs.logprob_rows if emits[i]]
        return Sampled(token_lists, to_device(emitted, logits.device), wants)

    @staticmethod
    def _logit_owners(step: PreparedStep) -> np.ndarray | list[int]:
        """Per row of logits: the position in req_ids of the request it samples for."""
        sampling = step.sampling
        return sampling if step.num_drafts is None else np.repeat(sampling, step.num_drafts + 1)


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
        k = min(k, logprobs.shape[-1])
        if batch_invariant():
            # Ties (common among bf16 logits) in token order: a request's top n are then the
            # same whatever the largest k asked for in its step (topk's ties depend on k).
            values, indices = logprobs.sort(dim=-1, descending=True, stable=True)
            values, indices = values[:, :k], indices[:, :k]
        else:
            values, indices = logprobs.topk(k, dim=-1)
        chosen = torch.cat((chosen, indices), dim=1)
        chosen_lp = torch.cat((chosen_lp, values), dim=1)
    return LogprobsArrays(
        token_ids=chosen.to(torch.int32).cpu().numpy(),
        logprobs=chosen_lp.cpu().numpy(),
        ranks=ranks.to(torch.int32).cpu().numpy(),
    )


# Context length of the profiled decode step (its scratch stops growing well before this).
_PROFILE_DECODE_CONTEXT = 8192


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
    )


def _empty_output() -> ModelRunnerOutput:
    return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
