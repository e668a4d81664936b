"""Tool calling through `tokenmill serve`, with the official `openai` client, as vLLM serves it.

- A tool history (an assistant's calls, the tool's answers) with `tools` renders as HF's
  apply_chat_template renders it, in /tokenize and in the chat route (--chat-template).
- `tool_choice: "required"` and a named function constrain the answer: every call parses and
  validates against its tool's schema, streamed or not, with and without parallel calls.
- `tool_choice: "auto"` with each parser (--enable-auto-tool-choice --tool-call-parser X):
  an answer forced with structured_outputs.choice turns into exactly its calls, and the
  streamed deltas (index, id, the name once, argument fragments) join to the same calls.
- vLLM's errors: "auto" without the flags, `tools: []`, a named function not in the tools,
  tool_choice without tools, a malformed tool or tool call: 400 naming the field.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from helpers import httpx, running_server
from transformers import AutoTokenizer

pytestmark = pytest.mark.slow

MODEL = "smollm2"
# A Qwen 2.5-style (hermes) template: the tools in the system turn, calls as JSON objects
# between <tool_call> tags (written with tojson: arguments must reach it as objects).
TEMPLATE = """\
{%- if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else 'You are a helpful assistant.' }}

# Tools

You may call one or more functions. Function signatures are within <tools></tools>:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each call, return a JSON object with the function name and arguments within \
<tool_call></tool_call> tags.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.tool_calls %}<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls %}
<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                      "parameters": TIME}},
]  # fmt: skip
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris, and the time in CET?"}]
HISTORY = [
    {"role": "system", "content": "You are brief."},
    QUESTION[0],
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}},
        {"id": "call_2", "type": "function", "function": {
            "name": "get_time", "arguments": '{"zone": "CET"}'}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "14 degrees, rain"},
    {"role": "tool", "tool_call_id": "call_2", "content": "15:02"},
]  # fmt: skip

# What each parser reads, and the calls it holds: (answer text, content, [(name, args)]).
AUTO = {
    "hermes": (
        'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
        '{"zone": "CET"}}\n</tool_call>',
        "Let me check.",
        [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET"})],
    ),
    "llama3_json": (
        '{"name": "get_weather", "parameters": {"city": "Zürich", "unit": "celsius"}}',
        None,
        [("get_weather", {"city": "Zürich", "unit": "celsius"})],
    ),
    "mistral": (
        '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "PST"}}, {"name": '
        '"get_weather", "arguments": {"city": "Oslo", "unit": "fahrenheit"}}]',
        None,
        [("get_time", {"zone": "PST"}), ("get_weather", {"city": "Oslo", "unit": "fahrenheit"})],
    ),
    "pythonic": (
        '[get_weather(city="Rome", unit="celsius"), get_time(zone="UTC")]',
        None,
        [("get_weather", {"city": "Rome", "unit": "celsius"}), ("get_time", {"zone": "UTC"})],
    ),
}


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("template") / "tools.jinja"
    path.write_text(TEMPLATE)
    return str(path)


@pytest.fixture(scope="module")
def server(smollm2_path, template_file):
    """A server with --chat-template and no tool parser (required, named and none work)."""
    with running_server(smollm2_path, "--chat-template", template_file) as (_, base):
        yield base


def make_client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)


