"""Vocabulary-parallel token embedding and LM head.

Each rank holds a contiguous slice of the (padded) vocabulary. The embedding looks up the ids
that fall in its slice and all-reduces; the LM head computes its slice of the logits and
all-gathers them, then drops the padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.protocol.utils import cdiv
from tokenmill.worker.layers.linear import Loaded, load_rows, matmul, quantized_matmul
from tokenmill.worker.parallel_state import get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce


class VocabParallelEmbedding(nn.Module):
    # Set by GGUF's finalize (worker/layers/quantization/gguf.py): the table as the file's
    # rows of blocks and their type (lookups de-quantize their rows), or, tied to a quantized
    # LM head, that head's blocks (`gguf_packed`); for an LM head, the weight in the CPU
    # kernels' layout. The weight parameter is then empty.
    gguf_rows: torch.Tensor | None = None
    gguf_type: int | None = None
    gguf_packed = None
    qweight = None

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size = vocab_size
        self.vocab_per_rank = cdiv(vocab_size, self.tp_size)
        self.vocab_start = self.tp_rank * self.vocab_per_rank
        self.weight = nn.Parameter(
            torch.empty(self.vocab_per_rank, hidden_size), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: Loaded) -> None:
        if loaded.shape[0] != self.vocab_size or loaded.shape[1] != param.shape[1]:
            raise ValueError(
                f"checkpoint embedding has shape {tuple(loaded.shape)}, expected "
                f"({self.vocab_size}, {param.shape[1]})"
            )
        # The last rank's slice may run past the vocabulary: its padding rows stay zero.
        rows = max(min(self.vocab_per_rank, self.vocab_size - self.vocab_start), 0)
        if getattr(loaded, "quantized", False):  # (finalize zeroes the padding if it de-quantizes)
            load_rows(param, loaded.narrow(0, self.vocab_start, rows))
            return
        param.data.zero_()
        param.data[:rows].copy_(loaded.narrow(0, self.vocab_start, rows))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.gguf_packed is not None:
            rows = self.gguf_packed.rows(ids.reshape(-1))
            return rows.to(self.weight.dtype).view(*ids.shape, -1)
        if self.gguf_rows is None:
            return F.embedding(ids, self.weight)
        from tokenmill.worker.layers.quantization.gguf import dequantize

        rows = dequantize(self.gguf_rows[ids.reshape(-1)], self.gguf_type)
        return rows.to(self.weight.dtype).view(*ids.shape, -1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_per_rank)
        y = self._lookup(local.masked_fill(outside, 0))
        y.masked_fill_(outside.unsqueeze(-1), 0.0)
        return tp_all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if self.qweight is not None:
            logits = tp_all_gather(quantized_matmul(hidden, self.qweight, None), dim=-1)
        else:
            logits = tp_all_gather(matmul(hidden, self.weight), dim=-1)
        return logits[..., : self.vocab_size]
