"""The ModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

Per step: update the persistent batch from the diff, lay the scheduled tokens out flat
(decodes first, then prefill chunks), build input ids, positions, slot mapping and the
attention metadata, run the model, compute logits only for requests whose prompt is now
fully computed, and sample. Owns the model, the KV cache tensors and the sampler.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.protocol import envs
from tokenmill.protocol.config import EngineConfig
from tokenmill.protocol.messages import LogprobsArrays
from tokenmill.protocol.scheduler_output import KVCacheSpec, ModelRunnerOutput, SchedulerOutput
from tokenmill.protocol.utils import cdiv
from tokenmill.worker.attention.base import AttentionBackend, StepAttentionInputs
from tokenmill.worker.attention.torch_backend import TorchAttentionBackend, cpu_decode_group_bytes
from tokenmill.worker.forward_context import set_forward_context
from tokenmill.worker.input_batch import InputBatch
from tokenmill.worker.layers.custom_op import use_triton_layers
from tokenmill.worker.model_loader import get_model
from tokenmill.worker.sampler import Sampler, SamplingMetadata
from tokenmill.worker.staging import HostStaging

if TYPE_CHECKING:  # imports triton
    from tokenmill.worker.cuda_graph import DecodeGraphs

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.dtype = getattr(torch, config.model_config.dtype)
        self.block_size = config.cache_config.block_size
        self.use_triton = config.device_config.attention_backend == "TRITON_ATTN"
        self.attn_backend = make_attention_backend(config, device)
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.input_batch: InputBatch | None = None
        self.decode_graphs: DecodeGraphs | None = None
        self.staging = HostStaging(device, torch.int64)
        self.step_timing = envs.TOKENMILL_STEP_TIMING
        self.sampler = Sampler(torch.Generator(device).manual_seed(config.model_config.seed))
        # Called as each step's forward starts (the in-process executor's async scheduling
        # times the core's work to it; see UniProcExecutor).
        self.on_forward: Callable[[], None] | None = None

    def load_model(self) -> None:
        with use_triton_layers(self.use_triton):
            self.model = get_model(self.config, self.device, self.attn_backend)

    def get_kv_cache_specs(self) -> list[KVCacheSpec]:
        assert self.model is not None
        return [a.kv_cache_spec(self.block_size, self.dtype) for a in self.model.attention_layers()]

    def initialize_kv_cache(self, config: EngineConfig, num_blocks: int) -> None:
        """Allocates the cache under the config as the core settled it (its max_model_len
        sizes the persistent batch)."""
        assert self.model is not None
        self.config = config
        self.attn_backend.set_block_bytes(
            max(spec.page_size_bytes for spec in self.get_kv_cache_specs())
        )
        self.kv_caches = []
        for attn in self.model.attention_layers():
            # Zeroed: attention reads whole blocks, including slots not yet written (masked
            # out, but NaN garbage would survive the masking).
            cache = zeroed_tensor(
                (num_blocks, 2, self.block_size, attn.num_kv_heads, attn.head_size),
                self.dtype,
                self.device,
            )
            attn.kv_cache = cache
            self.kv_caches.append(cache)
        self.input_batch = InputBatch(
            config.scheduler_config.max_num_seqs,
            config.model_config.max_model_len,
            self.block_size,
            self.config.model_config.vocab_size,
            self.device,
        )
        device_config = config.device_config
        if self.device.type == "cuda" and self.use_triton and not device_config.enforce_eager:
            self.enable_decode_graphs(capture=True)

    def enable_decode_graphs(self, capture: bool) -> None:
        """Decode-only steps run at padded batch sizes from persistent buffers, replayed from
        CUDA graphs captured now (capture=False: the same buffers, run eagerly)."""
        from tokenmill.worker.cuda_graph import DecodeGraphs

        assert self.model is not None and self.use_triton, "CUDA graphs need TRITON_ATTN"
        sched = self.config.scheduler_config
        largest = min(sched.max_num_seqs, sched.max_num_batched_tokens)
        sizes = [s for s in self.config.device_config.cudagraph_capture_sizes if s <= largest]
        if not sizes:
            return
        max_blocks = cdiv(self.config.model_config.max_model_len, self.block_size)
        self.decode_graphs = DecodeGraphs(
            self.model, self.attn_backend, sizes, max_blocks, self.device, capture
        )
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
        layers = self.model.attention_layers()
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
                with set_forward_context(self.attn_backend.build_metadata(inputs)):
                    hidden = self.model(
                        torch.zeros(total, dtype=torch.long, device=self.device),
                        torch.arange(total, device=self.device) % max_pos,
                    )
        finally:
            for attn in layers:
                attn.kv_cache = torch.empty(0)
        rows = min(sched.max_num_seqs, hidden.shape[0])
        logits = self.model.compute_logits(hidden[:rows])
        self.sampler(logits, _profile_sampling_metadata(rows, self.device))

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        batch = self.input_batch
        assert batch is not None and self.model is not None, "initialize_kv_cache() first"
        timer = _StepTimer(self.device) if self.step_timing else None
        batch.apply(out)
        if out.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])

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
        cu_query = np.concatenate(([0], np.cumsum(query_lens)))
        total = int(cu_query[-1])
        token_rows = np.repeat(rows, query_lens)
        positions = np.arange(total) - np.repeat(cu_query[:-1] - starts, query_lens)
        input_ids = batch.token_ids[token_rows, positions]
        bs = self.block_size
        slot_mapping = batch.block_table[token_rows, positions // bs] * bs + positions % bs

        # Only requests whose every token is now computed produce a token this step, from
        # the hidden state of their last token (when every token is one, no gather is needed).
        done = seq_lens >= batch.num_tokens[rows]
        sample_rows = rows[done]
        gather = len(sample_rows) not in (0, total)
        last_token = cu_query[1:][done] - 1

        num_decodes = int(np.count_nonzero(query_lens == 1))
        width = cdiv(int(seq_lens.max()), bs)
        graphs = self.decode_graphs
        if graphs is not None and num_decodes == total and graphs.padded_size(total) is not None:
            if timer is not None:
                timer.lap("prepare")  # the copies into the graph's buffers count as forward
            if self.on_forward is not None:
                self.on_forward()
            hidden = graphs.run(
                input_ids, positions, slot_mapping, seq_lens, batch.block_table[rows, :width]
            )
            last_token_t = self.staging.to_device(last_token)[0] if gather else None
        else:
            attn_inputs = StepAttentionInputs(
                num_decodes=num_decodes,
                query_lens=query_lens,
                seq_lens=seq_lens,
                block_table=batch.block_table[rows, :width],
                slot_mapping=slot_mapping,
                block_size=bs,
                device=self.device,
                dtype=self.dtype,
            )
            metadata = self.attn_backend.build_metadata(attn_inputs)
            ids_t, positions_t, last_token_t = self.staging.to_device(
                input_ids, positions, last_token
            )
            if timer is not None:
                timer.lap("prepare")
            if self.on_forward is not None:
                self.on_forward()
            with set_forward_context(metadata):
                hidden = self.model(ids_t, positions_t)
        if timer is not None:
            timer.lap("forward")
        batch.num_computed_tokens[rows] = seq_lens

        sampled_ids: list[list[int]] = [[] for _ in req_ids]
        logprobs, logprobs_req_ids = None, []
        prompt_logprobs = {}
        if batch.num_prompt_logprobs:
            prompt_logprobs = self._prompt_logprobs(req_ids, rows, starts, cu_query, hidden)
        if len(sample_rows):
            logits = self.model.compute_logits(hidden[last_token_t] if gather else hidden)
            if timer is not None:
                timer.lap("logits")
            if out.grammar_req_ids:
                sampled_req_ids = [req_ids[i] for i in np.flatnonzero(done).tolist()]
                apply_grammar_bitmask(logits, sampled_req_ids, out)
            meta = batch.sampling_metadata(sample_rows, self.device)
            sampled = self.sampler(logits, meta)
            if batch.num_logprobs:  # from the raw logits, before any adjustment
                wants = [i for i, r in enumerate(sample_rows.tolist()) if r in batch.num_logprobs]
                if wants:
                    k = max(batch.num_logprobs[int(sample_rows[i])] for i in wants)
                    at = torch.tensor(wants, device=logits.device)
                    logprobs = compute_logprobs(logits[at], sampled[at], k)
                    logprobs_req_ids = [req_ids[i] for i in np.flatnonzero(done)[wants].tolist()]
            tokens = sampled.cpu().numpy()
            batch.append_tokens(sample_rows, tokens)
            for i, token in zip(np.flatnonzero(done).tolist(), tokens.tolist()):
                sampled_ids[i] = [token]
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
        )

    def _prompt_logprobs(
        self,
        req_ids: list[str],
        rows: np.ndarray,
        starts: np.ndarray,
        cu_query: np.ndarray,
        hidden: torch.Tensor,
    ) -> dict[str, LogprobsArrays]:
        """For the requests asking for prompt logprobs: each prompt position of this step's
        chunk but the prompt's last predicts the next prompt token."""
        batch = self.input_batch
        assert batch is not None and self.model is not None
        result = {}
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
            at = torch.arange(cu_query[i], cu_query[i] + end - start, device=hidden.device)
            targets = torch.from_numpy(batch.token_ids[row, start + 1 : end + 1]).to(hidden.device)
            logits = self.model.compute_logits(hidden[at])
            result[req_ids[i]] = compute_logprobs(logits, targets, k)
        return result


