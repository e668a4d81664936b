"""Mistral's calls: after the [TOOL_CALLS] token, a JSON list of {"name", "arguments"}
objects, or one such object (tokenizers before v11), or name[ARGS]{...} per call, each
after its own [TOOL_CALLS] (v11 on). The text before [TOOL_CALLS] is content; the first
character after it picks the format. Mistral's call ids are 9 letters and digits. Streamed
by the rules of streaming.py."""

from __future__ import annotations

import random
import string

from tokenmill.frontend.server.tool_parsers.base import ToolParser
from tokenmill.frontend.server.tool_parsers.streaming import (
    ToolStream,
    could_be,
    find_marker,
    skip,
)

_BOT = "[TOOL_CALLS]"
_ARGS = "[ARGS]"
_ID_CHARS = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    return "".join(random.choices(_ID_CHARS, k=9))


class MistralStream(ToolStream):
    def __init__(self) -> None:
        super().__init__(make_id=mistral_call_id)
        self._state = self._before
        self._name: list[str] = []

    def _before(self, text: str, pos: int, final: bool) -> int | None:
        cut, found = find_marker(text, pos, _BOT, final)
        self._content.append(text[pos:cut])
        if not found:
            return cut if cut > pos else None
        self._hold(cut)
        self._state = self._start
        return cut + len(_BOT)

    def _gap(self, text: str, pos: int, final: bool) -> tuple[int, bool]:
        """Past whitespace and [TOOL_CALLS] tokens; and whether the text may go on with one."""
        while True:
            pos = skip(text, pos)
            if not text.startswith(_BOT, pos):
                return pos, pos == len(text) or could_be(text, pos, _BOT, final)
            pos += len(_BOT)

    def _start(self, text: str, pos: int, final: bool) -> int | None:
        """After the first [TOOL_CALLS]: which format."""
        start, (pos, wait) = pos, self._gap(text, pos, final)
        if wait:
            return pos if pos > start else None
        if text[pos] == "[":
            self._state = self._list_item
            return pos + 1
        if text[pos] == "{":
            self._open_call()
            return pos
        self._state = self._read_name
        return pos

    def _read_name(self, text: str, pos: int, final: bool) -> int | None:
        """A v11 call's name, up to [ARGS]."""
        cut, found = find_marker(text, pos, _ARGS, final)
        self._name.append(text[pos:cut])
        if not found:
            return cut if cut > pos else None
        name, self._name = "".join(self._name).strip(), []
        if not name:
            return self._fail(text, cut)
        self._after_call = self._next_name
        self._open_call(name)
        return cut + len(_ARGS)

    def _next_name(self, text: str, pos: int, final: bool) -> int | None:
        start, (pos, wait) = pos, self._gap(text, pos, final)
        if wait:
            return pos if pos > start else None
        self._state = self._read_name
        return pos


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True

    def stream(self) -> MistralStream:
        return MistralStream()
