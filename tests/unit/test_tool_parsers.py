"""Tool-call parsers (frontend/server/tool_parsers/) on answers written by hand in each
family's format: the calls and their arguments as parsed JSON, the content around them, and
text that is not a well-formed call left as content."""

from __future__ import annotations

import json

import pytest

from tokenmill.frontend.server.tool_parsers import TOOL_PARSERS, tool_parser


def calls_of(name: str, text: str) -> tuple[list[tuple[str, dict]], str | None]:
    found = tool_parser(name).extract_tool_calls(text)
    assert found.tools_called == bool(found.tool_calls)
    return [(c.name, json.loads(c.arguments)) for c in found.tool_calls], found.content


WEATHER = ("get_weather", {"city": "Zürich", "unit": "celsius"})
TIME = ("get_time", {})

CASES = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": '
         '"celsius"}}\n</tool_call>', [WEATHER], None),
        ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich", '
         '"unit": "celsius"}}</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}'
         "</tool_call>", [WEATHER, TIME], "Let me check.\n"),
        # An unclosed last call whose JSON is whole (generation stopped at the end tag).
        ('<tool_call>{"name": "get_time", "arguments": {}}', [TIME], None),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Zürich", "unit": "celsius"}}',
         [WEATHER], None),
        ('<|python_tag|>{"name": "get_weather", "arguments": {"city": "Zürich", "unit": '
         '"celsius"}}; {"name": "get_time", "parameters": {}}', [WEATHER, TIME], None),
        # Text after the calls is dropped: a stream has sent the calls already.
        ('{"name": "get_time", "parameters": {}} and then text', [TIME], None),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Zürich", "unit": '
         '"celsius"}}, {"name": "get_time", "arguments": {}}]', [WEATHER, TIME], None),
        ('Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Zürich", "unit": "celsius"}'
         "[TOOL_CALLS]get_time[ARGS]{}", [WEATHER, TIME], "Sure. "),
    ],
    "pythonic": [
        ('[get_weather(city="Zürich", unit="celsius"), get_time()]', [WEATHER, TIME], None),
        ('<|python_start|>[get_weather(city="Zürich", unit="celsius")]<|python_end|>',
         [WEATHER], None),
    ],
}  # fmt: skip

NOT_CALLS = {
    "hermes": ["The weather is fine.", "<tool_call>{not json}</tool_call>",
               '<tool_call>{"arguments": {}}</tool_call>'],
    "llama3_json": ["The weather is fine.", '{"no_name": 1}', '{"name": "f", "oops'],
    "mistral": ["The weather is fine.", "[TOOL_CALLS] not json", "[TOOL_CALLS]f[ARGS]{oops"],
    "pythonic": ["The weather is fine.", "[1, 2]", "[f(1)]", "[f(x=open('a'))]", "[]"],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_parser_finds_the_calls_and_keeps_the_content(name: str) -> None:
    for text, expected, content in CASES[name]:
        assert calls_of(name, text) == (expected, content), text
    for text in NOT_CALLS[name]:
        assert calls_of(name, text) == ([], text), text


def test_call_ids_and_arguments_as_openai_sends_them() -> None:
    found = tool_parser("hermes").extract_tool_calls(
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>'
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Bern\\"}"}</tool_call>'
    )
    first, second = (call.as_openai() for call in found.tool_calls)
    assert first["id"].startswith("chatcmpl-tool-") and first["id"] != second["id"]
    assert first["type"] == "function"
    assert first["function"]["arguments"] == '{"city": "Zürich"}'  # non-ASCII kept
    # Arguments written as a JSON string come out as the same object.
    assert json.loads(second["function"]["arguments"]) == {"city": "Bern"}
    text = '[TOOL_CALLS][{"name": "f", "arguments": {}}]'
    mistral = tool_parser("mistral").extract_tool_calls(text)
    assert len(mistral.tool_calls[0].id) == 9 and mistral.tool_calls[0].id.isalnum()


def test_unknown_parser_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="tool_call_parser 'nope' is not one of hermes"):
        tool_parser("nope")
