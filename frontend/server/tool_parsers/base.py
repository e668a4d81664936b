"""What every tool-call parser gives: the calls a chat answer's text holds, and the text
around them that stays content. The chat serving path (with `--enable-auto-tool-choice`)
streams each choice through the parser's `stream()` (streaming.py); a whole answer is the
same stream fed at once (`collect`), so both ways read an answer the same."""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.frontend.server.tool_parsers.streaming import ToolStream


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = field(default_factory=tool_call_id)

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip


@dataclass
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None  # the text that is not a call (None: none)


class ToolParser(ABC):
    """One model family's way of writing tool calls (one parser a file, registered by name in
    tool_parsers/__init__.py). `keeps_special_tokens`: its markers are special tokens, so
    the answer must be detokenized with them (vLLM sets skip_special_tokens=False too)."""

    name: str
    keeps_special_tokens: bool = False

    @abstractmethod
    def stream(self) -> ToolStream:
        """A fresh stream for one choice's answer."""

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """The calls in a whole answer: what its stream gives for the answer in one piece."""
        return collect(self.stream(), text)


def collect(stream: ToolStream, text: str) -> ExtractedToolCalls:
    """A whole answer through a stream: its content deltas joined, its calls assembled."""
    parts = [stream.feed(text), stream.finish()]
    content = "".join(part.content for part in parts)
    calls: list[ToolCall] = []
    for delta in (delta for part in parts for delta in part.tool_calls):
        if delta.id is not None and delta.name is not None:  # a call's first delta
            calls.append(ToolCall(delta.name, delta.arguments, delta.id))
        else:
            calls[delta.index].arguments += delta.arguments
    return ExtractedToolCalls(bool(calls), calls, (content or None) if calls else content)


def arguments_json(arguments: Any) -> str:
    """A call's arguments as OpenAI's JSON string (non-ASCII kept, as vLLM's parsers do); a
    string is taken as JSON already when it parses as an object."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            return json.dumps(parsed, ensure_ascii=False)
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise ValueError(f"tool call arguments must be an object, got {arguments!r}")
    return json.dumps(arguments, ensure_ascii=False)
