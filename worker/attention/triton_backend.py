"""The Triton attention backend: the CUDA default (kernels/attention.py).

Per step the metadata is a handful of small integer tensors: the cache slot of every new
token, the batch's block table rows, context lengths, query offsets, and two lists of query
tiles, sent to the device in one asynchronous copy (worker/staging.py). Decodes (the first
`num_decodes` requests, one token each) are one tile per request; when their contexts are
long and they are too few to fill the GPU, each context is split across `num_splits`
programs (flash-decoding) and the parts are merged. Prefill chunks are tiles of
`prefill_block_q` tokens. In each layer `forward` writes the new K/V into the cache, then
launches the decode tiles and the prefill tiles.

In the batch-invariant mode (kernels/batch_invariant.py) every query token is computed as a
decode is: prefill tiles of one token (the whole step's K/V is in the cache before attention,
so a prefill token can attend alone over its causal context) and no split. A token's keys are
then walked BLOCK_N at a time from 0 to its own position by the same compiled kernel, whether
it is a decode, a prefill chunk's token, a recomputed one or a verified proposal. A split by
the token's own context length would be invariant too, but a CUDA graph fixes its splits per
batch size for any context length, and prefill tiles would need the split buffers as well;
one part keeps both simple, for the price of flash-decoding's parallelism on few long decodes.

For CUDA graphs the same metadata is made of views of persistent buffers (`DecodeGraphs` in
worker/cuda_graph.py): a captured decode step reads whatever they hold when it is replayed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.kernels.attention import paged_attention, reshape_and_cache, split_scratch_for
from tokenmill.kernels.batch_invariant import batch_invariant
from tokenmill.protocol.utils import cdiv
from tokenmill.worker.attention.base import AttentionBackend, StepAttentionInputs
from tokenmill.worker.staging import HostStaging

# Decode contexts are split only into parts of at least this many keys, and only while the
# decodes alone give fewer programs than the target (default: 2 per SM of the GPU).
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 16
DEFAULT_TARGET_PROGRAMS = 264  # an H200's 132 SMs, where the device does not say


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int32; -1: a padded token
    block_table: torch.Tensor  # [R, blocks] int32 (as many columns as the longest context)
    seq_lens: torch.Tensor  # [R] int32
    query_start: torch.Tensor  # [R + 1] int32
    num_decodes: int
    num_splits: int
    decode_tiles: tuple[torch.Tensor, torch.Tensor]  # (request, first query token) per tile
    prefill_tiles: tuple[torch.Tensor, torch.Tensor]
    # Partial outputs and log-sum-exps of split decodes, shared by every layer of the step.
    split_scratch: tuple[torch.Tensor, torch.Tensor] | None


class TritonAttentionBackend(AttentionBackend):
    name = "TRITON_ATTN"
    captures_steps = True

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        device: torch.device,
        dtype: torch.dtype,
        min_split_tokens: int = MIN_SPLIT_TOKENS,
        max_splits: int = MAX_SPLITS,
        prefill_block_q: int | None = None,
    ) -> None:
        """Heads are this rank's. min_split_tokens, max_splits: see above (tests set a small
        min_split_tokens so that short contexts split too). prefill_block_q: query tokens per
        prefill tile (default: 64 rows of (token, head); 32 in fp32 on a GPU, whose IEEE
        dots have no tensor cores and need the shared memory; 1 in the batch-invariant
        mode, read when the backend is made)."""
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.device = device
        self.min_split_tokens = min_split_tokens
        self.max_splits = max_splits
        self.target_programs = DEFAULT_TARGET_PROGRAMS
        if device.type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            self.target_programs = 2 * sms
        group_pad = 1 << (num_heads // num_kv_heads - 1).bit_length()
        rows = 32 if dtype == torch.float32 and device.type == "cuda" else 64
        self.prefill_block_q = prefill_block_q or max(1, rows // group_pad)
        self.invariant = batch_invariant()
        if self.invariant:
            self.prefill_block_q = 1  # a decode's tile
        self.staging = HostStaging(device)

    def decode_splits(self, num_decodes: int, max_seq_len: int | None) -> int:
        """How many parts each decode's context is cut into (max_seq_len None: unknown, as
        when a CUDA graph is captured for any context length)."""
        if num_decodes == 0 or self.invariant:
            return 1
        splits = cdiv(self.target_programs, num_decodes * self.num_kv_heads)
        if max_seq_len is not None:
            splits = min(splits, cdiv(max_seq_len, self.min_split_tokens))
        return max(1, min(splits, self.max_splits))

    def split_scratch(self, num_decodes: int, num_splits: int):
        if num_splits == 1:
            return None
        return split_scratch_for(
            num_decodes, self.num_heads, num_splits, self.head_size, self.device
        )

    def build_metadata(self, inputs: StepAttentionInputs) -> TritonAttentionMetadata:
        nd = inputs.num_decodes
        query_lens = inputs.query_lens.astype(np.int64)
        query_start = np.zeros(len(query_lens) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start[1:])
        # Prefill tiles: request r's chunk in pieces of prefill_block_q tokens, the last
        # pieces (the longest causal spans) first, so that they do not trail at the end.
        block_q = self.prefill_block_q
        counts = cdiv(query_lens[nd:], block_q)
        tile_req = np.repeat(np.arange(nd, len(query_lens)), counts)
        first_tile = np.repeat(np.cumsum(counts) - counts, counts)
        tile_q = (np.arange(len(tile_req)) - first_tile) * block_q
        max_seq = int(inputs.seq_lens[:nd].max()) if nd else 0
        width = cdiv(int(inputs.seq_lens.max()), inputs.block_size)
        slots, table, seq_lens, starts, prefill_req, prefill_q, decode_req = self.staging.to_device(
            inputs.slot_mapping,
            inputs.block_table[:, :width],
            inputs.seq_lens,
            query_start,
            tile_req[::-1],
            tile_q[::-1],
            np.arange(nd),
        )
        num_splits = self.decode_splits(nd, max_seq)
        return TritonAttentionMetadata(
            slot_mapping=slots,
            block_table=table,
            seq_lens=seq_lens,
            query_start=starts,
            num_decodes=nd,
            num_splits=num_splits,
            decode_tiles=(decode_req, torch.zeros_like(decode_req)),
            prefill_tiles=(prefill_req, prefill_q),
            split_scratch=self.split_scratch(nd, num_splits),
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        reshape_and_cache(key, value, kv_cache, metadata.slot_mapping)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        common = (kv_cache, metadata.block_table, metadata.seq_lens, metadata.query_start)
        layer = dict(scale=scale, window=window, softcap=softcap)
        nd = metadata.num_decodes
        if nd:
            paged_attention(
                out, query, *common, *metadata.decode_tiles, block_q=1,
                num_splits=metadata.num_splits, split_tokens=(0, nd),
                split_scratch=metadata.split_scratch, **layer,
            )  # fmt: skip
        if metadata.prefill_tiles[0].shape[0]:
            paged_attention(
                out, query, *common, *metadata.prefill_tiles,
                block_q=self.prefill_block_q, **layer,
            )  # fmt: skip
        return out
