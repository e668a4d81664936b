"""Tool calls read from an answer as it streams. The chat serving path makes one `ToolStream`
per streamed choice (`parser.stream()`, or constrained.py's streams for a required or named
tool_choice), feeds it each piece of detokenized text and sends the `StreamDelta`s it gives:
content, and OpenAI's tool-call deltas (a call's id and name once, then its arguments' JSON
text in fragments). A whole answer is the same stream fed at once (base.collect)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenmill.frontend.server.tool_parsers.base import tool_call_id
from tokenmill.frontend.server.tool_parsers.json_calls import CallReader
from tokenmill.frontend.server.tool_parsers.json_stream import SPACE, JsonReader, Malformed


@dataclass
class ToolCallDelta:
    index: int  # the call's position in the answer
    id: str | None  # on the call's first delta only
    name: str | None  # on the call's first delta only
    arguments: str  # the next fragment of the arguments' JSON text

    def as_openai(self) -> dict[str, Any]:
        """OpenAI's streamed tool call: index, then id, type and name on the first delta."""
        delta: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            delta.update(id=self.id, type="function")
        if self.name is not None:
            function = {"name": self.name, **function}
        delta["function"] = function
        return delta


@dataclass
class StreamDelta:
    content: str  # text to send as content now ("" when none)
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


State = Callable[[str, int, bool], "int | None"]


