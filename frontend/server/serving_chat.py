"""/v1/chat/completions: messages under the model's chat template -> OpenAI's chat
completions, whole or streamed (a role chunk first), with logprobs in OpenAI's chat format.

Tools, as vLLM serves them: they always reach the template; `tool_choice` "auto" hands the
answer to the server's tool parser (--enable-auto-tool-choice --tool-call-parser NAME),
"required" and a named function constrain the answer with a JSON schema built from the tools
(tool_choice.py) and read the calls back from it. A stream runs each choice's text through
its own incremental tool stream (tool_parsers/streaming.py)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from tokenmill.frontend.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.frontend.server.protocol import ChatCompletionRequest
from tokenmill.frontend.server.serving import (
    _MIN_LOGPROB,
    OpenAIServing,
    Prepared,
    ServingError,
    _message_dict,
    _prompt_logprobs_json,
    _usage,
    chat_message,
    whole_response,
)
from tokenmill.frontend.server.serving_models import OpenAIServingModels
from tokenmill.frontend.server.tool_choice import (
    check_schema,
    check_tools,
    constrained_calls,
    tool_choice_schema,
)
from tokenmill.frontend.server.tool_parsers import (
    ToolParser,
    ToolStream,
    named_stream,
    required_stream,
    tool_parser,
)

_AUTO_NEEDS_FLAGS = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self,
        engine: Any,
        models: OpenAIServingModels,
        trust_request_chat_template: bool = False,
        chat_template: str | None = None,
        enable_auto_tools: bool = False,
        tool_parser_name: str | None = None,
    ) -> None:
        """enable_auto_tools and tool_parser_name: what serves tool_choice "auto" (both
        needed, as in vLLM)."""
        super().__init__(engine, models, trust_request_chat_template, chat_template)
        self.tool_parser: ToolParser | None = None
        if tool_parser_name is not None:
            self.tool_parser = tool_parser(tool_parser_name)
        self.enable_auto_tools = enable_auto_tools

    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Any:
        lora_request, model_name = self.resolve_model(body.model)
        self.check_supported(body)
        continuous_usage = self.check_stream_options(body)
        tool_choice = check_tools(body.tools, body.tool_choice)
        auto = tool_choice == "auto"
        if auto and not (self.enable_auto_tools and self.tool_parser is not None):
            raise ServingError(_AUTO_NEEDS_FLAGS, 400, "tool_choice")
        if body.use_beam_search and (tool_choice == "required" or isinstance(tool_choice, dict)):
            raise ServingError(
                "use_beam_search does not constrain its beams: tool_choice must be "
                '"none" or "auto"',
                400,
                "tool_choice",
            )
        schema = tool_choice_schema(body.tools or [], tool_choice, body.parallel_tool_calls)
        if schema is not None:
            check_schema(schema)
        messages = [_message_dict(m, i) for i, m in enumerate(body.messages)]
        if body.top_logprobs is not None and not body.logprobs:
            raise ServingError("top_logprobs needs logprobs=true", 400, "top_logprobs")
        template_kwargs = dict(body.chat_template_kwargs or {})
        if body.reasoning_effort is not None:  # the template's to read, as in vLLM
            template_kwargs.setdefault("reasoning_effort", body.reasoning_effort)
        prompt = await self.render_chat(
            messages,
            body.chat_template,
            body.add_generation_prompt,
            body.continue_final_message,
            body.add_special_tokens,
            body.tools,
            template_kwargs,
        )
        prompt = self.truncated(prompt, body.truncate_prompt_tokens, body.truncation_side)
        max_tokens = body.max_completion_tokens or body.max_tokens
        # Errors name the field the client used.
        field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        self.check_length(len(prompt["prompt_token_ids"]), max_tokens, field, "messages")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        # The answer's role, and what echo puts before its text (vLLM's rules): the
        # assistant's after a generation prompt, else the last message's own.
        add_generation_prompt = body.add_generation_prompt and not body.continue_final_message
        role = "assistant" if add_generation_prompt else messages[-1]["role"]
        echoed = ""
        if body.echo and messages and messages[-1]["role"] == role:
            echoed = messages[-1]["content"]
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        head = {"id": request_id, "created": int(time.time()), "model": model_name}
        if body.use_beam_search:  # the n best beams as the n choices
            search, result = await self.beam_search(
                raw, prompt, self.beam_params(body, max_tokens), request_id, lora_request
            )
            choices = []
            for k, beam in enumerate(result.sequences):
                message, finish_reason = self._message(
                    tool_choice, "assistant", self.beam_text(search, beam), beam.finish_reason
                )
                choices.append(
                    {"index": k, "message": message, "logprobs": None,
                     "finish_reason": finish_reason, "stop_reason": None,
                     "token_ids": beam.tokens[search.prompt_len :] if body.return_token_ids
                     else None}
                )  # fmt: skip
            generated = sum(len(b.tokens) - search.prompt_len for b in result.sequences)
            usage = _usage(search.prompt_len, generated)
            return whole_response(head, "chat.completion", choices, usage)
        # A parser whose markers are special tokens reads the answer with them (vLLM's
        # adjust_request).
        keep_special = (
            auto and self.tool_parser is not None and self.tool_parser.keeps_special_tokens
        )
        params = self.sampling_params(
            body,
            max_tokens,
            logprobs,
            body.prompt_logprobs,
            field,
            constraint=("tool_choice", {"json": schema}) if schema is not None else None,
            skip_special_tokens=False if keep_special else None,
        )
        prepared = await self._prepare([prompt], params, request_id, body.priority, lora_request)
        if body.stream:
            return self._stream(
                raw,
                prepared,
                lambda outputs: self._chat_chunks(
                    body, prepared, head, outputs, continuous_usage, role, echoed, tool_choice
                ),
                self.min_characters(body),
            )
        (out,) = await self._collect(raw, prepared)
        choices = []
        for c in out.outputs:
            message, finish_reason = self._message(
                tool_choice, role, c.text, c.finish_reason, echoed
            )
            choices.append(
                {**self._choice(body, c, message=message), "finish_reason": finish_reason}
            )
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        usage = _usage(len(out.prompt_token_ids), completion_tokens)
        response = whole_response(head, "chat.completion", choices, usage)
        if body.prompt_logprobs is not None:
            response["prompt_logprobs"] = _prompt_logprobs_json(out.prompt_logprobs)
        if body.return_token_ids:
            response["prompt_token_ids"] = out.prompt_token_ids
        return response

    def _message(
        self, tool_choice: Any, role: str, text: str, finish_reason: str | None, echoed: str = ""
    ) -> tuple[dict[str, Any], str | None]:
        """A whole answer's message (echoed text before plain content) and finish reason."""
        content, calls = self._answer(tool_choice, text)
        message = chat_message(role, content if calls else echoed + text, calls)
        return message, _finish_reason(tool_choice, bool(calls), finish_reason)

    def _answer(self, tool_choice: Any, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A whole answer's (content, tool calls) under the request's tool_choice: a named
        function's arguments, required's array of calls, or what the parser finds (auto);
        an answer without calls stays text."""
        if isinstance(tool_choice, dict) or tool_choice == "required":
            calls = constrained_calls(text, tool_choice)
            return ("", [call.as_openai() for call in calls]) if calls else (text, [])
        if tool_choice == "auto":
            assert self.tool_parser is not None
            extracted = self.tool_parser.extract_tool_calls(text)
            if extracted.tools_called:
                return extracted.content, [call.as_openai() for call in extracted.tool_calls]
        return text, []

    def _tool_stream(self, tool_choice: Any) -> ToolStream | None:
        if isinstance(tool_choice, dict):
            return named_stream(tool_choice["function"]["name"])
        if tool_choice == "required":
            return required_stream()
        if tool_choice == "auto":
            assert self.tool_parser is not None
            return self.tool_parser.stream()
        return None

    async def _chat_chunks(
        self,
        body: ChatCompletionRequest,
        prepared: Prepared,
        head: dict[str, Any],
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        continuous_usage: bool,
        role: str = "assistant",
        echoed: str = "",
        tool_choice: Any = None,
    ) -> AsyncIterator[dict[str, Any]]:
        head = {**head, "object": "chat.completion.chunk"}
        num_prompt_tokens = len(prepared[0][0].prompt_token_ids)
        completion_tokens = [0] * body.n
        streams = [self._tool_stream(tool_choice) for _ in range(body.n)]
        # What a chunk must carry even without text: its logprobs or token ids.
        carries = body.logprobs or body.return_token_ids or body.prompt_logprobs is not None
        for i in range(body.n):  # first, each choice's role (as OpenAI streams it)
            first = {
                **head,
                "choices": [
                    {
                        "index": i,
                        "delta": {"role": role, "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            if body.return_token_ids:
                first["prompt_token_ids"] = prepared[0][0].prompt_token_ids
            if continuous_usage:
                first["usage"] = _usage(num_prompt_tokens, 0)
            yield first
            if echoed:  # then the echoed message, as its own chunk (as vLLM streams it)
                delta = {"content": echoed}
                echo = {**head, "choices": [{"index": i, "delta": delta, "logprobs": None,
                                             "finish_reason": None}]}  # fmt: skip
                yield echo
        async for _, out in outputs:
            if out.error is not None:
                raise ServingError(out.error, 400)
            for c in out.outputs:
                if not (c.text or c.token_ids or c.finish_reason):
                    continue  # nothing new to show
                completion_tokens[c.index] += len(c.token_ids)
                stream = streams[c.index]
                if stream is None:
                    # Content even when empty (the last chunk's), as vLLM streams it.
                    delta: dict[str, Any] = {"content": c.text}
                else:
                    delta = _tool_delta(stream, c.text, c.finished())
                    if not (delta or c.finished() or carries):
                        continue  # held back by the tool stream
                    if c.finished() and not delta:
                        delta = {"content": ""}
                choice = self._choice(body, c, delta=delta)
                if c.finished() and stream is not None:
                    choice["finish_reason"] = _finish_reason(
                        tool_choice, stream.tools_called, c.finish_reason
                    )
                chunk = {**head, "choices": [choice]}
                if body.prompt_logprobs is not None and out.prompt_logprobs is not None:
                    chunk["prompt_logprobs"] = _prompt_logprobs_json(out.prompt_logprobs)
                if continuous_usage:
                    chunk["usage"] = _usage(num_prompt_tokens, completion_tokens[c.index])
                yield chunk
        if body.stream_options is not None and body.stream_options.include_usage:
            yield {
                **head,
                "choices": [],
                "usage": _usage(num_prompt_tokens, sum(completion_tokens)),
            }

    def _choice(
        self, body: ChatCompletionRequest, c: CompletionOutput, **content: Any
    ) -> dict[str, Any]:
        """One choice: `message=` in a whole answer, `delta=` in a chunk."""
        choice = {
            "index": c.index,
            **content,
            "logprobs": self._chat_logprobs(c, self.top_k_shown(body.top_logprobs or 0), body)
            if body.logprobs
            else None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if body.return_token_ids:
            choice["token_ids"] = c.token_ids
        elif "message" in content:  # present as null in a whole answer, as vLLM sends it
            choice["token_ids"] = None
        return choice

    def _chat_logprobs(
        self, c: CompletionOutput, k: int, body: ChatCompletionRequest
    ) -> dict[str, Any]:
        as_ids = bool(body.return_tokens_as_token_ids)
        content = []
        for token_id, entry in zip(c.token_ids, c.logprobs or []):
            chosen = entry[token_id]
            ranked = sorted(
                ((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k),
                key=lambda item: item[1].rank or 0,
            )
            content.append(
                {
                    **_token_logprob(token_id, chosen, as_ids),
                    "top_logprobs": [_token_logprob(t, lp, as_ids) for t, lp in ranked[:k]],
                }
            )
        return {"content": content}


def _token_logprob(token_id: int, lp: Logprob, as_token_id: bool = False) -> dict[str, Any]:
    """One token's entry; as_token_id names it "token_id:N" (return_tokens_as_token_ids)."""
    token = f"token_id:{token_id}" if as_token_id else (lp.decoded_token or "")
    return {
        "token": token,
        "logprob": max(lp.logprob, _MIN_LOGPROB),
        "bytes": list(token.encode("utf-8")),
    }


def _finish_reason(tool_choice: Any, called: bool, finish_reason: str | None) -> str | None:
    """vLLM's: "tool_calls" when the parser found calls (auto) or a required answer ended;
    a named function's answer keeps the model's own reason."""
    if called and (
        tool_choice == "auto" or (tool_choice == "required" and finish_reason == "stop")
    ):
        return "tool_calls"
    return finish_reason


def _tool_delta(stream: ToolStream, text: str, finished: bool) -> dict[str, Any]:
    """A chunk's delta through a choice's tool stream: content and tool-call deltas, with
    what the stream held back at the end."""
    parts = [stream.feed(text)] + ([stream.finish()] if finished else [])
    content = "".join(part.content for part in parts)
    calls: list[dict[str, Any]] = []
    for part in parts:
        for call in part.tool_calls:
            shown = call.as_openai()
            if calls and calls[-1]["index"] == call.index and call.name is None:
                calls[-1]["function"]["arguments"] += call.arguments  # one entry per call
            else:
                calls.append(shown)
    delta: dict[str, Any] = {}
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = calls
    return delta
