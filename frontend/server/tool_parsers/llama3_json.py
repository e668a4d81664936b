"""Llama 3.1-3.3's JSON calls: the answer is one or more JSON objects {"name": ...,
"parameters": {...}} ("arguments" also taken), separated by ";" or whitespace, optionally
after <|python_tag|>. An answer that does not start with a call is content; text after the
calls is dropped. Streamed by the rules of streaming.py."""

from __future__ import annotations

from tokenmill.frontend.server.tool_parsers.base import ToolParser
from tokenmill.frontend.server.tool_parsers.streaming import ToolStream, skip

_TAG = "<|python_tag|>"


class Llama3JsonStream(ToolStream):
    _lead_marker = _TAG
    _opener = "{"

    def __init__(self) -> None:
        super().__init__()
        self._arguments_keys = ("arguments", "parameters")
        self._state = self._lead
        self._after_call = self._between
        self._hold(0)  # the answer is content unless a call starts

    def _open_calls(self, pos: int) -> int:
        self._open_call()
        return pos

    def _between(self, text: str, pos: int, final: bool) -> int | None:
        start, pos = pos, skip(text, pos)
        while pos < len(text) and text[pos] == ";":
            pos = skip(text, pos + 1)
        if pos == len(text):
            return pos if pos > start else None
        if text[pos] != "{":
            return self._fail(text, pos)
        self._open_call()
        return pos


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    keeps_special_tokens = True

    def stream(self) -> Llama3JsonStream:
        return Llama3JsonStream()
