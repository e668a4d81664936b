"""Pythonic calls (Llama 3.2 / 4 with their pythonic templates, ToolACE): the answer is a
Python list of calls with keyword arguments, [get_weather(city="Paris"), now()], whose
values are literals, optionally between <|python_start|> and <|python_end|>. Anything else
is content; text after the list is dropped. Streamed by the rules of streaming.py, except
that a call goes out whole (name and arguments at once) when the list reaches its "," or
"]": its Python text is scanned for the end (brackets, strings, comments) and then parsed."""

from __future__ import annotations

import ast

from tokenmill.frontend.server.tool_parsers.base import ToolCall, ToolParser, arguments_json
from tokenmill.frontend.server.tool_parsers.streaming import ToolStream, could_be

_START = "<|python_start|>"  # Llama 4's marker before the list


class PythonicStream(ToolStream):
    _lead_marker = _START
    _opener = "["

    def __init__(self) -> None:
        super().__init__()
        self._state = self._lead
        self._element: list[str] = []  # the current call's Python text
        self._depth = 0  # brackets open in it
        self._quote = ""  # the quote of the string it is in ("": none)
        self._comment = False
        self._hold(0)  # the answer is content unless a call starts

    def _open_calls(self, pos: int) -> int:
        self._state = self._scan
        return pos + 1

    def _scan(self, text: str, pos: int, final: bool) -> int | None:
        """Reads the current call's text up to the list's "," or "]" outside brackets,
        strings and comments; stops early before a quote or escape it cannot tell yet."""
        start = pos
        while pos < len(text):
            char = text[pos]
            if self._comment:
                self._comment = char != "\n"
            elif self._quote:
                if char == "\\":
                    if pos + 1 < len(text):
                        pos += 1  # the escaped character
                    elif not final:
                        break
                elif text.startswith(self._quote, pos):
                    pos += len(self._quote) - 1
                    self._quote = ""
                elif len(self._quote) == 3 and could_be(text, pos, self._quote, final):
                    break
            elif char in "\"'":
                if text.startswith(char * 3, pos):
                    self._quote = char * 3
                    pos += 2
                elif could_be(text, pos, char * 3, final):
                    break
                else:
                    self._quote = char
            elif char == "#":
                self._comment = True
            elif char in "([{":
                self._depth += 1
            elif char in ")]}" and self._depth:
                self._depth -= 1
            elif char in ",]" and not self._depth:
                self._element.append(text[start:pos])
                return self._element_end(text, pos, char)
            elif char in ")}" and not self._depth:
                return self._fail(text, pos)
            pos += 1
        self._element.append(text[start:pos])
        return pos if pos > start else None

    def _element_end(self, text: str, pos: int, char: str) -> int:
        source, self._element = "".join(self._element).strip(), []
        if not source and char == "]" and self.tools_called:
            self._state = self._drop  # a trailing comma
            return pos + 1
        try:
            call = _call(source)
        except (SyntaxError, ValueError, TypeError):
            return self._fail(text, pos)
        self.start_call(call.name, call.arguments)
        if char == "]":
            self._state = self._drop
        return pos + 1

    def _end(self) -> None:
        """A list cut short: its last call counts if its text is a whole call."""
        source = "".join(self._element).strip()
        if self._state == self._scan and source:
            try:
                call = _call(source)
            except (SyntaxError, ValueError, TypeError):
                pass
            else:
                self.start_call(call.name, call.arguments)
                return
        super()._end()


def _call(source: str) -> ToolCall:
    node = ast.parse(f"(\n{source}\n)", mode="eval").body  # in brackets, as in the list
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise ValueError("not a call by name with keyword arguments")
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            raise ValueError("**kwargs in a tool call")
        arguments[keyword.arg] = ast.literal_eval(keyword.value)
    return ToolCall(node.func.id, arguments_json(arguments))


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def stream(self) -> PythonicStream:
        return PythonicStream()
