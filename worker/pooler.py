"""The pooling stage of a pooling model's step: one vector per prompt, from the hidden states
the model's final norm gives (a causal LM converted with convert="embed", its LM head
dropped by `drop_lm_head`).

The ModelRunner hands `Pooler.pool` each step's hidden states with the step's layout. A
prompt chunked across steps pools as one: what its earlier chunks gave is kept by request id,
not by batch row (MEAN: a running fp32 sum and count; CLS: the first token's state). On its
last chunk a request's vector is pooled in fp32, cut to its `dimensions` (Matryoshka), then
L2-normalized where asked. The runner drops the state of finished and preempted requests (a
preempted prompt is computed again from its start).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from tokenmill.protocol.config import PoolerConfig
from tokenmill.protocol.messages import PoolingParams
from tokenmill.worker.staging import to_device


class Pooler:
    def __init__(self, config: PoolerConfig) -> None:
        assert config.pooling_type in ("LAST", "MEAN", "CLS"), config.pooling_type
        self.pooling_type = config.pooling_type
        # What a request that leaves them unset gets (the frontend fills them in; a client
        # that builds its own requests may not).
        self.normalize = config.normalize is not False
        self.dimensions = config.dimensions
        # MEAN: (sum of the hidden states so far, their count); CLS: (the first token's, 1).
        self.partial: dict[str, tuple[torch.Tensor, int]] = {}

    def drop(self, req_ids: Sequence[str]) -> None:
        for req_id in req_ids:
            self.partial.pop(req_id, None)

    def pool(
        self,
        hidden: torch.Tensor,
        req_ids: Sequence[str],
        starts: np.ndarray,
        cu_query: np.ndarray,
        finals: np.ndarray,
        params: dict[str, PoolingParams],
    ) -> dict[str, np.ndarray]:
        """The vectors of the requests whose last chunk this is (`finals`), by request id.
        Request i's chunk is hidden[cu_query[i]:cu_query[i + 1]], its tokens from prompt
        position starts[i] on; params: each final request's (defaults filled in)."""
        if self.pooling_type == "LAST":
            # Only the prompt's last token counts: earlier chunks (and a prefix-cache hit
            # before them) need no state.
            rows = to_device(cu_query[1:][finals] - 1, hidden.device)
            pooled = list(hidden[rows].float())
        else:
            pooled = self._accumulate(hidden, req_ids, starts, cu_query, finals)
        final_ids = [r for r, last in zip(req_ids, finals.tolist()) if last]
        return self._finish(final_ids, pooled, params)

    def _accumulate(
        self,
        hidden: torch.Tensor,
        req_ids: Sequence[str],
        starts: np.ndarray,
        cu_query: np.ndarray,
        finals: np.ndarray,
    ) -> list[torch.Tensor]:
        """MEAN and CLS: adds each chunk to its request's state; the final ones' vectors."""
        num_reqs = len(req_ids)
        lens = np.diff(cu_query)
        if self.pooling_type == "MEAN":
            segments = to_device(np.repeat(np.arange(num_reqs), lens), hidden.device)
            sums = torch.zeros(num_reqs, hidden.shape[-1], dtype=torch.float32,
                               device=hidden.device)  # fmt: skip
            chunk_states = sums.index_add_(0, segments, hidden.float())
        else:
            chunk_states = hidden[to_device(cu_query[:-1], hidden.device)].float()
        pooled = []
        for i, req_id in enumerate(req_ids):
            state, count = chunk_states[i], int(lens[i])
            earlier = self.partial.pop(req_id, None) if starts[i] > 0 else None
            if earlier is not None:
                if self.pooling_type == "MEAN":
                    state, count = earlier[0] + state, earlier[1] + count
                else:
                    state, count = earlier
            if finals[i]:
                pooled.append(state / count if self.pooling_type == "MEAN" else state)
            else:
                self.partial[req_id] = (state, count)
        return pooled

    def _finish(
        self, req_ids: list[str], pooled: list[torch.Tensor], params: dict[str, PoolingParams]
    ) -> dict[str, np.ndarray]:
        """Each vector cut to its request's dimensions, then normalized where asked; brought
        to the host in one copy."""
        if not req_ids:
            return {}
        vectors = []
        for req_id, vector in zip(req_ids, pooled):
            p = params[req_id]
            dimensions = p.dimensions if p.dimensions is not None else self.dimensions
            if dimensions is not None:
                vector = vector[:dimensions]
            if p.normalize if p.normalize is not None else self.normalize:
                vector = F.normalize(vector, p=2, dim=-1)
            vectors.append(vector)
        flat = torch.cat(vectors).cpu().numpy()
        ends = np.cumsum([len(v) for v in vectors])
        return dict(zip(req_ids, np.split(flat, ends[:-1])))


def drop_lm_head(model: torch.nn.Module) -> None:
    """A causal LM as an embedding model (vLLM's convert="embed"): the pooler reads the
    final norm's hidden states, so the LM head goes once built and is never loaded (a
    checkpoint may lack it; an untied one is vocabulary x hidden of memory saved)."""
    model.lm_head = None
