"""A step as the worker lays it out, and the KV caches its attention layers write.

`TokenLayout` puts the scheduled tokens of some requests flat (per token: its row and
position) and gives the attention backend its `StepAttentionInputs`: the model runner, the
draft model and the profile run all build their steps with it. `PreparedStep` is what the
runner's host part (`ModelRunner._prepare`) hands its device part (`_run_step`).
`kv_cache_specs` / `allocate_kv_caches` serve the target and the
draft model alike.
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from tokenmill.protocol.lora import LoRARequest
from tokenmill.protocol.scheduler_output import KVCacheSpec, SchedulerOutput
from tokenmill.protocol.utils import StageTimes, cdiv
from tokenmill.worker.attention.base import AttentionBackend, StepAttentionInputs
from tokenmill.worker.platform import zeroed_tensor


@dataclass
class TokenLayout:
    """Requests' scheduled tokens back to back: request i (batch row rows[i]) has query_lens[i]
    tokens from position starts[i] on."""

    rows: np.ndarray  # [R] batch rows
    query_lens: np.ndarray  # [R]
    seq_lens: np.ndarray  # [R] tokens in context after the step
    cu_query: np.ndarray  # [R + 1] where each request's tokens start, then the total
    token_rows: np.ndarray  # [T] each token's row
    positions: np.ndarray  # [T] each token's position in its request

    @classmethod
    def of(cls, rows: np.ndarray, starts: np.ndarray, query_lens: np.ndarray) -> TokenLayout:
        cu_query = np.concatenate(([0], np.cumsum(query_lens)))
        positions = np.arange(int(cu_query[-1])) - np.repeat(cu_query[:-1] - starts, query_lens)
        return cls(
            rows=rows,
            query_lens=query_lens,
            seq_lens=starts + query_lens,
            cu_query=cu_query,
            token_rows=np.repeat(rows, query_lens),
            positions=positions,
        )

    @property
    def num_tokens(self) -> int:
        return int(self.cu_query[-1])

    def block_table(self, table: np.ndarray, block_size: int) -> np.ndarray:
        """The requests' rows of the batch's block table, as many blocks as the longest needs."""
        return table[self.rows, : cdiv(int(self.seq_lens.max()), block_size)]

    def slot_mapping(self, table: np.ndarray, block_size: int) -> np.ndarray:
        """Each token's cache slot, from the batch's block table."""
        blocks = table[self.token_rows, self.positions // block_size]
        return blocks * block_size + self.positions % block_size

    def attention_inputs(
        self, table: np.ndarray, block_size: int, device: torch.device, dtype: torch.dtype
    ) -> StepAttentionInputs:
        """What the attention backend's build_metadata takes (decodes must come first)."""
        return StepAttentionInputs(
            num_decodes=int(np.count_nonzero(self.query_lens == 1)),
            query_lens=self.query_lens,
            seq_lens=self.seq_lens,
            block_table=self.block_table(table, block_size),
            slot_mapping=self.slot_mapping(table, block_size),
            block_size=block_size,
            device=device,
            dtype=dtype,
        )


class PromptLogprobChunk(NamedTuple):
    """A request's prompt positions this step scores: its position in the step, its span of
    hidden states, the prompt tokens they predict, the top k asked for."""

    index: int
    span: tuple[int, int]
    targets: np.ndarray
    k: int


@dataclass
class GraphInputs:
    """A decode step replayed from CUDA graphs (worker/cuda_graph.py): its captured shape and
    what its buffers take."""

    shape: tuple[int, int]
    query_lens: np.ndarray
    slot_mapping: np.ndarray
    seq_lens: np.ndarray
    block_table: np.ndarray


@dataclass(eq=False)
class PreparedStep:
    """A step as the host prepared it (ModelRunner._prepare), for its device part."""

    out: SchedulerOutput
    req_ids: list[str]  # in the step's order: decodes first
    layout: TokenLayout
    rope_positions: np.ndarray  # the rotary table's row per token (LongRoPE: the long rows)
    samples: np.ndarray  # per request: whether it samples this step (not a partial prefill)
    sample_rows: np.ndarray  # per row of logits: its batch row
    # per sampling request (in req_ids order): the proposed tokens it verifies; None: none
    num_drafts: np.ndarray | None
    prompt_logprobs: list[PromptLogprobChunk]
    timer: StageTimes  # the step's, synchronizing the device as a stage ends
    # Either the graphs' inputs, or the attention metadata and rotary positions on the device.
    graph_inputs: GraphInputs | None = None
    attn_metadata: Any = None
    positions_t: torch.Tensor | None = None
    logit_rows_t: torch.Tensor | None = None  # the hidden states that give logits (None: all)
    sample_rows_t: torch.Tensor | None = None  # sample_rows on the device
    # LoRA: each request's adapter id (0: none) and the step's adapters; None: none runs.
    lora_ids: list[int] | None = None
    lora_requests: dict[int, LoRARequest] = field(default_factory=dict)
    # Set once the device part has read the batch (the next step may then change it).
    inputs_taken: threading.Event = field(default_factory=threading.Event)
    future: Future | None = None

    @functools.cached_property
    def sampling(self) -> list[int]:
        """Positions in req_ids of the requests that sample."""
        return np.flatnonzero(self.samples).tolist()


def kv_cache_specs(
    model: torch.nn.Module, block_size: int, cache_dtype: torch.dtype
) -> list[KVCacheSpec]:
    """What each of the model's attention layers needs per block."""
    return [a.kv_cache_spec(block_size, cache_dtype) for a in model.attention_layers()]


def allocate_kv_caches(
    model: torch.nn.Module,
    backend: AttentionBackend,
    num_blocks: int,
    block_size: int,
    cache_dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """Every attention layer's cache, in the layout the backend asks for, given to the layer.
    Zeroed: attention reads whole blocks, including slots not yet written (masked out, but
    NaN garbage would survive the masking)."""
    specs = kv_cache_specs(model, block_size, cache_dtype)
    backend.set_block_bytes(max(spec.page_size_bytes for spec in specs))
    caches = []
    for attn in model.attention_layers():
        shape = backend.kv_cache_shape(num_blocks, block_size, attn.num_kv_heads, attn.head_size)
        attn.kv_cache = zeroed_tensor(shape, cache_dtype, device)
        caches.append(attn.kv_cache)
    return caches
