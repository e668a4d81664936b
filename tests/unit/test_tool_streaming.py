"""Tool calls streamed (tool_parsers/streaming.py, each parser's stream, constrained.py): for
an answer cut into pieces any way (at every point, a character a piece, at random points;
inside markers, strings, escapes and surrogate pairs), the content and calls a stream sends
join to what the whole answer gives; arguments are json.dumps' canonical text; text that is
not a call comes out as content; deltas have OpenAI's streamed shape."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator

import pytest

from tokenmill.frontend.server.tool_choice import constrained_calls
from tokenmill.frontend.server.tool_parsers import (
    StreamDelta,
    ToolCallDelta,
    ToolStream,
    collect,
    named_stream,
    required_stream,
    tool_parser,
)

Calls = list[tuple[str, str]]


def run(stream: ToolStream, pieces: list[str]) -> tuple[str, Calls]:
    """The stream's content and calls, joined; each call's first delta has its id and name,
    later ones only arguments."""
    content, calls = [], []
    for delta in [stream.feed(piece) for piece in pieces] + [stream.finish()]:
        content.append(delta.content)
        for call in delta.tool_calls:
            if call.index == len(calls):
                assert call.id and call.name is not None, call
                calls.append([call.name, call.arguments])
            else:
                assert (call.index, call.id, call.name) == (len(calls) - 1, None, None), call
                calls[-1][1] += call.arguments
    assert stream.tools_called == bool(calls)
    return "".join(content), [(name, arguments) for name, arguments in calls]


def cuts(text: str, seed: int, random_cuts: int = 12) -> Iterator[list[str]]:
    """The text whole, in two at every point, a character a piece, and at random points."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(random_cuts if len(text) > 2 else 0):
        points = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 9))))
        yield [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


def whole(name: str, text: str) -> tuple[str, Calls]:
    found = tool_parser(name).extract_tool_calls(text)
    return found.content or "", [(call.name, call.arguments) for call in found.tool_calls]


def canonical(arguments: str | dict) -> str:
    obj = json.loads(arguments) if isinstance(arguments, str) else arguments
    return json.dumps(obj, ensure_ascii=False)


# Arguments as a model may write them: odd spacing, escapes (a surrogate pair too), raw
# non-ASCII, nesting, numbers json.dumps rewrites, literals.
RICH = (
    '{"query":"Z\\u00fcrich \\"Altstadt\\" \\\\ 東京 \\ud83d\\ude00 😀\\n\\t/\\/",\n'
    '  "filters" : {"tags": ["a", "b\\\\c", ""], "range": [1e5, -0.5, 10, 1E-3, 0, -0],'
    ' "open": true, "closed":false, "limit": null},\r\n'
    '\t"nested": [{"x": [[], {}]}, {}, [[1]]], "empty": {}}'
)  # fmt: skip
WEATHER = '{"city": "Bern", "unit": "celsius"}'

# (text, calls as (name, arguments JSON), content) for each parser.
CASES = {
    "hermes": [
        (f'Let me look.\n<tool_call>\n{{"name": "search", "arguments": {RICH}}}\n</tool_call>\n'
         f'<tool_call>{{"name":"get_weather","arguments":{WEATHER}}}</tool_call>',
         [("search", RICH), ("get_weather", WEATHER)], "Let me look.\n"),
        # Arguments before the name; arguments as a JSON string; other keys skipped.
        (f'<tool_call>{{"arguments": {RICH}, "name": "search"}}</tool_call>',
         [("search", RICH)], ""),
        ('<tool_call>{"id": [1, {"name": "x"}], "name": "get_weather", "arguments": '
         f'{json.dumps(WEATHER)}}}</tool_call>', [("get_weather", WEATHER)], ""),
        ('a < b, <tool>x</tool> <tool_cal', [], "a < b, <tool>x</tool> <tool_cal"),
        ('<tool_call>not json</tool_call> ok', [], "<tool_call>not json</tool_call> ok"),
        ('Hm <tool_call>{"name": 1}</tool_call>', [], 'Hm <tool_call>{"name": 1}</tool_call>'),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', [],
         '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),
        ('<tool_call>{"name": "f", "arguments": {"a": 01}}', [],
         '<tool_call>{"name": "f", "arguments": {"a": 01}}'),
        # After a call, a block that is no call is skipped; a call cut short is closed.
        (f'<tool_call>{{"name": "get_weather", "arguments": {WEATHER}}}</tool_call>'
         '<tool_call>{"name": oops}</tool_call>\n<tool_call>{"name": "g", "arguments": '
         '{"a": [1, "Zü', [("get_weather", WEATHER), ("g", '{"a": [1, "Zü"]}')], ""),
    ],
    "llama3_json": [
        (f'{{"name": "search", "parameters": {RICH}}}', [("search", RICH)], ""),
        (f' \n<|python_tag|> {{"name": "get_weather", "arguments": {WEATHER}}};\n'
         '{"name": "get_time", "parameters": {}}  ',
         [("get_weather", WEATHER), ("get_time", "{}")], ""),
        ('{"name": "get_time"} {"parameters": {"a": null}, "name": "f"}; then text',
         [("get_time", "{}"), ("f", '{"a": null}')], ""),
        ("The answer is {not a call}.", [], "The answer is {not a call}."),
        ('{"result": {"name": "x"}, "ok": true}', [], '{"result": {"name": "x"}, "ok": true}'),
        ('{"name": "f", "parameters": {"a": tru', [], '{"name": "f", "parameters": {"a": tru'),
        (" <|python_tag|>hello", [], " <|python_tag|>hello"),
        (" \n ", [], " \n "),
    ],
    "mistral": [
        (f'Sure. [TOOL_CALLS] [{{"name": "search", "arguments": {RICH}}},\n'
         f'{{"name": "get_weather", "arguments": {WEATHER}}}]',
         [("search", RICH), ("get_weather", WEATHER)], "Sure. "),
        (f'[TOOL_CALLS]search[ARGS]{RICH}[TOOL_CALLS]get_weather[ARGS] {WEATHER}',
         [("search", RICH), ("get_weather", WEATHER)], ""),
        (f'I will check [TOOL_CALLS]{{"name": "get_weather", "arguments": {WEATHER}}}',
         [("get_weather", WEATHER)], "I will check "),
        ("[TOOL_CALLS] not json", [], "[TOOL_CALLS] not json"),
        ("x[TOOL_CALLS]f[ARGS]{oops", [], "x[TOOL_CALLS]f[ARGS]{oops"),
        ('[TOOL_CALLS]f[ARGS]{"a\\', [], '[TOOL_CALLS]f[ARGS]{"a\\'),  # ends in an escape
        ("[TOOL_CALLS][]", [], "[TOOL_CALLS][]"),
        ("[TOOL_CALLS][1, 2]", [], "[TOOL_CALLS][1, 2]"),
        ("[TOOL_CALLS] [ARGS]{}", [], "[TOOL_CALLS] [ARGS]{}"),
        # A v11 call cut short keeps what was streamed; a name without [ARGS] is dropped.
        ('[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{"b": "x\\', [("f", '{"a": 1}'),
         ("g", '{"b": "x"}')], ""),
        ('[TOOL_CALLS]f[ARGS]{"a": 1} g', [("f", '{"a": 1}')], ""),
    ],
    "pythonic": [
        ('[search(query="Z\\u00fcrich \\"Altstadt\\" 東京 😀", n=10, x=-0.5, big=1e5, '
         "flags=[True, None, False], nested={'a': [1, (2, 3)], \"b]\": ')'}), get_time()]",
         [("search", {"query": 'Zürich "Altstadt" 東京 😀', "n": 10, "x": -0.5, "big": 1e5,
                      "flags": [True, None, False], "nested": {"a": [1, [2, 3]], "b]": ")"}}),
          ("get_time", {})], ""),
        ("<|python_start|>[f(a='it\\'s', b='''x \"\"\" ''' , c=\"\"),  # note, ]\n"
         " g(d=r'\\'')]<|python_end|>",
         [("f", {"a": "it's", "b": 'x """ ', "c": ""}), ("g", {"d": "\\'"})], ""),
        ("[f(a=1), 2, g()]", [("f", {"a": 1})], ""),
        ("[f(a=1), g(b=[1, 2", [("f", {"a": 1})], ""),
        ("[f(a=1), g(b=2)", [("f", {"a": 1}), ("g", {"b": 2})], ""),
        ("The weather [is] fine.", [], "The weather [is] fine."),
        ("[1, 2]", [], "[1, 2]"),
        ("[f(1)]", [], "[f(1)]"),
        ("[f(x=open('a'))]", [], "[f(x=open('a'))]"),
        ("[f(x={1, 2})]", [], "[f(x={1, 2})]"),
        ("[]", [], "[]"),
        (" [f(a=')", [], " [f(a=')"),
    ],
}  # fmt: skip


def expected_calls(calls: list[tuple[str, str | dict]]) -> Calls:
    return [(name, canonical(arguments)) for name, arguments in calls]


@pytest.mark.parametrize("name", sorted(CASES))
def test_whole_answer_gives_the_calls_in_canonical_json(name: str) -> None:
    for text, calls, content in CASES[name]:
        assert whole(name, text) == (content, expected_calls(calls)), text


@pytest.mark.parametrize("name", sorted(CASES))
def test_any_cut_of_the_answer_streams_what_the_whole_answer_gives(name: str) -> None:
    parser = tool_parser(name)
    for seed, (text, _, _) in enumerate(CASES[name]):
        expected = whole(name, text)
        for pieces in cuts(text, seed):
            assert run(parser.stream(), pieces) == expected, pieces


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_answer_cut_short_streams_what_it_gives_whole(name: str) -> None:
    """Every beginning of each answer (generation may stop anywhere): the same joined
    result whole and in random pieces, arguments that are always a JSON object, and all the
    text as content when no call started."""
    parser = tool_parser(name)
    rng = random.Random(0)
    for text, _, _ in CASES[name][:3]:
        for end in range(len(text) + 1):
            prefix = text[:end]
            expected = whole(name, prefix)
            points = sorted(rng.sample(range(1, end), min(3, end - 1))) if end > 1 else []
            pieces = [prefix[a:b] for a, b in zip([0, *points], [*points, end])]
            assert run(parser.stream(), pieces) == expected, pieces
            assert all(isinstance(json.loads(a), dict) for _, a in expected[1]), prefix
            assert expected[1] or expected[0] == prefix  # no call: all of it is content


def test_content_goes_out_at_once_and_arguments_as_they_grow() -> None:
    stream = tool_parser("hermes").stream()
    assert stream.feed("Sure, <tool").content == "Sure, "  # "<tool" may begin a marker
    delta = stream.feed('_call>{"name": "get_weather", "arguments": {"city": "Zü')
    assert delta.content == "" and stream.tools_called
    ((call,),) = [delta.tool_calls]
    assert (call.index, call.name, call.arguments) == (0, "get_weather", '{"city": "Zü')
    assert call.id.startswith("chatcmpl-tool-")
    # A number goes out when whole; a member's key with its value.
    assert [c.arguments for c in stream.feed('rich", "days": 1').tool_calls] == ['rich"']
    assert [c.arguments for c in stream.feed("0").tool_calls] == []
    assert [c.arguments for c in stream.feed("}}</tool_call>").tool_calls] == [', "days": 10}']
    assert stream.finish() == StreamDelta("", [])


def test_text_that_may_be_a_call_waits_until_it_cannot_be() -> None:
    stream = tool_parser("llama3_json").stream()
    assert stream.feed(' {"result": ').content == ""
    assert stream.feed("42}").content == ' {"result": 42}'  # closed without a name
    assert stream.feed(" more").content == " more"
    stream = tool_parser("mistral").stream()
    assert stream.feed("Hi [TOOL_CALLS]get_weather").content == "Hi "
    assert stream.feed(" is nice").content == ""  # a v11 name until [ARGS]
    assert stream.finish().content == "[TOOL_CALLS]get_weather is nice"


def test_mistral_calls_stream_with_mistral_ids() -> None:
    (call,) = tool_parser("mistral").stream().feed("[TOOL_CALLS]f[ARGS]{}").tool_calls
    assert call.id is not None and len(call.id) == 9 and call.id.isalnum()


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    ("text", "arguments"),
    [
        (RICH, canonical(RICH)),
        (' \n{"city" :"Bern"}  ', '{"city": "Bern"}'),
        ('{"city": "Be', '{"city": "Be"}'),  # cut short: closed
        ('{"city": "Bern", "days": 1', '{"city": "Bern", "days": 1}'),
        ('{"city": "Bern", "da', '{"city": "Bern"}'),
        ("{", "{}"),
        ("", "{}"),
        ("oops", "{}"),
    ],
)
def test_named_tool_choice_streams_the_answer_as_call_0s_arguments(text, arguments) -> None:
    (call,) = constrained_calls(text, NAMED)
    assert (call.name, call.arguments) == ("get_weather", arguments)
    for pieces in cuts(text, 0):
        assert run(named_stream("get_weather"), pieces) == ("", [("get_weather", arguments)])


