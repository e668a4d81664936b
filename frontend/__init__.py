"""The user's process: LLM, the engine front (tokenize, detokenize) and engine-core clients."""

from tokenmill.frontend.async_llm import AsyncLLM
from tokenmill.frontend.core_client import EngineDeadError
from tokenmill.frontend.llm import LLM
from tokenmill.frontend.outputs import CompletionOutput, RequestOutput
from tokenmill.protocol.messages import SamplingParams

__all__ = [
    "AsyncLLM",
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "EngineDeadError",
]
