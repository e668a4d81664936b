"""Pythonic calls (Llama 3.2 / 4 with their pythonic templates, ToolACE): the answer is a
Python list of calls with keyword arguments, [get_weather(city="Paris"), now()], whose
values are literals. Anything else is content."""

from __future__ import annotations

import ast

from tokenmill.frontend.server.tool_parsers.base import (
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    arguments_json,
    no_calls,
)


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        body = text.strip()
        if body.startswith("<|python_start|>"):  # Llama 4's markers around the list
            body = body.removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
        if not (body.startswith("[") and body.endswith("]")):
            return no_calls(text)
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return no_calls(text)
            calls = [_call(node) for node in tree.elts]
        except (SyntaxError, ValueError):
            return no_calls(text)
        return ExtractedToolCalls(True, calls, None)


def _call(node: ast.expr) -> ToolCall:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise ValueError("not a call by name with keyword arguments")
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            raise ValueError("**kwargs in a tool call")
        arguments[keyword.arg] = ast.literal_eval(keyword.value)
    return ToolCall(node.func.id, arguments_json(arguments))
