"""CPU_ATTN: tokenmill's own CPU kernels (kernels/cpu/attention.py). A step's new K/V go into
the paged cache in one call; the decodes attend in one call and the prefill chunks (earlier
context, prefix hits and speculative verifies included) in another, both reading the cache in
place (no copies of their blocks; grouped-query heads share each K/V read; a decode's context
split across the threads when there are too few requests to keep them busy). The torch
backend (TORCH_SDPA) stays the reference."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.kernels.batch_invariant import batch_invariant
from tokenmill.kernels.cpu.attention import decode_attention, kv_cache_write, prefill_attention
from tokenmill.worker.attention.base import AttentionBackend, StepAttentionInputs
from tokenmill.worker.attention.torch_backend import PrefillSpan, attend_prefills, prefill_layout


@dataclass
class CpuAttentionMetadata:
    slots: torch.Tensor  # [T] the cache slot of each new token
    block_table: torch.Tensor  # [num_decodes, blocks] the decodes' rows
    seq_lens: torch.Tensor  # [num_decodes]
    prefill_table: torch.Tensor  # [P, blocks] the prefilling requests' rows
    prefill_starts: torch.Tensor  # [P + 1] their queries' offsets after the decodes' tokens
    prefill_lens: torch.Tensor  # [P]
    # The same as the torch backend's spans, only for the memory-profiling run (no cache yet).
    profile_prefills: list[PrefillSpan] | None


class CpuAttentionBackend(AttentionBackend):
    name = "CPU_ATTN"
    dtypes = (torch.float32, torch.bfloat16)

    def __init__(self) -> None:
        self._cache_allocated = False

    def set_block_bytes(self, block_bytes: int) -> None:
        self._cache_allocated = True  # told as the runner allocates the cache

    def build_metadata(self, inputs: StepAttentionInputs) -> CpuAttentionMetadata:
        nd = inputs.num_decodes
        profile_prefills = None
        if not self._cache_allocated:
            profile_prefills = [
                PrefillSpan(start, end, seq_len, None if ids is None else torch.from_numpy(2 * ids))
                for start, end, seq_len, ids in prefill_layout(inputs)
            ]
        if batch_invariant() and profile_prefills is None:
            return self._per_token_metadata(inputs)
        starts = np.zeros(len(inputs.query_lens) - nd + 1, dtype=np.int64)
        np.cumsum(inputs.query_lens[nd:], out=starts[1:])
        return CpuAttentionMetadata(
            torch.from_numpy(inputs.slot_mapping.astype(np.int64)),
            torch.from_numpy(np.ascontiguousarray(inputs.block_table[:nd])),
            torch.from_numpy(inputs.seq_lens[:nd].astype(np.int64)),
            torch.from_numpy(np.ascontiguousarray(inputs.block_table[nd:])),
            torch.from_numpy(starts),
            torch.from_numpy(inputs.seq_lens[nd:].astype(np.int64)),
            profile_prefills,
        )

    @staticmethod
    def _per_token_metadata(inputs: StepAttentionInputs) -> CpuAttentionMetadata:
        """Batch-invariant mode: every query token attends as a decode of its own (its
        request's block table, its own context length), so that a position's attention is
        the same sums in the same order whether it is decoded, prefilled, recomputed after a
        preemption or verified as a proposal."""
        lens = inputs.query_lens
        first = np.repeat(inputs.seq_lens - lens, lens)  # each token's request's start
        within = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
        return CpuAttentionMetadata(
            torch.from_numpy(inputs.slot_mapping.astype(np.int64)),
            torch.from_numpy(np.repeat(inputs.block_table, lens, axis=0)),
            torch.from_numpy((first + within + 1).astype(np.int64)),
            torch.zeros((0, inputs.block_table.shape[1]), dtype=torch.int64),
            torch.zeros(1, dtype=torch.int64),
            torch.zeros(0, dtype=torch.int64),
            None,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CpuAttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        if metadata.profile_prefills is not None:  # no cache yet: prompts only, on torch
            out = torch.empty_like(query)
            attend_prefills(query, key, value, kv_cache, metadata.profile_prefills, out, scale,
                            window, softcap)  # fmt: skip
            return out
        kv_cache_write(kv_cache, key, value, metadata.slots)
        nd = metadata.seq_lens.shape[0]
        if not metadata.prefill_lens.shape[0]:
            return decode_attention(query, kv_cache, metadata.block_table, metadata.seq_lens,
                                    scale, window, softcap)  # fmt: skip
        out = torch.empty_like(query)
        if nd:
            out[:nd] = decode_attention(query[:nd], kv_cache, metadata.block_table,
                                        metadata.seq_lens, scale, window, softcap)  # fmt: skip
        prefill_attention(out[nd:], query[nd:], kv_cache, metadata.prefill_table,
                          metadata.prefill_starts, metadata.prefill_lens, scale, window,
                          softcap)  # fmt: skip
        return out
