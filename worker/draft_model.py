"""The draft model of speculative decoding (`speculative_config={"method": "draft_model"}`).

A smaller model with the target's tokenizer, run by every worker beside the target and
sharded by tensor parallelism like it. It has its own KV cache, with as many blocks as the
target's and the same block table (as vLLM does): the core sizes the cache for both models'
layers and allocates each request `num_speculative_tokens` slots past its sampled token.

Each step the draft runs the target's step as well (the same tokens, positions and slots),
so that its cache holds every token the target's does; the K/V of accepted proposals is
kept, and a rejected position is written again when it is next computed. After sampling, it
proposes k tokens for each request that may speculate: k single-token steps from the
request's last token, taking the draft's argmax each time (a deterministic proposal: the
rejection sampler's q is one-hot, which keeps the output distributed as the target's).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from tokenmill.protocol.config import EngineConfig
from tokenmill.protocol.scheduler_output import KVCacheSpec
from tokenmill.protocol.utils import cdiv
from tokenmill.worker.attention.base import StepAttentionInputs
from tokenmill.worker.forward_context import set_forward_context
from tokenmill.worker.input_batch import InputBatch
from tokenmill.worker.model_loader import get_model
from tokenmill.worker.sampler import first_arg


class DraftModel:
    def __init__(self, config: EngineConfig, device: torch.device, make_backend) -> None:
        spec = config.speculative_config
        assert spec is not None and spec.draft_model_config is not None
        self.k = spec.num_speculative_tokens
        # The target's engine config with the draft's model config: what get_model and the
        # attention backend read.
        self.config = dataclasses.replace(config, model_config=spec.draft_model_config)
        self.device = device
        self.dtype = getattr(torch, self.config.model_config.dtype)
        self.block_size = config.cache_config.block_size
        self.backend = make_backend(self.config, device)
        self.model: torch.nn.Module | None = None
        self.max_model_len = config.model_config.max_model_len

    def load(self) -> None:
        self.model = get_model(self.config, self.device, self.backend)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        assert self.model is not None
        return [a.kv_cache_spec(self.block_size, self.dtype) for a in self.model.attention_layers()]

    def allocate(self, num_blocks: int, zeroed) -> list[torch.Tensor]:
        assert self.model is not None
        self.backend.set_block_bytes(max(s.page_size_bytes for s in self.kv_cache_specs()))
        caches = []
        for attn in self.model.attention_layers():
            shape = (num_blocks, 2, self.block_size, attn.num_kv_heads, attn.head_size)
            attn.kv_cache = zeroed(shape, self.dtype, self.device)
            caches.append(attn.kv_cache)
        self.max_model_len = self.config.model_config.max_model_len
        return caches

    def metadata(self, inputs: StepAttentionInputs):
        return self.backend.build_metadata(inputs)

    @torch.inference_mode()
    def run_step(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata) -> None:
        """The target's step through the draft: writes its K/V, computes no logits."""
        assert self.model is not None
        with set_forward_context(metadata):
            self.model(input_ids, positions)

    @torch.inference_mode()
    def propose(self, batch: InputBatch, rows: np.ndarray, max_model_len: int) -> list[list[int]]:
        """k tokens for each row, from its last token on (fewer where its allocated slots or
        max_model_len end first)."""
        assert self.model is not None
        bs = self.block_size
        start = batch.num_tokens[rows] - 1  # the last token's position
        # The positions this row may write: its allocated slots, below max_model_len.
        limit = np.minimum(batch.num_blocks[rows] * bs, max_model_len)
        tokens = batch.token_ids[rows, start]
        proposals: list[list[int]] = [[] for _ in range(len(rows))]
        active = np.arange(len(rows))
        for step in range(self.k):
            active = active[start[active] + step < limit[active]]
            if not len(active):
                break
            at = rows[active]
            positions = start[active] + step
            seq_lens = positions + 1
            block_table = batch.block_table[at, : cdiv(int(seq_lens.max()), bs)]
            slots = block_table[np.arange(len(at)), positions // bs] * bs + positions % bs
            inputs = StepAttentionInputs(
                num_decodes=len(at),
                query_lens=np.ones(len(at), dtype=np.int64),
                seq_lens=seq_lens,
                block_table=block_table,
                slot_mapping=slots,
                block_size=bs,
                device=self.device,
                dtype=self.dtype,
            )
            ids_t = torch.from_numpy(tokens[active]).to(self.device)
            positions_t = torch.from_numpy(positions).to(self.device)
            with set_forward_context(self.backend.build_metadata(inputs)):
                hidden = self.model(ids_t, positions_t)
            best = first_arg(self.model.compute_logits(hidden), largest=True).cpu().numpy()
            tokens[active] = best
            for i, token in zip(active.tolist(), best.tolist()):
                proposals[i].append(token)
        return proposals