def test_required_tool_choice_streams_each_element_as_a_call() -> None:
    answer = (f'[ {{"name": "search", "parameters": {RICH}}},\n'
              f'{{"parameters": {WEATHER}, "name": "get_weather"}}, {{"name": "get_time",'
              ' "parameters": {}}]')  # fmt: skip
    expected = [(c.name, c.arguments) for c in constrained_calls(answer, "required")]
    assert expected == [("search", canonical(RICH)), ("get_weather", WEATHER),
                        ("get_time", "{}")]  # fmt: skip
    for pieces in cuts(answer, 0):
        assert run(required_stream(), pieces) == ("", expected)
    for end in range(len(answer)):  # cut short: what was streamed, closed
        stream_calls = run(required_stream(), [answer[:end]])[1]
        assert [(c.name, c.arguments) for c in collect(required_stream(), answer[:end])
                .tool_calls] == stream_calls  # fmt: skip
        assert all(isinstance(json.loads(a), dict) for _, a in stream_calls)
    assert run(required_stream(), ["not a list"]) == ("", [])


def test_deltas_have_openais_streamed_shape() -> None:
    stream = tool_parser("hermes").stream()
    first = stream.feed('<tool_call>{"name": "f", "arguments": {"a": "x').tool_calls[0]
    later = stream.feed('y"}}').tool_calls[0]
    assert first.as_openai() == {"index": 0, "id": first.id, "type": "function",
                                 "function": {"name": "f", "arguments": '{"a": "x'}}  # fmt: skip
    assert later.as_openai() == {"index": 0, "function": {"arguments": 'y"}'}}
    assert ToolCallDelta(1, None, None, "").as_openai() == {
        "index": 1, "function": {"arguments": ""}}  # fmt: skip


def test_a_long_answer_streams_in_linear_time() -> None:
    """Each piece costs what it holds, not what came before (no re-parse of the answer)."""
    text = '<tool_call>{"name": "f", "arguments": {"text": "' + "ab\\n" * 10_000 + '"}}'
    stream = tool_parser("hermes").stream()
    started = time.perf_counter()
    for char in text:
        stream.feed(char)
    stream.finish()
    assert time.perf_counter() - started < 5  # ~0.3 s; a re-parse a piece takes minutes
