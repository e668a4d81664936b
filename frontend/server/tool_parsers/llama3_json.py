"""Llama 3.1-3.3's JSON calls: the answer is one or more JSON objects {"name": ...,
"parameters": {...}} ("arguments" also taken), separated by ";", optionally after
<|python_tag|>. An answer that does not start with one is content."""

from __future__ import annotations

import json

from tokenmill.frontend.server.tool_parsers.base import (
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    call_from_object,
    no_calls,
)

_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    keeps_special_tokens = True

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        body = text.strip()
        if body.startswith(_TAG):
            body = body[len(_TAG) :].lstrip()
        if not body.startswith("{"):
            return no_calls(text)
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        at = 0
        try:
            while at < len(body):
                obj, end = decoder.raw_decode(body, at)
                calls.append(call_from_object(obj, ("arguments", "parameters")))
                at = end
                while at < len(body) and body[at] in " \t\n;":
                    at += 1
        except ValueError:
            return no_calls(text)
        return ExtractedToolCalls(True, calls, None)
