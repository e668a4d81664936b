"""Tool-call parsers by name (`--tool-call-parser`, vLLM's names), one file each, imported
when chosen. The chat serving path asks `tool_parser(name)` for the parser, and streams a
choice through `parser.stream()` (or `named_stream` / `required_stream` for a constrained
tool_choice)."""

from __future__ import annotations

import importlib

from tokenmill.frontend.server.tool_parsers.base import (
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    collect,
)
from tokenmill.frontend.server.tool_parsers.constrained import named_stream, required_stream
from tokenmill.frontend.server.tool_parsers.streaming import (
    StreamDelta,
    ToolCallDelta,
    ToolStream,
)

TOOL_PARSERS = {
    "hermes": "tokenmill.frontend.server.tool_parsers.hermes:HermesToolParser",
    "llama3_json": "tokenmill.frontend.server.tool_parsers.llama3_json:Llama3JsonToolParser",
    "mistral": "tokenmill.frontend.server.tool_parsers.mistral:MistralToolParser",
    "pythonic": "tokenmill.frontend.server.tool_parsers.pythonic:PythonicToolParser",
}


def tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(
            f"tool_call_parser {name!r} is not one of {', '.join(sorted(TOOL_PARSERS))}"
        )
    module, cls = TOOL_PARSERS[name].split(":")
    return getattr(importlib.import_module(module), cls)()


__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCalls",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolStream",
    "collect",
    "named_stream",
    "required_stream",
    "tool_parser",
]
