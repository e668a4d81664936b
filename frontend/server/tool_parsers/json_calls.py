"""A tool call read from the events of a JsonReader (json_stream.py), for the tool streams
(streaming.py): `CallReader` reads an object {"name": ..., <arguments key>: {...}} (or a
value that is the arguments of a call named already) and starts the call in its stream, with
its arguments as canonical text from `Arguments`. Of a key written twice in a call, the
first "name" and the first arguments key are read."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.frontend.server.tool_parsers.base import arguments_json
from tokenmill.frontend.server.tool_parsers.json_stream import (
    CLOSE,
    END,
    KEY,
    OPEN,
    PART,
    SCALAR,
    STRING,
    Canonical,
    Malformed,
)

if TYPE_CHECKING:
    from tokenmill.frontend.server.tool_parsers.streaming import ToolStream


class Arguments:
    """A call's arguments from the events of their JSON value, as canonical text: an object
    streams as it grows; a string holding a JSON object, or null ({}), counts when whole (as
    base.arguments_json takes them). `begun`: something past the "{" is known."""

    def __init__(self) -> None:
        self._object: Canonical | None = None
        self._string: list[str] | None = None
        self._written = 0
        self.done = False

    @property
    def begun(self) -> bool:
        return self.done or self._written > 1

    def event(self, kind: str, payload: str) -> str:
        if self._object is not None:
            text = self._object.event(kind, payload)
            self.done = self._object.done
        elif self._string is not None:
            if kind == PART:
                self._string.append(payload)
                return ""
            try:
                text = arguments_json("".join(self._string))
            except ValueError as error:
                raise Malformed(str(error)) from None
            self.done = True
        elif kind == OPEN and payload == "{":
            self._object = Canonical()
            text = self._object.event(kind, payload)
        elif kind == STRING:
            self._string = []
            return ""
        elif kind == SCALAR and payload == "null":
            text, self.done = "{}", True
        else:
            raise Malformed(f"tool call arguments must be a JSON object, not a {kind} {payload!r}")
        self._written += len(text)
        return text

    def close(self) -> str:
        return self._object.close() if self._object is not None and not self.done else ""


class CallReader:
    """One call from a JsonReader's events: an object {"name": ..., <arguments key>: {...}}
    (other keys skipped), or, when the name is given, a value that is the arguments. The call
    starts in its stream once the name is known and the arguments have begun; until then
    their text waits here, after that it streams. Listen with `event`."""

    def __init__(
        self, stream: ToolStream, arguments_keys: tuple[str, ...] = (), name: str | None = None
    ) -> None:
        self._stream = stream
        self._keys = arguments_keys
        self._bare = name is not None
        self._name = name
        self._name_parts: list[str] | None = None
        self._arguments = Arguments()
        self._pending = ""  # arguments text before the call starts
        self._route = ""  # what the current member is: "name", "arguments" or "" (skipped)
        self._routed: set[str] = set()
        self.started = False
        self.complete = False

    def event(self, kind: str, payload: str, depth: int) -> None:
        if self._bare:
            self._on_arguments(kind, payload)
            self.complete = self._arguments.done
        elif depth == 0:
            if kind == CLOSE:
                self._end_object()
            elif kind != OPEN or payload != "{":
                raise Malformed('a tool call must be a JSON object {"name": ..., ...}')
        elif depth == 1 and kind == KEY:
            self._route = self._route_of(payload)
        elif self._route == "name":
            self._on_name(kind, payload)
        elif self._route == "arguments":
            self._on_arguments(kind, payload)
        self._start()

    def close(self) -> None:
        """Ends a started call cut short: its arguments closed where they stopped."""
        if self.started and not self.complete:
            self._stream.call_arguments(self._arguments.close())
            self.complete = True

    def _route_of(self, key: str) -> str:
        route = "name" if key == "name" else "arguments" if key in self._keys else ""
        if route in self._routed:
            return ""
        self._routed.add(route)
        return route

    def _on_name(self, kind: str, payload: str) -> None:
        if kind == STRING:
            self._name_parts = []
        elif kind == PART and self._name_parts is not None:
            self._name_parts.append(payload)
        elif kind == END and self._name_parts is not None:
            self._name = "".join(self._name_parts)
        else:
            raise Malformed(f"a tool call's name must be a string, not a {kind} {payload!r}")

    def _on_arguments(self, kind: str, payload: str) -> None:
        text = self._arguments.event(kind, payload)
        if self.started:
            self._stream.call_arguments(text)
        else:
            self._pending += text

    def _end_object(self) -> None:
        if self._name is None:
            raise Malformed('a tool call needs a "name"')
        if "arguments" not in self._routed:
            self._pending = "{}"
            self._arguments.done = True
        self.complete = True

    def _start(self) -> None:
        if not self.started and self._name is not None and self._arguments.begun:
            self.started = True
            self._stream.start_call(self._name, self._pending)
            self._pending = ""
