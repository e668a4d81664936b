"""The pure-torch attention backend: the CPU path, and the reference for faster ones.

New K/V are written into the layer's cache through flat slot indices. Decodes are batched in
consecutive groups (the model runner orders them by context length, so a group's lengths are
close): one `index_select` for K and one for V gather every group's blocks (whole blocks,
padded with the null block), then each group runs one SDPA call in which the query heads
that share a KV head play the role of query rows. Prefill chunks run
one request at a time; a chunk with no earlier context attends to its own K/V directly.
The model runner guarantees that every block it hands us was zeroed before first use, so
padded reads never meet uninitialised memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tokenmill.worker.attention.base import AttentionBackend, StepAttentionInputs

# Decodes per SDPA call on the CPU: groups of requests with similar context length keep the
# padding (up to the longest context in the group) small while the number of calls stays
# low. On a GPU padding is cheap and every call costs launches, so all decodes go in one.
CPU_DECODE_GROUP_SIZE = 16


@dataclass
class DecodeGroup:
    start: int  # first decode (= token) of the group in the flattened batch
    size: int
    num_blocks: int  # blocks per request in this group (its longest context, rounded up)
    block_offset: int  # where the group's blocks start in the step's gathered blocks
    mask: torch.Tensor  # [size, 1, 1, num_blocks * block_size]: 0 attended, -inf padding


@dataclass
class PrefillSpan:
    start: int  # first token in the flattened batch
    end: int
    seq_len: int  # context length after this chunk
    block_ids: torch.Tensor | None  # the request's blocks; None: no earlier context


@dataclass
class TorchAttentionMetadata:
    write_k_idx: torch.Tensor  # [T] rows of the flat cache view that take the new keys
    write_v_idx: torch.Tensor
    decode_block_ids: torch.Tensor | None  # every group's blocks, back to back
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSpan]


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, decode_group_size: int = CPU_DECODE_GROUP_SIZE) -> None:
        self.decode_group_size = decode_group_size

    def build_metadata(self, inputs: StepAttentionInputs) -> TorchAttentionMetadata:
        bs, device = inputs.block_size, inputs.device
        slots = inputs.slot_mapping.astype(np.int64)
        # A layer's cache viewed as [num_blocks * 2 * block_size, kv_heads, d]: the keys of
        # block b start at row 2*b*block_size, its values block_size rows later.
        write_k = torch.from_numpy((slots // bs) * (2 * bs) + slots % bs).to(device)

        nd = inputs.num_decodes
        groups, group_blocks = [], []
        offset = 0
        for first in range(0, nd, self.decode_group_size):
            size = min(self.decode_group_size, nd - first)
            seq_lens = inputs.seq_lens[first : first + size]
            max_blocks = -(-int(seq_lens.max()) // bs)
            group_blocks.append(inputs.block_table[first : first + size, :max_blocks].reshape(-1))
            valid = np.arange(max_blocks * bs)[None, :] < seq_lens[:, None]
            # Additive float mask built once per step (SDPA would convert a boolean one in
            # every layer).
            mask = np.where(valid, 0.0, -np.inf).astype(np.float32)
            mask_t = torch.from_numpy(mask).to(device, inputs.dtype)[:, None, None, :]
            groups.append(DecodeGroup(first, size, max_blocks, offset, mask_t))
            offset += size * max_blocks
        decode_block_ids = None
        if groups:
            ids = np.concatenate(group_blocks).astype(np.int64)
            decode_block_ids = torch.from_numpy(ids).to(device)

        prefills = []
        start = nd
        for r in range(nd, len(inputs.query_lens)):
            q_len, seq_len = int(inputs.query_lens[r]), int(inputs.seq_lens[r])
            block_ids = None
            if seq_len > q_len:
                num_blocks = -(-seq_len // bs)
                block_ids = torch.from_numpy(
                    inputs.block_table[r, :num_blocks].astype(np.int64)
                ).to(device)
            prefills.append(PrefillSpan(start, start + q_len, seq_len, block_ids))
            start += q_len
        return TorchAttentionMetadata(write_k, write_k + bs, decode_block_ids, groups, prefills)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_kv_heads, head_size = key.shape[-2], key.shape[-1]
        # The memory-profiling run comes before the cache exists: it has no context to read.
        if kv_cache.numel():
            flat = kv_cache.view(-1, num_kv_heads, head_size)
            flat.index_copy_(0, metadata.write_k_idx, key)
            flat.index_copy_(0, metadata.write_v_idx, value)
            key_blocks, value_blocks = kv_cache[:, 0], kv_cache[:, 1]  # [blocks, bs, kvh, d]
        out = torch.empty_like(query)
        group_size = query.shape[1] // num_kv_heads
        if metadata.decode_groups:
            # [blocks, bs, kvh, d] copies of every decode's context, group after group.
            k_all = key_blocks.index_select(0, metadata.decode_block_ids)
            v_all = value_blocks.index_select(0, metadata.decode_block_ids)
        for group in metadata.decode_groups:
            g, first = group.size, group.start
            rows = slice(group.block_offset, group.block_offset + g * group.num_blocks)
            k = k_all[rows].view(g, -1, num_kv_heads, head_size).transpose(1, 2)
            v = v_all[rows].view(g, -1, num_kv_heads, head_size).transpose(1, 2)
            # One query token per request: the heads sharing a KV head act as query rows.
            q = query[first : first + g].reshape(g, num_kv_heads, group_size, head_size)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale)
            out[first : first + g] = o.view(g, -1, head_size)
        for span in metadata.prefills:
            n = span.end - span.start
            q = query[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, h, n, d]
            if span.block_ids is None:
                k, v = key[span.start : span.end], value[span.start : span.end]
                mask = None
            else:
                s = span.seq_len
                k = key_blocks.index_select(0, span.block_ids).flatten(0, 1)[:s]
                v = value_blocks.index_select(0, span.block_ids).flatten(0, 1)[:s]
                q_pos = torch.arange(s - n, s, device=q.device)
                mask = torch.arange(s, device=q.device)[None, :] <= q_pos[:, None]
            k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            # enable_gqa stays on the fused CPU kernel (bitwise equal to repeating the KV
            # heads, without the copies).
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
            )
            out[span.start : span.end] = o[0].transpose(0, 1)
        return out
