"""What users get back, under vLLM's names: `RequestOutput` holding `CompletionOutput`s, and a
pooling model's `PoolingRequestOutput` (as `EmbeddingRequestOutput` from LLM.embed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Optional, TypeVar

import numpy as np

_O = TypeVar("_O")


@dataclass
class Logprob:
    """One token's log-probability at one position (vLLM's `Logprob`)."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


# Per position: token id -> Logprob, for the chosen token and the top k.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[Optional[dict[int, Logprob]]]  # the first position has none


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None  # with logprobs: the sum of the sampled ones
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # why the engine rejected the request, when it did


# ------------------------------------------------------------------------------ pooling
# vLLM's pooling outputs. `PoolingOutput.data` is a torch tensor as in vLLM; torch is imported
# when the first one is made, so that a frontend that only generates never loads it.


@dataclass
class PoolingOutput:
    """A pooling request's vector (float32; 1-D for an embedding)."""

    data: Any  # torch.Tensor

    @staticmethod
    def from_array(array: np.ndarray) -> PoolingOutput:
        import torch

        return PoolingOutput(torch.from_numpy(np.array(array, dtype=np.float32)))


@dataclass
class PoolingRequestOutput(Generic[_O]):
    """A pooling request's result (vLLM's): its output, the prompt's token ids, how many of
    them the prefix cache held, and `error` where the engine rejected it (then `outputs`
    holds an empty vector)."""

    request_id: str
    outputs: _O
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True
    error: str | None = None


@dataclass
class EmbeddingOutput:
    """An embedding as a list of floats (vLLM's)."""

    embedding: list[float]

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> EmbeddingOutput:
        data = pooling_output.data
        if data.ndim != 1:
            raise ValueError(f"an embedding is a 1-D vector, got shape {tuple(data.shape)}")
        return EmbeddingOutput(data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    """What LLM.embed returns per prompt (vLLM's)."""

    @staticmethod
    def from_base(request_output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return EmbeddingRequestOutput(
            request_id=request_output.request_id,
            outputs=EmbeddingOutput.from_base(request_output.outputs),
            prompt_token_ids=request_output.prompt_token_ids,
            num_cached_tokens=request_output.num_cached_tokens,
            finished=request_output.finished,
            error=request_output.error,
        )
