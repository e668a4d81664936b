"""Lark -> EBNF, checked against conversions written by hand, and that xgrammar compiles
what comes out."""

from __future__ import annotations

import pytest

from tokenmill.protocol.lark import is_lark, lark_to_ebnf


def test_rules_alternatives_strings_and_optionals() -> None:
    lark = """
    // comment
    ?start: greeting " " name ["!"]   // trailing comment
    greeting: "hello" | 'hi "there"'
    name: "world"
        | "a//b"
    """
    assert lark_to_ebnf(lark) == (
        "root ::= start\n"
        'start ::= greeting " " name ("!")?\n'
        'greeting ::= ("hello" | "hi \\"there\\"")\n'
        'name ::= "world" | "a//b"\n'
    )


def test_the_first_rule_starts_without_a_start_rule() -> None:
    assert lark_to_ebnf('value: "x"+').splitlines()[0] == "root ::= value"


def test_ebnf_is_not_taken_for_lark() -> None:
    assert is_lark('start: "a"') and not is_lark('root ::= "a"\nx ::= "b"')


@pytest.mark.parametrize(
    "lark, named",
    [("%import common.WS", "%import"), ("start: /a+/", "/regex/"), ("start.2: \"a\"", "priorit"),
     ('start: "a"\nstart: "b"', "defined twice"), ("start: 'a", "unterminated")],
)  # fmt: skip
def test_what_has_no_counterpart_is_refused(lark, named) -> None:
    with pytest.raises(ValueError, match=named):
        lark_to_ebnf(lark)


def test_xgrammar_compiles_the_result() -> None:
    xgr = pytest.importorskip("xgrammar")
    xgr.Grammar.from_ebnf(lark_to_ebnf('start: item (", " item)*\nitem: "a" | "b" ["c"]'))