def chat(client: openai.OpenAI, stream: bool, **kwargs):
    """(content, [(name, arguments text)], finish_reason, streamed calls' ids) of one answer;
    a stream's deltas joined as the openai client's users join them (by index), checking
    that a call's id and name come once, on its first delta."""
    kwargs = {"model": MODEL, "temperature": 0, "max_completion_tokens": 96, **kwargs}
    if not stream:
        (choice,) = client.chat.completions.create(**kwargs).choices
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        ids = [c.id for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason, ids
    content, names, arguments, ids, finish = None, {}, {}, {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content = (content or "") + delta.content
            for call in delta.tool_calls or []:
                if call.index not in names:  # the first delta of a call: id, type and name
                    assert call.id and call.type == "function" and call.function.name, call
                    names[call.index], ids[call.index] = call.function.name, call.id
                    arguments[call.index] = ""
                else:
                    assert call.id is None and call.function.name is None, call
                arguments[call.index] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert sorted(names) == list(range(len(names)))
    calls = [(names[i], arguments[i]) for i in sorted(names)]
    return content, calls, finish, [ids[i] for i in sorted(ids)]


# ------------------------------------------------------------------------ the template
def test_tool_history_renders_as_hf_template(server, smollm2_path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    as_objects = json.loads(json.dumps(HISTORY))
    for message in as_objects:
        for call in message.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    expected_text = tokenizer.apply_chat_template(
        as_objects, chat_template=TEMPLATE, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert '"arguments": {"city": "Paris"' in expected_text and "<tools>" in expected_text
    expected = tokenizer.encode(expected_text, add_special_tokens=False)
    tokenized = httpx.post(f"{server}/tokenize", json={"messages": HISTORY, "tools": TOOLS})
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["tokens"] == expected
    response = make_client(server).chat.completions.create(
        model=MODEL, messages=HISTORY, tools=TOOLS, tool_choice="none", max_completion_tokens=4,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert response.model_extra["prompt_token_ids"] == expected
    (choice,) = response.choices
    assert choice.message.tool_calls in (None, []) and choice.finish_reason in ("stop", "length")
    # Without tools the template's tool block is not rendered.
    plain = httpx.post(f"{server}/tokenize", json={"messages": HISTORY}).json()["tokens"]
    assert plain != expected and "<tools>" not in tokenizer.decode(plain)


# ------------------------------------------------------------ required and named choices
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("parallel", [None, False], ids=["parallel", "one-call"])
def test_required_tool_choice_always_validates(server, stream, parallel) -> None:
    client = make_client(server)
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    for question in (QUESTION, [{"role": "user", "content": "Time in the US west?"}]):
        content, calls, finish, ids = chat(
            client, stream, messages=question, tools=TOOLS, tool_choice="required",
            max_completion_tokens=160, **extra,
        )  # fmt: skip
        assert finish == "tool_calls" and calls, (content, calls, finish)
        assert len(set(ids)) == len(ids)
        if parallel is False:
            assert len(calls) == 1
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        assert not content


def test_required_streams_the_whole_answers_calls(server) -> None:
    client = make_client(server)
    kwargs = {"messages": QUESTION, "tools": TOOLS, "tool_choice": "required",
              "max_completion_tokens": 160}  # fmt: skip
    whole = chat(client, False, **kwargs)
    streamed = chat(client, True, **kwargs)
    assert streamed[1] == whole[1] and streamed[2] == whole[2] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_named_tool_choice_always_validates(server, stream) -> None:
    client = make_client(server)
    for name in ("get_weather", "get_time"):
        content, calls, finish, _ = chat(
            client, stream, messages=QUESTION, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": name}},
        )  # fmt: skip
        assert finish == "stop", (content, calls, finish)  # vLLM's: not "tool_calls"
        ((called, arguments),) = calls
        assert called == name and not content
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_named_tool_choice_streams_the_whole_answers_call(server) -> None:
    client = make_client(server)
    kwargs = {"messages": QUESTION, "tools": TOOLS,
              "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}  # fmt: skip
    assert chat(client, True, **kwargs)[1] == chat(client, False, **kwargs)[1]


# --------------------------------------------------------------------- auto, per parser
@pytest.fixture(scope="module", params=sorted(AUTO))
def auto_server(request, smollm2_path, template_file):
    flags = ("--chat-template", template_file, "--enable-auto-tool-choice",
             "--tool-call-parser", request.param)  # fmt: skip
    with running_server(smollm2_path, *flags) as (_, base):
        yield request.param, base


def test_auto_tool_choice_parses_each_parsers_calls(auto_server) -> None:
    parser, base = auto_server
    text, content, expected = AUTO[parser]
    client = make_client(base)
    forced = {"extra_body": {"structured_outputs": {"choice": [text]}}, "messages": QUESTION,
              "tools": TOOLS, "max_completion_tokens": 200}  # fmt: skip
    for stream in (False, True):
        got_content, calls, finish, ids = chat(client, stream, **forced)
        assert finish == "tool_calls", (stream, got_content, calls)
        assert [(name, json.loads(args)) for name, args in calls] == expected, stream
        # The arguments as vLLM's parsers write them: JSON with non-ASCII kept.
        assert [args for _, args in calls] == [
            json.dumps(args, ensure_ascii=False) for _, args in expected
        ]
        assert (got_content or None) == content, stream
        assert len(set(ids)) == len(ids) and all(ids)
    # Text that holds no call stays content, with the model's own finish reason.
    plain = {**forced, "extra_body": {"structured_outputs": {"choice": ["No tools needed."]}}}
    for stream in (False, True):
        got_content, calls, finish, _ = chat(client, stream, **plain)
        assert (got_content, calls, finish) == ("No tools needed.", [], "stop"), stream
    # tool_choice "none": tools stay in the template, the answer is text.
    none = {**forced, "tool_choice": "none"}
    got_content, calls, _, _ = chat(client, False, **none)
    assert calls == [] and got_content == text


# ------------------------------------------------------------------------------ errors
def test_tool_errors_are_vllms(server) -> None:
    def refused(body: dict, param: str, words: str) -> None:
        body = {"model": MODEL, "messages": QUESTION, "max_completion_tokens": 4, **body}
        answer = httpx.post(f"{server}/v1/chat/completions", json=body)
        assert answer.status_code == 400, (body, answer.text)
        error = answer.json()["error"]
        assert error["param"] == param and words in error["message"], (body, error)

    refused({"tools": TOOLS}, "tool_choice",
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser')
    refused({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", '"auto" tool choice')
    refused({"tools": []}, "tools", "`tools` must not be an empty array")
    refused({"tool_choice": "required"}, "tool_choice",
            "When using `tool_choice`, `tools` must be set.")
    refused({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice", "The tool specified in `tool_choice` does not match any of the "
            "specified `tools`")
    refused({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}},
            "tool_choice", "Expected field `name` in `function` in `tool_choice`")
    refused({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice",
            "Invalid value for `tool_choice`")
    refused({"tools": [{"type": "function"}]}, "tools[0].function", "must be an object")
    refused({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
            "tools[0].function.parameters", "must be a JSON schema object")
    refused({"tools": [{"type": "function", "function": {
                "name": "f", "parameters": {"type": "object", "properties": 3}}}],
             "tool_choice": "required"}, "tools", "properties must be an object")
    refused({"tools": TOOLS, "tool_choice": "required",
             "structured_outputs": {"choice": ["a"]}}, "tool_choice", "one structured output")
    bad_history = [QUESTION[0], {"role": "assistant", "tool_calls": [{"id": "x"}]}]
    refused({"messages": bad_history}, "messages[1].tool_calls[0]", "must be")
    # The openai client's own error type, with the field named.
    with pytest.raises(openai.BadRequestError) as caught:
        make_client(server).chat.completions.create(
            model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="auto"
        )
    assert caught.value.body["param"] == "tool_choice"  # type: ignore[index]
