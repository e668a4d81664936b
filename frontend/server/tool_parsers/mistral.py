"""Mistral's calls: after the [TOOL_CALLS] token, a JSON list of {"name", "arguments"}
objects (tokenizers before v11), or name[ARGS]{...} per call (v11 on). The text before
[TOOL_CALLS] is content. Mistral's call ids are 9 letters and digits."""

from __future__ import annotations

import json
import random
import string

from tokenmill.frontend.server.tool_parsers.base import (
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    arguments_json,
    call_from_object,
    no_calls,
)

_BOT = "[TOOL_CALLS]"
_ARGS = "[ARGS]"
_ID_CHARS = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    return "".join(random.choices(_ID_CHARS, k=9))


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        if _BOT not in text:
            return no_calls(text)
        content, _, rest = text.partition(_BOT)
        try:
            calls = self._calls(rest.replace(_BOT, "").strip())
        except ValueError:
            return no_calls(text)
        for call in calls:
            call.id = mistral_call_id()
        return ExtractedToolCalls(True, calls, content or None)

    @staticmethod
    def _calls(body: str) -> list[ToolCall]:
        if _ARGS not in body:
            parsed = json.loads(body)
            items = parsed if isinstance(parsed, list) else [parsed]
            return [call_from_object(item) for item in items]
        calls = []
        decoder = json.JSONDecoder()
        while body:
            name, sep, after = body.partition(_ARGS)
            if not sep or not name.strip():
                raise ValueError(f"a call without a name or [ARGS]: {body!r}")
            arguments, end = decoder.raw_decode(after.lstrip())
            calls.append(ToolCall(name.strip(), arguments_json(arguments)))
            body = after.lstrip()[end:].strip()
        return calls
