"""CUDA graphs for decode-only steps (vLLM's "piecewise"-free, full-model decode graphs).

A decode step of a small model on a GPU is mostly kernel launch overhead: the same few hundred
launches every step. At start-up, after the KV cache exists, the model's forward for a
decode-only batch is captured once per padded batch size (`cudagraph_capture_sizes`), reading
its inputs and attention metadata from persistent buffers. A later decode-only step of n
requests copies its inputs into the buffers, pads them to the smallest captured size >= n
(padded tokens write to cache slot -1, i.e. nowhere, and attend to no keys), replays, and
reads the first n rows of the captured output. Mixed and prefill steps, and decode batches
larger than every captured size, run eagerly.

With `capture=False` the same buffers and padding run eagerly (no graph): how the CPU tests
check this path's bookkeeping without a GPU.
"""

from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch

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
    ) -> None:
        self.model = model
        self.backend = backend
        self.sizes = sorted(sizes)
        self.device = device
        self.capture_graphs = capture
        largest = self.sizes[-1]
        int32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(largest, **int32)
        self.positions = torch.zeros(largest, **int32)
        self.slot_mapping = torch.full((largest,), -1, **int32)
        self.seq_lens = torch.zeros(largest, **int32)
        self.block_table = torch.zeros(largest, max_blocks_per_req, **int32)
        self.query_start = torch.arange(largest + 1, **int32)  # one token per request
        self.decode_req = torch.arange(largest, **int32)
        self.tile_q = torch.zeros(largest, **int32)
        self.no_tiles = torch.zeros(0, **int32)
        # One buffer for the split decodes' partial results, viewed per size.
        heads, d = backend.num_heads, backend.head_size
        rows = max(size * backend.decode_splits(size, None) for size in self.sizes)
        self.split_buffer = torch.empty(rows * heads * (d + 1), dtype=torch.float32, device=device)
        self.staging = HostStaging(device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_steps = 0  # steps run through these buffers

    def metadata(self, size: int) -> TritonAttentionMetadata:
        """Views of the persistent buffers for a batch of `size` decodes."""
        splits = self.backend.decode_splits(size, None)  # for any context length
        scratch = None
        if splits > 1:
            heads, d = self.backend.num_heads, self.backend.head_size
            n = size * heads * splits
            partial = self.split_buffer[: n * d].view(size, heads, splits, d)
            scratch = (partial, self.split_buffer[n * d : n * (d + 1)].view(size, heads, splits))
        return TritonAttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_table=self.block_table[:size],
            seq_lens=self.seq_lens[:size],
            query_start=self.query_start[: size + 1],
            num_decodes=size,
            num_splits=splits,
            decode_tiles=(self.decode_req[:size], self.tile_q[:size]),
            prefill_tiles=(self.no_tiles, self.no_tiles),
            split_scratch=scratch,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every size, largest first, all in one memory pool (each replay's
        activations fit in what the largest one took)."""
        if not self.capture_graphs:
            return
        start = time.monotonic()
        pool = None
        side = torch.cuda.Stream(self.device)
        for size in reversed(self.sizes):
            with set_forward_context(self.metadata(size)):
                # Warm-up runs compile the kernels (nothing may compile inside a capture), on
                # a side stream as torch recommends before a capture.
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(2):
                        self.model(self.input_ids[:size], self.positions[:size])
                torch.cuda.current_stream(self.device).wait_stream(side)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.model(self.input_ids[:size], self.positions[:size])
            pool = graph.pool()
            self.graphs[size] = graph
            self.outputs[size] = out
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured CUDA graphs for decode batches of %s requests in %.1f s",
            self.sizes,
            time.monotonic() - start,
        )

    def padded_size(self, num_decodes: int) -> int | None:
        """The captured size a batch of num_decodes runs at (None: larger than all)."""
        i = bisect.bisect_left(self.sizes, num_decodes)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        seq_lens: np.ndarray,
        block_table: np.ndarray,
    ) -> torch.Tensor:
        """One decode-only step of n = len(input_ids) requests; returns [n, hidden]."""
        n = len(input_ids)
        size = self.padded_size(n)
        self.num_steps += 1
        assert size is not None, f"a decode batch of {n} is larger than every captured size"
        width = block_table.shape[1]
        assert width <= self.block_table.shape[1]

        def padded(values: np.ndarray, pad: int) -> np.ndarray:
            return np.concatenate((values, np.full(size - n, pad, dtype=values.dtype)))

        # Padded rows write to slot -1 (nowhere) and attend to nothing (seq_len 0). Only the
        # block table's first `width` columns are read: seq_lens bounds every request's reads.
        self.staging.copy_into(
            [
                (self.input_ids[:size], padded(input_ids, 0)),
                (self.positions[:size], padded(positions, 0)),
                (self.slot_mapping[:size], padded(slot_mapping, -1)),
                (self.seq_lens[:size], padded(seq_lens, 0)),
                (self.block_table[:n, :width], block_table),
            ]
        )
        graph = self.graphs.get(size)
        if graph is not None:
            graph.replay()
            return self.outputs[size][:n]
        with set_forward_context(self.metadata(size)):
            return self.model(self.input_ids[:size], self.positions[:size])[:n]
