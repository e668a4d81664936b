"""CUDA graphs for decode-only steps (vLLM's "piecewise"-free, full-model decode graphs), and
for the (1 + k)-token steps that verify speculative proposals.

A decode step of a small model on a GPU is mostly kernel launch overhead: the same few hundred
launches every step. At start-up, after the KV cache exists, the model's forward is captured
once per shape, reading its inputs and attention metadata from persistent buffers. A shape is
(padded batch size, query tokens per request): q = 1 for plain decodes, at each of
`cudagraph_capture_sizes`; q = 1 + k for verify steps (k proposed tokens), at the sizes whose
tokens fit the step's token budget. A later step whose requests are all decodes, or decodes
with at most k proposals each, copies its inputs into the buffers, pads them to the smallest
captured shape, replays, and reads back its own rows. Prefill chunks and batches larger than
every captured size run eagerly.

Padding: a padded request writes to cache slot -1 (nowhere) and attends to nothing (seq_len
0). In a verify shape, a request with j < k proposals has its 1 + j tokens first in its q rows
and q - 1 - j padded tokens after them; its seq_len grows by as many, so that its real tokens
keep their positions and causal limits (a query token is the last of seq_len's positions),
and only the padded rows see the extra (stale) keys. Their outputs are dropped.

With `capture=False` the same buffers and padding run eagerly (no graph): how the CPU tests
check this path's bookkeeping without a GPU.
"""

from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch

from tokenmill.protocol.utils import cdiv
from tokenmill.worker.attention.triton_backend import (
    TritonAttentionBackend,
    TritonAttentionMetadata,
)
from tokenmill.worker.forward_context import set_forward_context
from tokenmill.worker.staging import HostStaging

