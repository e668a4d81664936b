"""What every tool-call parser gives: the calls a chat answer's text holds, and the text
around them that stays content. The chat serving path (with `--enable-auto-tool-choice`)
hands a parser the model's detokenized output; the calls go out as OpenAI `tool_calls`."""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

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
    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """The calls in a whole answer; text that is not a well-formed call stays content."""


def no_calls(text: str) -> ExtractedToolCalls:
    return ExtractedToolCalls(False, [], text)


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


def call_from_object(obj: Any, arguments_keys: tuple[str, ...] = ("arguments",)) -> ToolCall:
    """A call written as {"name": ..., "arguments": {...}} (or another arguments key)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError(f"a tool call must be an object with a name, got {obj!r}")
    arguments = next((obj[k] for k in arguments_keys if k in obj), {})
    return ToolCall(obj["name"], arguments_json(arguments))
