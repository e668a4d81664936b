"""The Triton attention backend: the CUDA default (kernels/attention.py).

Per step the metadata is a handful of small integer tensors: the cache slot of every new
token, the batch's block table rows, context lengths, query offsets, and two lists of query
tiles. Decodes (the first `num_decodes` requests, one token each) are one tile per request;
when their contexts are long and they are too few to fill the GPU, each context is split
across `num_splits` programs (flash-decoding) and the parts are merged. Prefill chunks are
tiles of `prefill_block_q` tokens. In each layer `forward` writes the new K/V into the cache,
then launches the decode tiles and the prefill tiles.

For CUDA graphs the same metadata is made of views of persistent buffers (`DecodeGraphs` in
worker/cuda_graph.py): a captured decode step reads whatever they hold when it is replayed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.kernels.attention import paged_attention, reshape_and_cache
from tokenmill.protocol.utils import cdiv
from tokenmill.worker.attention.base import AttentionBackend, StepAttentionInputs

# Decode contexts are split only into parts of at least this many keys, and only while the
# decodes alone give fewer than TARGET_PROGRAMS programs (2 per SM on a 132-SM H200).
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 16
TARGET_PROGRAMS = 264


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64; -1: a padded token
    block_table: torch.Tensor  # [R, max_blocks] int32
    seq_lens: torch.Tensor  # [R] int32
    query_start: torch.Tensor  # [R + 1] int32
    num_decodes: int
    num_splits: int
    decode_tiles: tuple[torch.Tensor, torch.Tensor]  # (request, first query token) per tile
    prefill_tiles: tuple[torch.Tensor, torch.Tensor]


class TritonAttentionBackend(AttentionBackend):
    def __init__(
        self,
        num_kv_heads: int,
        group_size: int,
        min_split_tokens: int = MIN_SPLIT_TOKENS,
        max_splits: int = MAX_SPLITS,
        target_programs: int = TARGET_PROGRAMS,
        prefill_block_q: int | None = None,
    ) -> None:
        """group_size: query heads per KV head. min_split_tokens, max_splits: see above
        (tests set a small min_split_tokens so that short contexts split too).
        prefill_block_q: query tokens per prefill tile (default: 64 rows of (token, head))."""
        self.num_kv_heads = num_kv_heads
        self.min_split_tokens = min_split_tokens
        self.max_splits = max_splits
        self.target_programs = target_programs
        group_pad = 1 << (group_size - 1).bit_length()
        self.prefill_block_q = prefill_block_q or max(1, 64 // group_pad)

    def decode_splits(self, num_decodes: int, max_seq_len: int | None) -> int:
        """How many parts each decode's context is cut into (max_seq_len None: unknown, as
        when a CUDA graph is captured for any context length)."""
        if num_decodes == 0:
            return 1
        splits = cdiv(self.target_programs, num_decodes * self.num_kv_heads)
        if max_seq_len is not None:
            splits = min(splits, cdiv(max_seq_len, self.min_split_tokens))
        return max(1, min(splits, self.max_splits))

    def build_metadata(self, inputs: StepAttentionInputs) -> TritonAttentionMetadata:
        device, nd = inputs.device, inputs.num_decodes
        query_lens = inputs.query_lens.astype(np.int64)
        query_start = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start[1:])
        # Prefill tiles: request r's chunk in pieces of prefill_block_q tokens.
        block_q = self.prefill_block_q
        counts = cdiv(query_lens[nd:], block_q)
        tile_req = np.repeat(np.arange(nd, len(query_lens), dtype=np.int32), counts)
        first_tile = np.repeat(np.cumsum(counts) - counts, counts)
        tile_q = ((np.arange(len(tile_req)) - first_tile) * block_q).astype(np.int32)
        max_seq = int(inputs.seq_lens[:nd].max()) if nd else 0

        def to_device(array: np.ndarray, dtype: np.dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array, dtype=dtype)).to(device)

        decode_req = torch.arange(nd, dtype=torch.int32, device=device)
        return TritonAttentionMetadata(
            slot_mapping=to_device(inputs.slot_mapping, np.int64),
            block_table=to_device(inputs.block_table, np.int32),
            seq_lens=to_device(inputs.seq_lens, np.int32),
            query_start=to_device(query_start, np.int32),
            num_decodes=nd,
            num_splits=self.decode_splits(nd, max_seq),
            decode_tiles=(decode_req, torch.zeros_like(decode_req)),
            prefill_tiles=(to_device(tile_req, np.int32), to_device(tile_q, np.int32)),
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        reshape_and_cache(key, value, kv_cache, metadata.slot_mapping)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        common = (kv_cache, metadata.block_table, metadata.seq_lens, metadata.query_start)
        nd = metadata.num_decodes
        if nd:
            paged_attention(
                out, query, *common, *metadata.decode_tiles, block_q=1, scale=scale,
                num_splits=metadata.num_splits, split_tokens=(0, nd),
            )  # fmt: skip
        if metadata.prefill_tiles[0].shape[0]:
            paged_attention(
                out, query, *common, *metadata.prefill_tiles,
                block_q=self.prefill_block_q, scale=scale,
            )  # fmt: skip
        return out
