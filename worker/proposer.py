"""Speculative decoding's proposers behind one interface, chosen by name.

The model runner holds at most one `Proposer` (speculative_config.method): after a step that
the scheduler marks `propose` it asks it for up to k tokens per request that sampled, which
the next step verifies (worker/spec_decode.py's rejection sampler). A proposer with a model
of its own (the draft model; EAGLE or MTP heads would be the same) loads it, declares its
attention layers' KV needs, gets its caches allocated and is included in the profile run.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.protocol.config import EngineConfig
from tokenmill.protocol.scheduler_output import KVCacheSpec

if TYPE_CHECKING:
    from tokenmill.worker.attention.base import AttentionBackend
    from tokenmill.worker.input_batch import InputBatch


class Proposer(ABC):
    @classmethod
    @abstractmethod
    def from_config(cls, config: EngineConfig, device: torch.device) -> Proposer: ...

    @abstractmethod
    def propose_rows(self, batch: InputBatch, rows: np.ndarray) -> list[list[int]]:
        """Up to k tokens for each batch row, to follow its last token (none: [])."""

    def load(self) -> None:
        """Loads the proposer's own model, if it has one (with the target's)."""

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """Its attention layers' needs (its cache has as many blocks as the target's and
        shares its block table)."""
        return []

    def allocate(self, config: EngineConfig, num_blocks: int) -> list[torch.Tensor]:
        """Its caches, under the config as the core settled it."""
        return []

    def profiled_models(self) -> list[tuple[torch.nn.Module, AttentionBackend, int]]:
        """(model, attention backend, max positions) of what a profile run must include."""
        return []


# speculative_config.method -> the proposer's class, imported when chosen.
PROPOSERS = {
    "ngram": "tokenmill.worker.spec_decode:NgramProposer",
    "draft_model": "tokenmill.worker.draft_model:DraftModel",
}


def make_proposer(config: EngineConfig, device: torch.device) -> Proposer | None:
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method not in PROPOSERS:
        raise ValueError(
            f"speculative_config method {spec.method!r} is not one of {sorted(PROPOSERS)}"
        )
    module, name = PROPOSERS[spec.method].split(":")
    cls: type[Proposer] = getattr(importlib.import_module(module), name)
    return cls.from_config(config, device)