def apply_grammar_bitmask(
    logits: torch.Tensor, sampled_req_ids: list[str], out: SchedulerOutput
) -> None:
    """Masks, in place, the logits of the structured-output rows down to the tokens their
    grammar allows (the core's packed bitmask: bit j of word w is token 32 * w + j)."""
    assert out.grammar_bitmask is not None
    position = {req_id: i for i, req_id in enumerate(sampled_req_ids)}
    pairs = [(position[r], i) for i, r in enumerate(out.grammar_req_ids) if r in position]
    if not pairs:
        return
    at = [p for p, _ in pairs]
    words = np.ascontiguousarray(out.grammar_bitmask[[i for _, i in pairs]], dtype=np.int32)
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
    allowed = torch.from_numpy(bits[:, : logits.shape[-1]].astype(bool)).to(logits.device)
    index = torch.tensor(at, device=logits.device)
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
    """The configured backend. Triton on the CPU runs in Triton's interpreter (for tests: it
    is slow), which must be chosen before any kernel module is imported."""
    if config.device_config.attention_backend == "TRITON_ATTN":
        if device.type == "cpu":
            os.environ.setdefault("TRITON_INTERPRET", "1")
        from tokenmill.worker.attention.triton_backend import TritonAttentionBackend

        model, tp = config.model_config, config.parallel_config.tensor_parallel_size
        kv_heads = max(1, model.num_kv_heads // tp)  # replicated when fewer than the ranks
        return TritonAttentionBackend(
            model.num_attention_heads // tp,
            kv_heads,
            model.head_size,
            device,
            getattr(torch, model.dtype),
        )
    # On a GPU every decode goes into one attention call; on the CPU into cache-sized groups.
    if device.type == "cuda":
        return TorchAttentionBackend(decode_group_bytes=None)
    return TorchAttentionBackend(cpu_decode_group_bytes())


def zeroed_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros; on the CPU, memory the kernel zero-fills and commits at once.

    A private anonymous mapping needs no memset pass, and advised for transparent huge
    pages it is faulted in 2 MiB at a time (1.4-1.7x faster than torch.zeros for a 5.5 GiB
    cache here). Committing it now keeps page faults out of the steps: left lazy, a decode
    step's K/V writes reach a fresh 4 KiB page every few tokens of every request."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(buffer, dtype=torch.uint8)  # keeps the mapping alive
    raw[:: mmap.PAGESIZE].zero_()  # one write per page commits it
    return raw.view(dtype).view(shape)


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


class _StepTimer:
    """Wall time of a step's stages; the device is synchronized at every lap, so that a
    stage's queued kernels count where they were launched."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: dict[str, float] = {}
        self.last = time.perf_counter()

    def lap(self, stage: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.times[stage] = self.times.get(stage, 0.0) + now - self.last
        self.last = now
