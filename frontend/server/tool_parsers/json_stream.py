"""JSON read as it arrives, for the tool streams (streaming.py, json_calls.py): `JsonReader`
turns text into events (a container opens or closes, a key, a piece of a string, a whole
number or literal) and accepts what `json.loads` accepts; `Canonical` writes a value's
events back as `json.dumps(value, ensure_ascii=False)` would, piece by piece, so streamed
arguments join to the text a whole answer gives. Known difference: a key written twice is
sent twice (json.loads keeps the last value), as the first was streamed already."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

# Event kinds (JsonReader -> its listener, with a payload and the value's depth).
OPEN, CLOSE, KEY, STRING, PART, END, SCALAR = "open", "close", "key", "str", "part", "end", "sc"

SPACE = " \t\n\r"  # JSON's whitespace, as json.loads skips it
_PLAIN = re.compile(r'[^"\\\x00-\x1f]+')  # string characters that stand for themselves
_SCALAR = re.compile(r"[-+.0-9A-Za-z]+")  # a number, true/false/null, NaN, Infinity
_HEX = frozenset("0123456789abcdefABCDEF")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
            "t": "\t"}  # fmt: skip
# What the reader expects next.
_VALUE, _ITEM, _MEMBER, _KEY, _COLON, _NEXT = range(6)


class Malformed(ValueError):
    """The text stopped being what was expected, at `pos` of the text being read."""

    def __init__(self, message: str, pos: int | None = None) -> None:
        super().__init__(message)
        self.pos = pos


Listener = Callable[[str, str, int], None]


class JsonReader:
    """One JSON value, read from successive pieces of text. `read` stops right after the
    value's end (`done`), or where the text runs out, and raises Malformed at the first
    character that cannot continue it; each event goes to `listener(kind, payload, depth)`
    as soon as it is known (depth: how many containers hold the value or key)."""

    def __init__(self, listener: Listener) -> None:
        self._listener = listener
        self._stack: list[str] = []  # "{" or "[" for each open container
        self._expect = _VALUE
        self._string: list[str] | None = None  # a key being read (None: not in a key)
        self._in_string = False
        self._scalar: str | None = None  # a number or literal being read
        self.done = False

    def read(self, text: str, pos: int, final: bool) -> int:
        while not self.done:
            if self._in_string:
                pos = self._read_string(text, pos)
                if self._in_string:
                    return pos
            elif self._scalar is not None:
                match = _SCALAR.match(text, pos)
                if match:
                    self._scalar += match.group()
                    pos = match.end()
                if pos == len(text) and not final:
                    return pos
                self._end_scalar(pos)
            else:
                while pos < len(text) and text[pos] in SPACE:
                    pos += 1
                if pos == len(text):
                    return pos
                pos = self._structure(text[pos], pos)
        return pos

    def _emit(self, kind: str, payload: str, pos: int) -> None:
        try:
            self._listener(kind, payload, len(self._stack))
        except Malformed as error:
            error.pos = pos if error.pos is None else error.pos
            raise

    def _structure(self, char: str, pos: int) -> int:
        """Reads one structural character (or starts a scalar); returns where to go on."""
        expect = self._expect
        if expect in (_VALUE, _ITEM):
            if char == "]" and expect == _ITEM:
                return self._close(pos)
            if char in "{[":
                self._emit(OPEN, char, pos)
                self._stack.append(char)
                self._expect = _MEMBER if char == "{" else _ITEM
                return pos + 1
            if char == '"':
                self._emit(STRING, "", pos)
                self._in_string = True
                return pos + 1
            if _SCALAR.match(char):
                self._scalar = ""
                return pos
        elif expect in (_MEMBER, _KEY):
            if char == "}" and expect == _MEMBER:
                return self._close(pos)
            if char == '"':
                self._string, self._in_string = [], True
                return pos + 1
        elif expect == _COLON:
            if char == ":":
                self._expect = _VALUE
                return pos + 1
        elif char == ",":
            self._expect = _KEY if self._stack[-1] == "{" else _VALUE
            return pos + 1
        elif char == ("}" if self._stack[-1] == "{" else "]"):
            return self._close(pos)
        raise Malformed(f"unexpected {char!r} in JSON", pos)

    def _close(self, pos: int) -> int:
        self._stack.pop()
        self._emit(CLOSE, "", pos)
        self._value_read()
        return pos + 1

    def _value_read(self) -> None:
        if self._stack:
            self._expect = _NEXT
        else:
            self.done = True

    def _end_scalar(self, pos: int) -> None:
        token, self._scalar = self._scalar, None
        try:
            canonical = json.dumps(json.loads(token))
        except ValueError:
            raise Malformed(f"{token!r} is not a JSON number or literal", pos) from None
        self._emit(SCALAR, canonical, pos)
        self._value_read()

    def _read_string(self, text: str, pos: int) -> int:
        """Reads on in a string; stops at its end (past the quote) or where the text runs out
        (before an escape that is not whole yet)."""
        while pos < len(text):
            plain = _PLAIN.match(text, pos)
            if plain:
                self._piece(plain.group(), pos)
                pos = plain.end()
                continue
            char = text[pos]
            if char == '"':
                self._in_string = False
                if self._string is not None:
                    key, self._string = "".join(self._string), None
                    self._expect = _COLON
                    self._emit(KEY, key, pos)
                else:
                    self._emit(END, "", pos)
                    self._value_read()
                return pos + 1
            if char != "\\":
                raise Malformed(f"control character {char!r} in a JSON string", pos)
            escaped, length = _escape(text, pos)
            if escaped is None:
                return pos
            self._piece(escaped, pos)
            pos += length
        return pos

    def _piece(self, piece: str, pos: int) -> None:
        if self._string is not None:
            self._string.append(piece)
        else:
            self._emit(PART, piece, pos)


def _escape(text: str, pos: int) -> tuple[str | None, int]:
    """The character an escape at `pos` stands for and the escape's length (None: the text
    ends before the escape does). A high surrogate takes a low one that follows, as json does."""
    kind = text[pos + 1 : pos + 2]
    if not kind:
        return None, 0
    if kind != "u":
        if kind not in _ESCAPES:
            raise Malformed(f"invalid escape \\{kind} in a JSON string", pos)
        return _ESCAPES[kind], 2
    code = _hex4(text, pos + 2)
    if code is None:
        return None, 0
    if 0xD800 <= code <= 0xDBFF:
        after = text[pos + 6 : pos + 12]
        if len(after) < 6 and "\\u".startswith(after[:2]):
            return None, 0  # a low surrogate may follow
        if after.startswith("\\u"):
            low = _hex4(text, pos + 8)
            if low is not None and 0xDC00 <= low <= 0xDFFF:
                return chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)), 12
    return chr(code), 6


def _hex4(text: str, at: int) -> int | None:
    digits = text[at : at + 4]
    if not all(digit in _HEX for digit in digits):
        raise Malformed(f"invalid \\u escape {digits!r} in a JSON string", at)
    return int(digits, 16) if len(digits) == 4 else None


class Canonical:
    """The events of one JSON value, written as json.dumps(value, ensure_ascii=False) writes
    it: strings as they grow, a member's key with its value's first piece (so a member cut
    short leaves no dangling key), numbers and literals when whole. `close()` ends the value
    where it stopped: the open string and containers closed."""

    def __init__(self) -> None:
        self._open: list[list] = []  # [closer, members so far] for each open container
        self._key = ""  # the next member's '"key": '
        self._in_string = False
        self.done = False

    def event(self, kind: str, payload: str) -> str:
        if kind == KEY:
            self._key = json.dumps(payload, ensure_ascii=False) + ": "
            return ""
        if kind == PART:
            return json.dumps(payload, ensure_ascii=False)[1:-1]
        if kind in (END, CLOSE):
            self._in_string = False
            closer = self._open.pop()[0] if kind == CLOSE else '"'
            self.done = not self._open
            return closer
        prefix = ""
        if self._open:  # a member or item begins: its separator (and key) go out with it
            container = self._open[-1]
            prefix = (", " if container[1] else "") + self._key
            container[1] += 1
            self._key = ""
        if kind == OPEN:
            self._open.append(["}" if payload == "{" else "]", 0])
        elif kind == STRING:
            self._in_string = True
            payload = '"'
        else:
            self.done = not self._open
        return prefix + payload

    def close(self) -> str:
        return ('"' if self._in_string else "") + "".join(c for c, _ in reversed(self._open))
