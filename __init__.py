"""tokenmill: an LLM inference engine with vLLM V1's architecture.

The public names mirror vLLM's (`from tokenmill import LLM, SamplingParams`). They are
resolved lazily so that importing a subpackage (the protocol in a worker, say) does not pull
in the whole frontend.
"""

from __future__ import annotations

import os
import sys
from typing import Any

__version__ = "0.1.0"


def _unshadow() -> None:
    """This package's folder is the repository's root, whose subfolders (kernels/, core/, ...)
    shadow PyPI packages of the same names while the root is on sys.path, as it is for
    `python -m ...` run there (transformers imports the `kernels` package): the root goes."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]


_unshadow()

_PUBLIC = {
    "LLM": "tokenmill.frontend.llm",
    "AsyncLLM": "tokenmill.frontend.async_llm",
    "SamplingParams": "tokenmill.protocol.messages",
    "PoolingParams": "tokenmill.protocol.messages",
    "PoolingOutput": "tokenmill.frontend.outputs",
    "PoolingRequestOutput": "tokenmill.frontend.outputs",
    "EmbeddingOutput": "tokenmill.frontend.outputs",
    "EmbeddingRequestOutput": "tokenmill.frontend.outputs",
    "RequestOutput": "tokenmill.frontend.outputs",
    "CompletionOutput": "tokenmill.frontend.outputs",
    "Logprob": "tokenmill.frontend.outputs",
    "StructuredOutputsParams": "tokenmill.protocol.messages",
    "RequestOutputKind": "tokenmill.protocol.messages",
    "EngineArgs": "tokenmill.protocol.config",
    "EngineDeadError": "tokenmill.frontend.core_client",
    "BeamSearchParams": "tokenmill.frontend.beam_search",
    "BeamSearchOutput": "tokenmill.frontend.beam_search",
    "LoRARequest": "tokenmill.protocol.lora",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
