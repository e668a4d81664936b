"""/v1/chat/completions: messages under the model's chat template -> OpenAI's chat
completions, whole or streamed (a role chunk first), with logprobs in OpenAI's chat format."""

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


class OpenAIServingChat(OpenAIServing):
    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Any:
        self.check_model(body.model)
        self.check_supported(body)
        continuous_usage = self.check_stream_options(body)
        if body.chat_template is not None and not self.trust_request_chat_template:
            raise ServingError(
                "chat_template from a request is refused (start the server with "
                "--trust-request-chat-template to allow it)",
                400,
                "chat_template",
            )
        messages = [_message_dict(m, i) for i, m in enumerate(body.messages)]
        if body.top_logprobs is not None and not body.logprobs:
            raise ServingError("top_logprobs needs logprobs=true", 400, "top_logprobs")
        template_kwargs = dict(body.chat_template_kwargs or {})
        if body.reasoning_effort is not None:  # the template's to read, as in vLLM
            template_kwargs.setdefault("reasoning_effort", body.reasoning_effort)
        try:
            prompt = await self.engine.encode_chat(
                messages,
                body.chat_template,
                body.add_generation_prompt and not body.continue_final_message,
                continue_final_message=body.continue_final_message,
                add_special_tokens=body.add_special_tokens,
                **template_kwargs,
            )
        except Exception as e:  # a template that cannot render these messages
            raise ServingError(f"the chat template failed: {e}", 400, "messages") from None
        prompt = self.truncated(prompt, body)
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
        head = {"id": request_id, "created": int(time.time()), "model": self.model_name}
        if body.use_beam_search:  # the n best beams as the n choices
            search, result = await self.beam_search(
                raw, prompt, self.beam_params(body, max_tokens), request_id
            )
            choices = [
                {"index": k, "message": chat_message("assistant", self.beam_text(search, beam)),
                 "logprobs": None, "finish_reason": beam.finish_reason, "stop_reason": None,
                 "token_ids": beam.tokens[search.prompt_len :] if body.return_token_ids else None}
                for k, beam in enumerate(result.sequences)
            ]  # fmt: skip
            generated = sum(len(b.tokens) - search.prompt_len for b in result.sequences)
            usage = _usage(search.prompt_len, generated)
            return whole_response(head, "chat.completion", choices, usage)
        params = self.sampling_params(body, max_tokens, logprobs, body.prompt_logprobs, field)
        prepared = await self._prepare([prompt], params, request_id, body.priority)
        if body.stream:
            return self._stream(
                raw,
                prepared,
                lambda outputs: self._chat_chunks(
                    body, prepared, head, outputs, continuous_usage, role, echoed
                ),
                self.min_characters(body),
            )
        (out,) = await self._collect(raw, prepared)
        choices = [
            self._choice(body, c, message=chat_message(role, echoed + c.text)) for c in out.outputs
        ]
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        usage = _usage(len(out.prompt_token_ids), completion_tokens)
        response = whole_response(head, "chat.completion", choices, usage)
        if body.prompt_logprobs is not None:
            response["prompt_logprobs"] = _prompt_logprobs_json(out.prompt_logprobs)
        if body.return_token_ids:
            response["prompt_token_ids"] = out.prompt_token_ids
        return response

    async def _chat_chunks(
        self,
        body: ChatCompletionRequest,
        prepared: Prepared,
        head: dict[str, Any],
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        continuous_usage: bool,
        role: str = "assistant",
        echoed: str = "",
    ) -> AsyncIterator[dict[str, Any]]:
        head = {**head, "object": "chat.completion.chunk"}
        num_prompt_tokens = len(prepared[0][0].prompt_token_ids)
        completion_tokens = [0] * body.n
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
                # Content even when empty (the last chunk's), as vLLM streams it.
                delta = {"content": c.text}
                chunk = {**head, "choices": [self._choice(body, c, delta=delta)]}
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
