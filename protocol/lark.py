"""Simple Lark grammars as the EBNF (GBNF style) xgrammar compiles, as vLLM converts them.

Covered: rules and terminals (`name: ...`, `?name: ...`, `NAME: ...`), alternatives on
continuation lines (`| ...`), double- or single-quoted strings, groups, optional `[...]`,
`?`, `*`, `+`, and `//` comments. The start rule is `start`, or else the first rule.
What has no EBNF counterpart here (`/regex/` terminals, `%import`, `%ignore`, templates,
priorities) is refused with an error naming it, rather than compiled into something else.
"""

from __future__ import annotations

import re

_RULE = re.compile(r"^\s*[?!]?([A-Za-z_][A-Za-z0-9_]*)(\.\d+)?\s*:(?!:)(.*)$")


def is_lark(grammar: str) -> bool:
    """Whether a grammar looks like Lark rather than EBNF: rules with `:` and none with `::=`."""
    lines = [_strip_comment(line) for line in grammar.splitlines()]
    return "::=" not in grammar and any(_RULE.match(line) for line in lines if line.strip())


def lark_to_ebnf(grammar: str) -> str:
    rules: dict[str, list[str]] = {}
    order: list[str] = []
    current: str | None = None
    for number, raw in enumerate(grammar.splitlines(), 1):
        line = _strip_comment(raw).strip()
        if not line:
            continue
        if line.startswith("%"):
            directive = line.split()[0]
            raise ValueError(f"Lark grammar line {number}: {directive} has no EBNF counterpart")
        match = _RULE.match(line)
        if match:
            current, priority, body = match.group(1), match.group(2), match.group(3)
            if priority:
                raise ValueError(f"Lark grammar line {number}: rule priorities are not supported")
            if current in rules:
                raise ValueError(f"Lark grammar line {number}: rule {current!r} defined twice")
            rules[current] = [_expression(body, number)]
            order.append(current)
        elif line.startswith("|") and current is not None:
            rules[current].append(_expression(line[1:], number))
        else:
            raise ValueError(f"Lark grammar line {number}: cannot read {raw.strip()!r}")
    if not rules:
        raise ValueError("the Lark grammar defines no rule")
    start = "start" if "start" in rules else order[0]
    lines = [f"root ::= {start}"]
    lines += [f"{name} ::= {' | '.join(f'({alt})' if '|' in alt else alt for alt in rules[name])}"
              for name in order]  # fmt: skip
    return "\n".join(lines) + "\n"


def _strip_comment(line: str) -> str:
    """The line without a `//` comment (outside strings)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote and line[i - 1] != "\\":
                quote = None
        elif ch in "\"'":
            quote = ch
        elif line.startswith("//", i):
            return line[:i]
    return line


def _expression(text: str, number: int) -> str:
    """One alternative's body: strings re-quoted for EBNF, everything else checked."""
    out, i = [], 0
    while i < len(text):
        ch = text[i]
        if ch in "\"'":
            end = i + 1
            while end < len(text) and (text[end] != ch or text[end - 1] == "\\"):
                end += 1
            if end >= len(text):
                raise ValueError(f"Lark grammar line {number}: unterminated string")
            value = text[i + 1 : end]
            if ch == "'":  # single-quoted: " must be escaped in EBNF, \' need not be
                value = value.replace("\\'", "'").replace('"', '\\"')
            out.append(f'"{value}"')
            i = end + 1
            if text.startswith("i", i):
                raise ValueError(f"Lark grammar line {number}: case-insensitive strings")
        elif ch == "/":
            raise ValueError(
                f"Lark grammar line {number}: /regex/ terminals are not supported; "
                "write them as strings and character classes"
            )
        elif ch in "[]":  # Lark's [item] is an optional item
            out.append("(" if ch == "[" else ")?")
            i += 1
        elif ch == "~":
            raise ValueError(f"Lark grammar line {number}: ~ repetition is not supported")
        else:
            out.append(ch)
            i += 1
    return " ".join("".join(out).split())
