"""Streams for the answers tool_choice.py constrains (a `required` or named tool_choice):
the chat serving path streams such a choice through `named_stream(name)` or
`required_stream()` instead of a parser's. Their answers hold no content.

Named: the answer is the function's arguments object; it streams as call 0's arguments
(canonical JSON, name on the first delta), and an answer that is no object gives {}.
Required: the answer is a JSON list of {"name": ..., "parameters": {...}}; each becomes a
call, name once, then its parameters in fragments (the rules of streaming.py)."""

from __future__ import annotations

from tokenmill.frontend.server.tool_parsers.streaming import SPACE, ToolStream, skip


class NamedStream(ToolStream):
    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name
        self._open_call(name)

    def _end(self) -> None:
        super()._end()
        if not self.tools_called:
            self.start_call(self._name, "{}")


class RequiredStream(ToolStream):
    def __init__(self) -> None:
        super().__init__()
        self._arguments_keys = ("parameters",)
        self._state = self._open_list

    def _open_list(self, text: str, pos: int, final: bool) -> int | None:
        start, pos = pos, skip(text, pos, SPACE)
        if pos == len(text):
            return pos if pos > start else None
        if text[pos] != "[":
            return self._fail(text, pos)
        self._state = self._list_item
        return pos + 1


def named_stream(name: str) -> NamedStream:
    return NamedStream(name)


def required_stream() -> RequiredStream:
    return RequiredStream()
