"""Tools and tool-call histories reach the chat template as HF's apply_chat_template gets
them from a client that passes objects: `tools` as the template's variable, an assistant's
tool-call arguments (a JSON string in OpenAI's format) as objects. Through render_chat and
LLM.chat (vLLM's `tools=` argument)."""

from __future__ import annotations

import json

from transformers import AutoTokenizer

from tokenmill import SamplingParams
from tokenmill.frontend.input_processor import render_chat

TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{\"name\": "
    "{{ c.function.name | tojson }}, \"arguments\": {{ c.function.arguments | tojson }}}"
    "</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
ARGUMENTS = {"city": "Zürich"}


def history(arguments) -> list[dict]:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}  # fmt: skip
    return [
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees"},
    ]


def test_tool_history_renders_as_hf_with_objects(smollm2_path: str, smollm2_llm) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    expected = tokenizer.apply_chat_template(
        history(ARGUMENTS), chat_template=TEMPLATE, tools=TOOLS, tokenize=False,
        add_generation_prompt=True,
    )  # fmt: skip
    # The client's form: arguments as a JSON string.
    ours = render_chat(tokenizer, history(json.dumps(ARGUMENTS)), TEMPLATE, tools=TOOLS)
    assert ours["prompt"] == expected
    assert '"arguments": {"city": "Z' in ours["prompt"] and '"name": "get_weather"' in expected
    assert ours["prompt_token_ids"] == tokenizer.encode(expected, add_special_tokens=False)
    # Without tools the template's tools block is not rendered.
    assert "# Tools" not in render_chat(tokenizer, history(ARGUMENTS), TEMPLATE)["prompt"]
    (out,) = smollm2_llm.chat(history(json.dumps(ARGUMENTS)), SamplingParams(max_tokens=1),
                              use_tqdm=False, chat_template=TEMPLATE, tools=TOOLS)  # fmt: skip
    assert out.prompt == expected
