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
from tokenmill.worker.layers.linear import Loaded, matmul
from tokenmill.worker.parallel_state import get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce


class VocabParallelEmbedding(nn.Module):
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
        param.data.zero_()
        param.data[:rows].copy_(loaded.narrow(0, self.vocab_start, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_per_rank)
        y = F.embedding(local.masked_fill(outside, 0), self.weight)
        y.masked_fill_(outside.unsqueeze(-1), 0.0)
        return tp_all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logits = tp_all_gather(matmul(hidden, self.weight), dim=-1)
        return logits[..., : self.vocab_size]
