"""The pure-torch attention backend: the CPU path, and the reference for faster ones.

New K/V are written into the layer's cache through flat slot indices. Decodes are batched in
groups of similar context length: each group gathers its requests' blocks (whole blocks, one
`index_select` for K and one for V, padded with the zeroed null block) and runs one SDPA call
in which the query heads that share a KV head play the role of query rows. Prefill chunks run
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
    token_idx: torch.Tensor  # [g] rows of the flattened batch (decode i is token i)
    block_ids: torch.Tensor  # [g * max_blocks] each request's blocks, null-padded
    num_blocks: int  # max_blocks: blocks per request in this group
    mask: torch.Tensor  # [g, 1, 1, max_blocks * block_size] additive: 0 attended, -inf not


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
        order = np.argsort(inputs.seq_lens[:nd], kind="stable")
        groups = []
        for first in range(0, nd, self.decode_group_size):
            members = order[first : first + self.decode_group_size]
            seq_lens = inputs.seq_lens[members]
            max_blocks = -(-int(seq_lens.max()) // bs)
            block_ids = inputs.block_table[members, :max_blocks].astype(np.int64)
            valid = np.arange(max_blocks * bs)[None, :] < seq_lens[:, None]
            # Additive float mask built once per step (SDPA would convert a boolean one in
            # every layer).
            mask = np.where(valid, 0.0, -np.inf).astype(np.float32)
            groups.append(
                DecodeGroup(
                    token_idx=torch.from_numpy(members.astype(np.int64)).to(device),
                    block_ids=torch.from_numpy(block_ids.reshape(-1)).to(device),
                    num_blocks=max_blocks,
                    mask=torch.from_numpy(mask).to(device, inputs.dtype)[:, None, None, :],
                )
            )

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
        return TorchAttentionMetadata(write_k, write_k + bs, groups, prefills)

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
        for group in metadata.decode_groups:
            g = group.token_idx.shape[0]
            # [g, kvh, L, d] views over freshly gathered [g * blocks, bs, kvh, d] copies.
            k = key_blocks.index_select(0, group.block_ids).view(g, -1, num_kv_heads, head_size)
            v = value_blocks.index_select(0, group.block_ids).view(g, -1, num_kv_heads, head_size)
            # One query token per request: the heads sharing a KV head act as query rows.
            q = query.index_select(0, group.token_idx).view(g, num_kv_heads, group_size, head_size)
            o = F.scaled_dot_product_attention(
                q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=group.mask, scale=scale
            )
            out.index_copy_(0, group.token_idx, o.reshape(g, -1, head_size))
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
            # Repeating the KV heads (instead of enable_gqa) keeps SDPA on its fused path.
            k = k.transpose(0, 1).repeat_interleave(group_size, dim=0).unsqueeze(0)
            v = v.transpose(0, 1).repeat_interleave(group_size, dim=0).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale
            )
            out[span.start : span.end] = o[0].transpose(0, 1)
        return out
