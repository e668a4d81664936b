"""Hermes-style calls (Qwen 2.5 / Qwen 3, Hermes 2 Pro, many fine-tunes): each call is a JSON
object {"name": ..., "arguments": {...}} between <tool_call> and </tool_call>; the text
before the first call is content, text between and after calls is dropped. An unclosed last
call counts (generation stopped at the end tag); a block that is not a call after the first
call is skipped. Streamed by the rules of streaming.py."""

from __future__ import annotations

from tokenmill.frontend.server.tool_parsers.base import ToolParser
from tokenmill.frontend.server.tool_parsers.streaming import ToolStream, find_marker

_START = "<tool_call>"


class HermesStream(ToolStream):
    def __init__(self) -> None:
        super().__init__()
        self._state = self._after_call = self._after_break = self._outside

    def _outside(self, text: str, pos: int, final: bool) -> int | None:
        """Outside the calls: content before the first, dropped after it."""
        cut, found = find_marker(text, pos, _START, final)
        if not self.tools_called:
            self._content.append(text[pos:cut])
        if not found:
            return cut if cut > pos else None
        if not self.tools_called:
            self._hold(cut)
        self._open_call()
        return cut + len(_START)


class HermesToolParser(ToolParser):
    name = "hermes"
    keeps_special_tokens = True

    def stream(self) -> HermesStream:
        return HermesStream()
