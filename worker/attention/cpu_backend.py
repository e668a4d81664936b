"""CPU_ATTN: tokenmill's own CPU kernels (kernels/cpu/attention.py). A step's new K/V go into
the paged cache in one call; the decodes attend in one call that reads the cache in place
(no copies of their blocks; grouped-query heads share each K/V read; a context split across
the threads when there are too few requests to keep them busy). Prefill chunks run as in the
torch backend (one SDPA call per request), which stays the reference (TORCH_SDPA)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.kernels.cpu.attention import decode_attention, kv_cache_write
from tokenmill.worker.attention.base import AttentionBackend, StepAttentionInputs
from tokenmill.worker.attention.torch_backend import PrefillSpan, attend_prefills, prefill_layout


@dataclass
class CpuAttentionMetadata:
    slots: torch.Tensor  # [T] the cache slot of each new token
    block_table: torch.Tensor  # [num_decodes, blocks] the decodes' rows
    seq_lens: torch.Tensor  # [num_decodes]
    prefills: list[PrefillSpan]


class CpuAttentionBackend(AttentionBackend):
    def build_metadata(self, inputs: StepAttentionInputs) -> CpuAttentionMetadata:
        nd = inputs.num_decodes
        prefills = [
            PrefillSpan(start, end, seq_len, None if ids is None else torch.from_numpy(2 * ids))
            for start, end, seq_len, ids in prefill_layout(inputs)
        ]
        return CpuAttentionMetadata(
            torch.from_numpy(inputs.slot_mapping.astype(np.int64)),
            torch.from_numpy(np.ascontiguousarray(inputs.block_table[:nd])),
            torch.from_numpy(inputs.seq_lens[:nd].astype(np.int64)),
            prefills,
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
        # The memory-profiling run comes before the cache exists: it has no context to read.
        if kv_cache.numel():
            kv_cache_write(kv_cache, key, value, metadata.slots)
        nd = metadata.seq_lens.shape[0]
        if not metadata.prefills:
            return decode_attention(query, kv_cache, metadata.block_table, metadata.seq_lens,
                                    scale, window, softcap)  # fmt: skip
        out = torch.empty_like(query)
        if nd:
            out[:nd] = decode_attention(query[:nd], kv_cache, metadata.block_table,
                                        metadata.seq_lens, scale, window, softcap)  # fmt: skip
        attend_prefills(query, key, value, kv_cache, metadata.prefills, out, scale, window,
                        softcap)  # fmt: skip
        return out
