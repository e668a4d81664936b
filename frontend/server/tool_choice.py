"""`tools` and `tool_choice` of a chat request, as vLLM checks and serves them.

`check_tools` refuses what vLLM refuses (400 with its messages, naming the field).
`required` and a named function are served by structured outputs: `tool_choice_schema` is
the JSON schema the answer must follow (vLLM's: a non-empty array of {"name", "parameters"}
objects, one of the tools each; or the named function's parameters), and `constrained_calls`
turns such an answer into tool calls. Read by the chat serving path; the core never sees
tools, only the schema.
"""

from __future__ import annotations

import json
from typing import Any

from tokenmill.frontend.server.serving import ServingError
from tokenmill.frontend.server.tool_parsers import ToolCall, collect, named_stream, required_stream

_NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def check_tools(tools: list[Any] | None, tool_choice: Any) -> Any:
    """The request's tool_choice as it applies ("auto" where tools come without one), after
    vLLM's checks of both fields."""
    if tools == []:
        raise ServingError("`tools` must not be an empty array. Either provide at least one "
                           "tool or omit the field entirely.", 400, "tools")  # fmt: skip
    for i, tool in enumerate(tools or ()):
        _check_tool(tool, i)
    if tool_choice is None:
        return "auto" if tools else None
    if tool_choice == "none":
        return tool_choice
    if tools is None:
        raise ServingError("When using `tool_choice`, `tools` must be set.", 400, "tool_choice")
    if tool_choice not in ("auto", "required") and not isinstance(tool_choice, dict):
        raise ServingError(f"Invalid value for `tool_choice`: {tool_choice}! Only named tools, "
                           '"none", "auto" or "required" are supported.', 400,
                           "tool_choice")  # fmt: skip
    if isinstance(tool_choice, dict):
        _check_named(tools, tool_choice)
    return tool_choice


def _check_tool(tool: Any, i: int) -> None:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise ServingError(f"tools[{i}] must be a function tool: "
                           '{"type": "function", "function": {...}}', 400,
                           f"tools[{i}]")  # fmt: skip
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ServingError(f"tools[{i}].function must be an object with a name", 400,
                           f"tools[{i}].function")  # fmt: skip
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise ServingError(f"tools[{i}].function.parameters must be a JSON schema object, got "
                           f"{parameters!r}", 400, f"tools[{i}].function.parameters")  # fmt: skip


def _check_named(tools: list[Any], tool_choice: dict) -> None:
    function = tool_choice.get("function")
    if not isinstance(function, dict):
        raise ServingError(f"Invalid value for `function`: `{function}` in `tool_choice`! "
                           f"{_NAMED_USAGE}", 400, "tool_choice")  # fmt: skip
    if "name" not in function:
        raise ServingError(f"Expected field `name` in `function` in `tool_choice`! "
                           f"{_NAMED_USAGE}", 400, "tool_choice")  # fmt: skip
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise ServingError(f"Invalid `name` in `function`: `{name}` in `tool_choice`! "
                           f"{_NAMED_USAGE}", 400, "tool_choice")  # fmt: skip
    if all(tool["function"]["name"] != name for tool in tools):
        raise ServingError("The tool specified in `tool_choice` does not match any of the "
                           "specified `tools`", 400, "tool_choice")  # fmt: skip


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def tool_choice_schema(
    tools: list[Any], tool_choice: Any, parallel_tool_calls: bool | None = None
) -> dict | None:
    """The JSON schema a `required` or named tool_choice constrains the answer to (None for
    "none" and "auto"). Each tool's `$defs` are gathered at the top, where its `$ref`s look."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        return _parameters(next(t for t in tools if t["function"]["name"] == name))
    if tool_choice != "required":
        return None
    defs: dict[str, Any] = {}
    variants = []
    for tool in tools:
        parameters = dict(_parameters(tool))
        for key, value in parameters.pop("$defs", {}).items():
            if key in defs and defs[key] != value:
                raise ServingError(f"Tool definition '{key}' has multiple schemas, which is "
                                   "not supported.", 400, "tools")  # fmt: skip
            defs[key] = value
        variants.append({
            "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                           "parameters": parameters},
            "required": ["name", "parameters"],
        })  # fmt: skip
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": variants}}  # fmt: skip
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def check_schema(schema: dict) -> None:
    """A required or named tool_choice's schema must compile (xgrammar's own check, as vLLM
    makes it before a request reaches the engine): else 400 naming the tools."""
    import xgrammar

    try:
        xgrammar.Grammar.from_json_schema(json.dumps(schema))
    except Exception as e:  # xgrammar's converter raises RuntimeError with the reason
        reason = str(e).strip().rsplit(": ", 1)[-1]
        raise ServingError(f"the tools' parameters are not a JSON schema the answer can be "
                           f"constrained to: {reason}", 400, "tools") from None  # fmt: skip


def constrained_calls(text: str, tool_choice: Any) -> list[ToolCall]:
    """The calls of an answer constrained by tool_choice_schema: the named function's
    arguments, or the array of {"name", "parameters"} of `required`; read as their streams
    read them (canonical JSON; an answer cut short has its arguments closed where it
    stopped), so that a whole answer and a streamed one hold the same calls."""
    if isinstance(tool_choice, dict):
        return collect(named_stream(tool_choice["function"]["name"]), text).tool_calls
    return collect(required_stream(), text).tool_calls