logger = logging.getLogger(__name__)


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        backend: TritonAttentionBackend,
        sizes: list[int],
        max_blocks_per_req: int,
        device: torch.device,
        capture: bool = True,
        verify_len: int = 1,
        max_tokens: int | None = None,
    ) -> None:
        """sizes: the batch sizes of plain decodes. verify_len: 1 + k, the query tokens of a
        verify step (1: no speculation); its shapes are the sizes of at most max_tokens."""
        self.model = model
        self.backend = backend
        self.device = device
        self.capture_graphs = capture
        self.verify_len = verify_len
        self.sizes = {1: sorted(sizes)}
        if verify_len > 1:
            cap = max_tokens if max_tokens is not None else max(sizes) * verify_len
            fit = [s for s in sizes if s * verify_len <= cap]
            if fit:
                self.sizes[verify_len] = sorted(fit)
        requests = max(max(s) for s in self.sizes.values())
        tokens = max(max(s) * q for q, s in self.sizes.items())
        int32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(tokens, **int32)
        self.positions = torch.zeros(tokens, **int32)
        self.slot_mapping = torch.full((tokens,), -1, **int32)
        self.token_rows = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(requests, **int32)
        # (Padded verify rows read up to verify_len - 1 keys past a request's own: the
        # caller's width counts them.)
        self.block_table = torch.zeros(requests, max_blocks_per_req, **int32)
        self.no_tiles = torch.zeros(0, **int32)
        # Per query length: each request's first token, and its attention tiles (request,
        # first query token), request by request so that a size's tiles are a prefix.
        self.query_start: dict[int, torch.Tensor] = {}
        self.tiles: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        for q in self.sizes:
            self.query_start[q] = torch.arange(requests + 1, **int32) * q
            block_q = 1 if q == 1 else backend.prefill_block_q
            per_req = cdiv(q, block_q)
            tile_req = torch.arange(requests, **int32).repeat_interleave(per_req)
            tile_q = (torch.arange(per_req, **int32) * block_q).repeat(requests)
            self.tiles[q] = (tile_req, tile_q, per_req)
        # One buffer for the split decodes' partial results, viewed per size.
        heads, d = backend.num_heads, backend.head_size
        rows = max(size * backend.decode_splits(size, None) for size in self.sizes[1])
        self.split_buffer = torch.empty(rows * heads * (d + 1), dtype=torch.float32, device=device)
        self.staging = HostStaging(device)
        self.row_staging = HostStaging(device, torch.int64)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.num_steps = 0  # steps run through these buffers
        self.num_verify_steps = 0  # of which verify steps

    def metadata(self, size: int, q: int = 1) -> TritonAttentionMetadata:
        """Views of the persistent buffers for a batch of `size` requests of q tokens each."""
        tile_req, tile_q, per_req = self.tiles[q]
        tiles = (tile_req[: size * per_req], tile_q[: size * per_req])
        common = dict(
            slot_mapping=self.slot_mapping[: size * q],
            block_table=self.block_table[:size],
            seq_lens=self.seq_lens[:size],
            query_start=self.query_start[q][: size + 1],
        )
        if q > 1:  # verify tokens attend as prefill tiles do (causal within the request)
            return TritonAttentionMetadata(
                **common, num_decodes=0, num_splits=1, decode_tiles=(self.no_tiles,) * 2,
                prefill_tiles=tiles, split_scratch=None,
            )  # fmt: skip
        splits = self.backend.decode_splits(size, None)  # for any context length
        scratch = None
        if splits > 1:
            heads, d = self.backend.num_heads, self.backend.head_size
            n = size * heads * splits
            partial = self.split_buffer[: n * d].view(size, heads, splits, d)
            scratch = (partial, self.split_buffer[n * d : n * (d + 1)].view(size, heads, splits))
        return TritonAttentionMetadata(
            **common, num_decodes=size, num_splits=splits, decode_tiles=tiles,
            prefill_tiles=(self.no_tiles,) * 2, split_scratch=scratch,
        )  # fmt: skip

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every shape, most tokens first, all in one memory pool (each replay's
        activations fit in what the largest one took)."""
        if not self.capture_graphs:
            return
        start = time.monotonic()
        pool = None
        side = torch.cuda.Stream(self.device)
        shapes = sorted(((s, q) for q, sizes in self.sizes.items() for s in sizes),
                        key=lambda shape: -shape[0] * shape[1])  # fmt: skip
        for size, q in shapes:
            tokens = size * q
            with set_forward_context(self.metadata(size, q)):
                # Warm-up runs compile the kernels (nothing may compile inside a capture), on
                # a side stream as torch recommends before a capture.
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(2):
                        self.model(self.input_ids[:tokens], self.positions[:tokens])
                torch.cuda.current_stream(self.device).wait_stream(side)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.model(self.input_ids[:tokens], self.positions[:tokens])
            pool = graph.pool()
            self.graphs[size, q] = graph
            self.outputs[size, q] = out
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured CUDA graphs for decode batches of %s requests (and %s verifying %d "
            "tokens) in %.1f s",
            self.sizes[1],
            self.sizes.get(self.verify_len, []),
            self.verify_len,
            time.monotonic() - start,
        )

    def shape_for(self, query_lens: np.ndarray) -> tuple[int, int] | None:
        """The captured (size, q) a step of requests with these query lengths (each a decode
        and its proposals) runs at; None: larger than every captured shape."""
        longest = int(query_lens.max())
        q = 1 if longest == 1 else self.verify_len
        if longest > q or q not in self.sizes:
            return None
        sizes = self.sizes[q]
        i = bisect.bisect_left(sizes, len(query_lens))
        return (sizes[i], q) if i < len(sizes) else None

    def run(
        self,
        shape: tuple[int, int],
        query_lens: np.ndarray,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        seq_lens: np.ndarray,
        block_table: np.ndarray,
    ) -> torch.Tensor:
        """One step of n = len(query_lens) requests at `shape` (from shape_for); returns the
        hidden states of its tokens in their order, [sum(query_lens), hidden]."""
        size, q = shape
        n, total = len(query_lens), len(input_ids)
        self.num_steps += 1
        width = block_table.shape[1]
        assert n <= size and width <= self.block_table.shape[1]
        tokens = size * q
        # Each request's tokens first in its q rows; the rest padding (see the docstring).
        rows = np.arange(total) + np.repeat(np.arange(n) * q - np.cumsum(query_lens)
                                            + query_lens, query_lens)  # fmt: skip

        def padded(values: np.ndarray, pad: int, length: int, at=None) -> np.ndarray:
            full = np.full(length, pad, dtype=values.dtype)
            full[at if at is not None else slice(len(values))] = values
            return full

        pairs = [
            (self.input_ids[:tokens], padded(input_ids, 0, tokens, rows)),
            (self.positions[:tokens], padded(positions, 0, tokens, rows)),
            (self.slot_mapping[:tokens], padded(slot_mapping, -1, tokens, rows)),
            (self.seq_lens[:size], padded(seq_lens + (q - query_lens), 0, size)),
            # Only the first `width` columns (and the padded rows' extra keys) are read.
            (self.block_table[:n, :width], block_table),
        ]
        self.staging.copy_into(pairs)
        if q > 1:
            self.num_verify_steps += 1
            self.row_staging.copy_into([(self.token_rows[:total], rows)])
        graph = self.graphs.get(shape)
        if graph is not None:
            graph.replay()
            out = self.outputs[shape]
        else:
            with set_forward_context(self.metadata(size, q)):
                out = self.model(self.input_ids[:tokens], self.positions[:tokens])
        return out[:n] if q == 1 else out.index_select(0, self.token_rows[:total])