class ToolStream:
    """One choice's answer, fed piece by piece: a small state machine over the text not
    consumed yet, holding back only a possible marker, the current call's unfinished text,
    and (until the first call starts) text that may still turn out to be content.

    The rules every parser follows, so that nothing sent has to be taken back: text before
    the first call is content; a call starts once its name is read and its arguments have
    begun (their first member, or all of them); if the first call fails before that, the
    whole answer is content; once a call has started, what fails after it is dropped, and a
    call cut short gets its arguments closed where they stopped (an open string and the open
    containers closed, a key or number left unfinished dropped).

    Subclasses set `_state`, a method (text, pos, final) -> the position to go on from, or
    None when it needs more text (it must move on or change state otherwise); where a call's
    end leads (`_after_call`) and a failure after the first call (`_after_break`)."""

    def __init__(self, make_id: Callable[[], str] = tool_call_id) -> None:
        self._make_id = make_id
        self._text = ""  # fed, not consumed yet
        self._state: State = self._as_content
        self._after_call: State = self._drop
        self._after_break: State = self._drop
        self._content: list[str] = []  # this feed's content
        self._deltas: list[ToolCallDelta] = []  # this feed's call deltas
        self._calls = 0
        self._held: list[str] = []  # consumed text that is content if no call starts
        self._hold_from: int | None = None  # where in _text holding began (None: not holding)
        self._call: CallReader | None = None
        self._reader: JsonReader | None = None
        self._arguments_keys: tuple[str, ...] = ("arguments",)

    @property
    def tools_called(self) -> bool:
        return self._calls > 0

    def feed(self, text: str) -> StreamDelta:
        self._run(self._text + text, final=False)
        return self._flush()

    def finish(self) -> StreamDelta:
        self._run(self._text, final=True)
        self._end()
        return self._flush()

    def start_call(self, name: str, arguments: str) -> None:
        self._held, self._hold_from = [], None
        self._deltas.append(ToolCallDelta(self._calls, self._make_id(), name, arguments))
        self._calls += 1

    def call_arguments(self, text: str) -> None:
        if not text:
            return
        last = self._deltas[-1] if self._deltas else None
        if last is not None and last.index == self._calls - 1:
            last.arguments += text
        else:
            self._deltas.append(ToolCallDelta(self._calls - 1, None, None, text))

    def _run(self, text: str, final: bool) -> None:
        pos = 0
        while (moved := self._state(text, pos, final)) is not None:
            pos = moved
        if self._hold_from is not None:
            self._held.append(text[self._hold_from : pos])
            self._hold_from = 0
        self._text = text[pos:]

    def _flush(self) -> StreamDelta:
        delta = StreamDelta("".join(self._content), self._deltas)
        self._content, self._deltas = [], []
        return delta

    def _end(self) -> None:
        """The answer ended: what is unfinished fails there (with what was left unread, such
        as an escape cut short)."""
        text, self._text = self._text, ""
        self._fail(text, len(text))

    def _hold(self, pos: int) -> None:
        self._hold_from = pos

    def _fail(self, text: str, pos: int) -> int:
        """What was being read cannot be a call (from `pos` on): before the first call, the
        held text and the rest are content; after, a started call is closed and what follows
        goes to `_after_break`."""
        if self._call is not None and self._call.started:
            self._call.close()
        if self._hold_from is not None:
            self._content.extend(self._held)
            self._content.append(text[self._hold_from : pos])
            self._held, self._hold_from = [], None
            self._state = self._as_content
        else:
            self._state = self._after_break
        return pos

    def _as_content(self, text: str, pos: int, final: bool) -> int | None:
        if pos == len(text):
            return None
        self._content.append(text[pos:])
        return len(text)

    def _drop(self, text: str, pos: int, final: bool) -> int | None:
        return None if pos == len(text) else len(text)

    # Before the first call of an answer that is nothing but calls (llama3_json, pythonic):
    # whitespace and an optional marker, then the character that opens the calls.
    _lead_marker = ""
    _opener = ""

    def _lead(self, text: str, pos: int, final: bool) -> int | None:
        start, pos = pos, skip(text, pos)
        if pos < len(text) and self._lead_marker:
            marker = self._lead_marker
            if text.startswith(marker, pos):
                self._lead_marker = ""  # once
                return pos + len(marker)
            if could_be(text, pos, marker, final):
                return pos if pos > start else None
        if pos == len(text):
            return pos if pos > start else None
        if text[pos] != self._opener:
            return self._fail(text, pos)
        return self._open_calls(pos)

    def _open_calls(self, pos: int) -> int:
        """The calls open at `pos` (after `_lead`); where to go on from."""
        raise NotImplementedError(f"{type(self).__name__} has no lead-in")

    def _open_call(self, name: str | None = None) -> None:
        """The next call's JSON begins here (with `name`: the JSON is its arguments)."""
        self._call = CallReader(self, self._arguments_keys, name)
        self._reader = JsonReader(self._call.event)
        self._state = self._in_call

    def _in_call(self, text: str, pos: int, final: bool) -> int | None:
        assert self._reader is not None
        try:
            end = self._reader.read(text, pos, final)
        except Malformed as error:
            return self._fail(text, pos if error.pos is None else error.pos)
        if self._reader.done:
            self._state = self._after_call
            return end
        return end if end > pos else None

    def _list_item(self, text: str, pos: int, final: bool) -> int | None:
        """In a JSON list of call objects, after "[" or ",": the next call."""
        start, pos = pos, skip(text, pos, SPACE)
        if pos == len(text):
            return pos if pos > start else None
        if text[pos] != "{":
            return self._fail(text, pos)
        self._after_call = self._list_next
        self._open_call()
        return pos

    def _list_next(self, text: str, pos: int, final: bool) -> int | None:
        start, pos = pos, skip(text, pos, SPACE)
        if pos == len(text):
            return pos if pos > start else None
        if text[pos] == ",":
            self._state = self._list_item
        elif text[pos] == "]":
            self._state = self._drop
        else:
            return self._fail(text, pos)
        return pos + 1


def skip(text: str, pos: int, chars: str | None = None) -> int:
    """Past the characters of `chars` (None: any whitespace) from `pos`."""
    while pos < len(text) and (text[pos] in chars if chars is not None else text[pos].isspace()):
        pos += 1
    return pos


def find_marker(text: str, pos: int, marker: str, final: bool) -> tuple[int, bool]:
    """Where `marker` starts in text[pos:] and True; else how far the text is surely not the
    marker (a possible beginning of it at the end is held back unless final) and False."""
    found = text.find(marker, pos)
    if found >= 0:
        return found, True
    if not final:
        for length in range(min(len(marker) - 1, len(text) - pos), 0, -1):
            if text.endswith(marker[:length]):
                return len(text) - length, False
    return len(text), False


def could_be(text: str, pos: int, marker: str, final: bool) -> bool:
    """Whether text[pos:] is a beginning of `marker` cut off by the feed's end."""
    return not final and marker.startswith(text[pos:])
