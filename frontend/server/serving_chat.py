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
        try:
            prompt = await self.engine.encode_chat(
                messages,
                body.chat_template,
                body.add_generation_prompt and not body.continue_final_message,
                continue_final_message=body.continue_final_message,
                **(body.chat_template_kwargs or {}),
            )
        except Exception as e:  # a template that cannot render these messages
            raise ServingError(f"the chat template failed: {e}", 400, "messages") from None
        max_tokens = body.max_completion_tokens or body.max_tokens
        self.check_length(len(prompt["prompt_token_ids"]), max_tokens)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = self.sampling_params(body, max_tokens, logprobs, body.prompt_logprobs)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        head = {"id": request_id, "created": int(time.time()), "model": self.model_name}
        prepared = await self._prepare([prompt], params, request_id, body.priority)
        if body.stream:
            return self._stream(
                raw,
                prepared,
                lambda outputs: self._chat_chunks(body, prepared, head, outputs, continuous_usage),
            )
        (out,) = await self._collect(raw, prepared)
        choices = [
            self._choice(body, c, message={"role": "assistant", "content": c.text})
            for c in out.outputs
        ]
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        response = {
            **head,
            "object": "chat.completion",
            "choices": choices,
            "usage": _usage(len(out.prompt_token_ids), completion_tokens),
        }
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
                        "delta": {"role": "assistant", "content": ""},
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
        async for _, out in outputs:
            if out.error is not None:
                raise ServingError(out.error, 400)
            for c in out.outputs:
                if not (c.text or c.token_ids or c.finish_reason):
                    continue  # nothing new to show
                completion_tokens[c.index] += len(c.token_ids)
                delta = {"content": c.text} if c.text or not c.finish_reason else {}
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
            "logprobs": self._chat_logprobs(c, body.top_logprobs or 0) if body.logprobs else None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if body.return_token_ids:
            choice["token_ids"] = c.token_ids
        return choice

    def _chat_logprobs(self, c: CompletionOutput, k: int) -> dict[str, Any]:
        content = []
        for token_id, entry in zip(c.token_ids, c.logprobs or []):
            chosen = entry[token_id]
            ranked = sorted(
                (lp for lp in entry.values() if lp.rank is not None and lp.rank <= k),
                key=lambda lp: lp.rank or 0,
            )
            content.append(
                {
                    **_token_logprob(chosen),
                    "top_logprobs": [_token_logprob(lp) for lp in ranked[:k]],
                }
            )
        return {"content": content}


def _token_logprob(lp: Logprob) -> dict[str, Any]:
    token = lp.decoded_token or ""
    return {
        "token": token,
        "logprob": max(lp.logprob, _MIN_LOGPROB),
        "bytes": list(token.encode("utf-8")),
    }
