"""tools / tool_choice checks with vLLM's messages, the JSON schema a `required` or named
tool_choice constrains the answer to (checked with jsonschema against answers that must and
must not pass), and the calls read back from a constrained answer."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tokenmill.frontend.server.serving import ServingError
from tokenmill.frontend.server.tool_choice import (
    check_tools,
    constrained_calls,
    tool_choice_schema,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"$ref": "#/$defs/unit"}},
                   "required": ["city"], "additionalProperties": False,
                   "$defs": {"unit": {"enum": ["celsius", "fahrenheit"]}}},
}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: {}
TOOLS = [WEATHER, TIME]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    ("tools", "choice", "message", "param"),
    [
        ([], None, "`tools` must not be an empty array", "tools"),
        (None, "auto", "When using `tool_choice`, `tools` must be set.", "tool_choice"),
        (TOOLS, "sometimes", "Invalid value for `tool_choice`: sometimes!", "tool_choice"),
        (TOOLS, {"type": "function"}, "Invalid value for `function`: `None`", "tool_choice"),
        (TOOLS, {"function": {}}, "Expected field `name` in `function`", "tool_choice"),
        (TOOLS, {"function": {"name": ""}}, "Invalid `name` in `function`", "tool_choice"),
        (TOOLS, {"function": {"name": "nope"}}, "does not match any of the specified `tools`",
         "tool_choice"),
        ([{"type": "retrieval"}], None, "tools[0] must be a function tool", "tools[0]"),
        ([{"type": "function", "function": {"description": "x"}}], None,
         "tools[0].function must be an object with a name", "tools[0].function"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None,
         "must be a JSON schema object", "tools[0].function.parameters"),
    ],
)  # fmt: skip
def test_bad_tools_and_tool_choice_are_refused(tools, choice, message, param) -> None:
    with pytest.raises(ServingError) as caught:
        check_tools(tools, choice)
    assert message in caught.value.message and caught.value.status == 400
    assert caught.value.param == param


def test_tool_choice_defaults_as_vllm() -> None:
    assert check_tools(TOOLS, None) == "auto"
    assert check_tools(None, None) is None
    assert check_tools(None, "none") == "none"
    assert check_tools(TOOLS, NAMED) == NAMED


def test_required_schema_takes_exactly_calls_of_the_tools() -> None:
    schema = tool_choice_schema(TOOLS, "required")
    assert schema["$defs"] == {"unit": {"enum": ["celsius", "fahrenheit"]}}
    good = [{"name": "get_weather", "parameters": {"city": "Bern", "unit": "celsius"}},
            {"name": "get_time", "parameters": {}}]  # fmt: skip
    jsonschema.validate(good, schema)
    for bad in (
        [],  # at least one call
        [{"name": "get_wether", "parameters": {"city": "Bern"}}],  # not a tool
        [{"name": "get_weather", "parameters": {"town": "Bern"}}],  # its schema says no
        [{"name": "get_weather", "parameters": {"city": "Bern", "unit": "kelvin"}}],  # $ref
        [{"name": "get_time"}],  # parameters required
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = tool_choice_schema(TOOLS, "required", parallel_tool_calls=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single)
    calls = constrained_calls(json.dumps(good), "required")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Bern", "unit": "celsius"}), ("get_time", {})]


def test_named_schema_is_the_functions_parameters() -> None:
    schema = tool_choice_schema(TOOLS, NAMED)
    assert schema is WEATHER["function"]["parameters"]
    jsonschema.validate({"city": "Bern"}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({}, schema)
    (call,) = constrained_calls('{"city": "Bern"}', NAMED)
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Bern"}')
    assert tool_choice_schema(TOOLS, "auto") is None and tool_choice_schema(TOOLS, "none") is None


def test_conflicting_defs_are_refused() -> None:
    other = {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "$defs": {"unit": {"enum": ["kelvin"]}}}}}  # fmt: skip
    with pytest.raises(ServingError, match="Tool definition 'unit' has multiple schemas"):
        tool_choice_schema([WEATHER, other], "required")
