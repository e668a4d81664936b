"""Hermes-style calls (Qwen 2.5 / Qwen 3, Hermes 2 Pro, many fine-tunes): each call is a JSON
object {"name": ..., "arguments": {...}} between <tool_call> and </tool_call>; the text
before the first call is content. An unclosed last call counts when its JSON is whole."""

from __future__ import annotations

import json
import re

from tokenmill.frontend.server.tool_parsers.base import (
    ExtractedToolCalls,
    ToolParser,
    call_from_object,
    no_calls,
)

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


class HermesToolParser(ToolParser):
    name = "hermes"
    keeps_special_tokens = True

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        start = text.find("<tool_call>")
        if start < 0:
            return no_calls(text)
        try:
            calls = [
                call_from_object(json.loads(closed or unclosed))
                for closed, unclosed in _CALL.findall(text)
            ]
        except ValueError:  # (json's decode errors too) not a call after all: content
            return no_calls(text)
        return ExtractedToolCalls(True, calls, text[:start] or None)
