"""The pure-torch attention backend: the CPU path, and the reference for faster ones.

K/V are written into the layer's cache through precomputed flat indices. Decodes are
batched: each request's context is gathered into a padded [B, L] index grid (padding points
at the zeroed null block and is masked) and attended with one SDPA call. Prefill chunks run
one request at a time; a chunk with no earlier context attends to its own K/V directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tokenmill.worker.attention.base import AttentionBackend, StepAttentionInputs


@dataclass
class PrefillSpan:
    start: int  # first token in the flattened batch
    end: int
    seq_len: int  # context length after this chunk
    gather_idx: torch.Tensor | None  # [seq_len] flat K indices; None: no earlier context


@dataclass
class TorchAttentionMetadata:
    write_k_idx: torch.Tensor  # [T] rows of the flat cache view that take the new keys
    write_v_idx: torch.Tensor
    num_decodes: int
    decode_k_idx: torch.Tensor | None  # [B, L] flat K rows of each decode's context
    decode_mask: torch.Tensor | None  # [B, 1, 1, L] True where a key is attended
    prefills: list[PrefillSpan]
    block_size: int


def _flat_k_rows(block_ids: np.ndarray, offsets: np.ndarray, block_size: int) -> np.ndarray:
    # A layer's cache viewed as [num_blocks * 2 * block_size, kv_heads, d]: the keys of block
    # b start at row 2*b*block_size, its values block_size rows later.
    return block_ids * (2 * block_size) + offsets


class TorchAttentionBackend(AttentionBackend):
    def build_metadata(self, inputs: StepAttentionInputs) -> TorchAttentionMetadata:
        bs, device = inputs.block_size, inputs.device
        slots = inputs.slot_mapping.astype(np.int64)
        write_k = _flat_k_rows(slots // bs, slots % bs, bs)
        nd = inputs.num_decodes
        decode_k_idx = decode_mask = None
        if nd:
            seq_lens = inputs.seq_lens[:nd]
            positions = np.arange(int(seq_lens.max()))
            table = inputs.block_table[:nd, positions // bs].astype(np.int64)
            rows = _flat_k_rows(table, positions % bs, bs)
            valid = positions[None, :] < seq_lens[:, None]
            rows = np.where(valid, rows, 0)  # row 0: the null block, kept at zero
            decode_k_idx = torch.from_numpy(rows).to(device)
            decode_mask = torch.from_numpy(valid).to(device)[:, None, None, :]
        prefills = []
        start = nd
        for r in range(nd, len(inputs.query_lens)):
            q_len, seq_len = int(inputs.query_lens[r]), int(inputs.seq_lens[r])
            gather = None
            if seq_len > q_len:
                positions = np.arange(seq_len)
                blocks = inputs.block_table[r, positions // bs].astype(np.int64)
                gather = torch.from_numpy(_flat_k_rows(blocks, positions % bs, bs)).to(device)
            prefills.append(PrefillSpan(start, start + q_len, seq_len, gather))
            start += q_len
        write_k_t = torch.from_numpy(write_k).to(device)
        return TorchAttentionMetadata(
            write_k_idx=write_k_t,
            write_v_idx=write_k_t + bs,
            num_decodes=nd,
            decode_k_idx=decode_k_idx,
            decode_mask=decode_mask,
            prefills=prefills,
            block_size=bs,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        flat = kv_cache.view(-1, kv_cache.shape[-2], kv_cache.shape[-1])
        flat.index_copy_(0, metadata.write_k_idx, key)
        flat.index_copy_(0, metadata.write_v_idx, value)
        out = torch.empty_like(query)
        nd, bs = metadata.num_decodes, metadata.block_size
        if nd:
            assert metadata.decode_k_idx is not None
            q = query[:nd].unsqueeze(2)  # [B, h, 1, d]
            k = flat[metadata.decode_k_idx].transpose(1, 2)  # [B, kvh, L, d]
            v = flat[metadata.decode_k_idx + bs].transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=metadata.decode_mask, scale=scale, enable_gqa=True
            )
            out[:nd] = o.squeeze(2)
        for span in metadata.prefills:
            q = query[span.start : span.end].transpose(0, 1)  # [h, n, d]
            if span.gather_idx is None:
                k = key[span.start : span.end].transpose(0, 1)
                v = value[span.start : span.end].transpose(0, 1)
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:
                k = flat[span.gather_idx].transpose(0, 1)  # [kvh, S, d]
                v = flat[span.gather_idx + bs].transpose(0, 1)
                n = span.end - span.start
                q_pos = torch.arange(span.seq_len - n, span.seq_len, device=q.device)
                mask = torch.arange(span.seq_len, device=q.device)[None, :] <= q_pos[:, None]
                o = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, scale=scale, enable_gqa=True
                )
            out[span.start : span.end] = o.transpose(0, 1)
        return out
