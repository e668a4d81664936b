"""The draft model of speculative decoding (`speculative_config={"method": "draft_model"}`).

A smaller model with the target's tokenizer, run by every worker beside the target and
sharded by tensor parallelism like it. It has its own KV cache, with as many blocks as the
target's and the same block table (as vLLM does): the core sizes the cache for both models'
layers and allocates each request `num_speculative_tokens` slots past its sampled token.

The draft runs only when it proposes (after a step the scheduler marks `propose`), so a
request the governor keeps from speculating costs it nothing. Each request's state records
how far the draft's K/V is written (`draft_computed`) and the proposed tokens it wrote past
that (`draft_pending`). A proposal first catches up: the tokens from `draft_computed` to the
request's last one in one forward (a prefill chunk after its prompt or a pause, one or two
tokens after a verified step: the K/V of proposed tokens that were accepted is kept), whose
last logits give the first proposed token; then k - 1 single-token steps, taking the draft's
argmax each time (a deterministic proposal: the rejection sampler's q is one-hot, which
keeps the output distributed as the target's).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from tokenmill.protocol.config import EngineConfig
from tokenmill.protocol.scheduler_output import KVCacheSpec
from tokenmill.worker.attention.base import AttentionBackend, cache_torch_dtype
from tokenmill.worker.attention.registry import make_attention_backend
from tokenmill.worker.forward_context import set_forward_context
from tokenmill.worker.input_batch import InputBatch, RequestState
from tokenmill.worker.model_loader import get_model
from tokenmill.worker.proposer import Proposer
from tokenmill.worker.sampler import first_arg
from tokenmill.worker.staging import to_device
from tokenmill.worker.step import TokenLayout, allocate_kv_caches, kv_cache_specs


class DraftModel(Proposer):
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        spec = config.speculative_config
        assert spec is not None and spec.draft_model_config is not None
        self.k = spec.num_speculative_tokens
        # The target's engine config with the draft's model config: what get_model and the
        # attention backend read.
        self.config = dataclasses.replace(config, model_config=spec.draft_model_config)
        self.device = device
        self.dtype = getattr(torch, self.config.model_config.dtype)
        self.cache_dtype = cache_torch_dtype(config.cache_config.cache_dtype, self.dtype)
        self.block_size = config.cache_config.block_size
        self.backend = make_attention_backend(self.config, device)
        self.model: torch.nn.Module | None = None
        # The engine's limits, as the core settles them (allocate).
        self.max_model_len = config.model_config.max_model_len
        self.max_tokens = config.scheduler_config.max_num_batched_tokens

    @classmethod
    def from_config(cls, config: EngineConfig, device: torch.device) -> DraftModel:
        return cls(config, device)

    def load(self) -> None:
        self.model = get_model(self.config, self.device, self.backend)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        assert self.model is not None
        return kv_cache_specs(self.model, self.block_size, self.cache_dtype)

    def allocate(self, config: EngineConfig, num_blocks: int) -> list[torch.Tensor]:
        assert self.model is not None
        self.max_model_len = config.model_config.max_model_len
        self.max_tokens = config.scheduler_config.max_num_batched_tokens
        return allocate_kv_caches(
            self.model, self.backend, num_blocks, self.block_size, self.cache_dtype, self.device
        )

    def profiled_models(self) -> list[tuple[torch.nn.Module, AttentionBackend, int]]:
        assert self.model is not None
        return [(self.model, self.backend, self.config.model_config.max_position_embeddings)]

    def propose_rows(self, batch: InputBatch, rows: np.ndarray) -> list[list[int]]:
        return self.propose(batch, rows, self.max_model_len, self.max_tokens)

    @torch.inference_mode()
    def propose(
        self, batch: InputBatch, rows: np.ndarray, max_model_len: int, max_tokens: int
    ) -> list[list[int]]:
        """k tokens for each row, from its last token on (fewer where its allocated slots or
        max_model_len end first). max_tokens: the most tokens one catch-up forward takes."""
        assert self.model is not None
        num_tokens = batch.num_tokens[rows]
        # The positions a row may write: its allocated slots, below max_model_len.
        limit = np.minimum(batch.num_blocks[rows] * self.block_size, max_model_len)
        keep = num_tokens - 1 < limit
        rows, num_tokens, limit = rows[keep], num_tokens[keep], limit[keep]
        proposals: list[list[int]] = [[] for _ in keep]
        if not len(rows):
            return proposals
        states = [batch.requests[batch.req_ids[r]] for r in rows.tolist()]
        computed = np.array([self._written(batch, r, s) for r, s in zip(rows.tolist(), states)])
        tokens = self._catch_up(batch, rows, computed, num_tokens, max_tokens)
        out = np.flatnonzero(keep)
        for i, token in enumerate(tokens.tolist()):
            proposals[out[i]].append(token)
        # Then one token per step, from the last token's position + 1.
        active = np.arange(len(rows))
        for step in range(1, self.k):
            active = active[num_tokens[active] + step - 1 < limit[active]]
            if not len(active):
                break
            starts = num_tokens[active] + step - 1
            layout = TokenLayout.of(rows[active], starts, np.ones(len(active), np.int64))
            best = self._forward(batch, layout, tokens[active])
            tokens[active] = best
            for i, token in zip(active.tolist(), best.tolist()):
                proposals[out[i]].append(token)
        for i, state in enumerate(states):
            state.draft_computed = int(num_tokens[i])
            # The proposed tokens that went in as inputs: their K/V is written after it.
            state.draft_pending = proposals[out[i]][:-1]
        return proposals

    @staticmethod
    def _written(batch: InputBatch, row: int, state: RequestState) -> int:
        """How many of the row's leading positions hold the draft's K/V of its tokens: those
        it computed, and the proposed tokens it wrote after them that were accepted (never
        the last token, which a proposal's first forward reads)."""
        done = state.draft_computed
        pending = state.draft_pending
        last = int(batch.num_tokens[row]) - 1
        n = max(0, min(len(pending), last - done))
        if n:
            same = batch.token_ids[row, done : done + n] == np.asarray(pending[:n])
            done += n if same.all() else int(np.argmin(same))
        return min(done, last)

    def _catch_up(
        self,
        batch: InputBatch,
        rows: np.ndarray,
        computed: np.ndarray,
        num_tokens: np.ndarray,
        max_tokens: int,
    ) -> np.ndarray:
        """Writes each row's draft K/V from `computed` to its last token, in forwards of at
        most max_tokens tokens (each row's share at least one), and returns the draft's
        argmax after each row's last token."""
        first = np.zeros(len(rows), dtype=np.int64)
        start = computed.copy()
        while True:
            left = np.flatnonzero(start < num_tokens)
            if not len(left):
                return first
            share = max(1, max_tokens // len(left))
            query_lens = np.minimum(num_tokens[left] - start[left], share)
            # Decodes first, as the attention backends take them.
            order = np.argsort(query_lens != 1, kind="stable")
            left, query_lens = left[order], query_lens[order]
            layout = TokenLayout.of(rows[left], start[left], query_lens)
            ids = batch.token_ids[layout.token_rows, layout.positions]
            best = self._forward(batch, layout, ids)
            start[left] += query_lens
            ends = start[left] == num_tokens[left]
            first[left[ends]] = best[ends]

    def _forward(self, batch: InputBatch, layout: TokenLayout, ids: np.ndarray) -> np.ndarray:
        """One draft forward over the layout's tokens (input ids `ids`), writing their K/V;
        the draft's argmax after each request's last one."""
        assert self.model is not None
        table = batch.block_table
        inputs = layout.attention_inputs(table, self.block_size, self.device, self.dtype)
        ids_t = to_device(ids, self.device)
        positions_t = to_device(layout.positions, self.device)
        with set_forward_context(self.backend.build_metadata(inputs)):
            hidden = self.model(ids_t, positions_t)
        last = to_device(layout.cu_query[1:] - 1, self.device)
        return first_arg(self.model.compute_logits(hidden[last]), largest=True).cpu().numpy()
