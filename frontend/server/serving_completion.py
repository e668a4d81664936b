"""/v1/completions: prompts (text or token ids, one or many) -> OpenAI's text completions,
whole or streamed, with echo and logprobs in OpenAI's completions format."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from tokenmill.frontend.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from tokenmill.frontend.server.protocol import CompletionRequest
from tokenmill.frontend.server.serving import (
    _MIN_LOGPROB,
    OpenAIServing,
    Prepared,
    ServingError,
    _prompt_logprobs_json,
    _usage,
    whole_response,
)
from tokenmill.protocol.lora import LoRARequest


class OpenAIServingCompletion(OpenAIServing):
    async def completions(self, body: CompletionRequest, raw: Request) -> Any:
        lora_request, model_name = self.resolve_model(body.model)
        self.check_supported(body)
        continuous_usage = self.check_stream_options(body)
        if body.best_of not in (None, 1, body.n):
            raise ServingError(
                f"best_of must equal n (only n samples are drawn), got {body.best_of}",
                400,
                "best_of",
            )
        given = await self.prompts(body.prompt, body.add_special_tokens)
        prompts = [
            self.truncated(p, body.truncate_prompt_tokens, body.truncation_side) for p in given
        ]
        for prompt in prompts:
            self.check_length(len(prompt["prompt_token_ids"]), body.max_tokens)
            if body.echo and prompt.get("prompt") is None:  # echo a token prompt as text
                prompt["prompt"] = await self.engine.decode(prompt["prompt_token_ids"])
        prompt_logprobs = body.prompt_logprobs
        if body.echo and body.logprobs is not None:
            prompt_logprobs = (
                -1 if -1 in (body.logprobs, prompt_logprobs)
                else max(body.logprobs, prompt_logprobs or 0)
            )  # fmt: skip
        request_id = f"cmpl-{uuid.uuid4().hex}"
        head = {"id": request_id, "created": int(time.time()), "model": model_name}
        if body.use_beam_search:
            return await self._beam_completions(body, raw, prompts, head, lora_request)
        params = self.sampling_params(body, body.max_tokens, body.logprobs, prompt_logprobs)
        prepared = await self._prepare(prompts, params, request_id, body.priority, lora_request)
        if body.stream:
            return self._stream(
                raw,
                prepared,
                lambda outputs: self._completion_chunks(
                    body, prepared, head, outputs, continuous_usage
                ),  # fmt: skip
                self.min_characters(body),
            )
        results = await self._collect(raw, prepared)
        choices = []
        completion_tokens = 0
        for i, out in enumerate(results):
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                text, logprobs = c.text, None
                if body.logprobs is not None:
                    logprobs = self._completion_logprobs(
                        out.prompt_token_ids if body.echo else [],
                        out.prompt_logprobs,
                        c,
                        self.top_k_shown(body.logprobs),
                        0,
                        bool(body.return_tokens_as_token_ids),
                    )
                if body.echo:
                    text = (out.prompt or "") + text
                choice = _choice(i * body.n + c.index, text, logprobs, c.finish_reason,
                                 c.stop_reason)  # fmt: skip
                if body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = _prompt_logprobs_json(out.prompt_logprobs)
                if body.return_token_ids:
                    choice["prompt_token_ids"] = out.prompt_token_ids
                    choice["token_ids"] = c.token_ids
                choices.append(choice)
        prompt_tokens = sum(len(req.prompt_token_ids) for req, _ in prepared)
        usage = _usage(prompt_tokens, completion_tokens)
        return whole_response(head, "text_completion", choices, usage)

    async def _beam_completions(
        self,
        body: CompletionRequest,
        raw: Request,
        prompts: list,
        head: dict[str, Any],
        lora_request: LoRARequest | None,
    ) -> dict[str, Any]:
        """use_beam_search: the n best beams of each prompt as its n choices."""
        params = self.beam_params(body, body.max_tokens)
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for i, prompt in enumerate(prompts):
            search, result = await self.beam_search(
                raw, prompt, params, f"{head['id']}-{i}", lora_request
            )
            prompt_tokens += search.prompt_len
            for k, beam in enumerate(result.sequences):
                completion_tokens += len(beam.tokens) - search.prompt_len
                text = self.beam_text(search, beam)
                choice = _choice(i * body.n + k, text, None, beam.finish_reason, None)
                if body.return_token_ids:
                    choice["prompt_token_ids"] = beam.tokens[: search.prompt_len]
                    choice["token_ids"] = beam.tokens[search.prompt_len :]
                choices.append(choice)
        usage = _usage(prompt_tokens, completion_tokens)
        return whole_response(head, "text_completion", choices, usage)

    async def _completion_chunks(
        self,
        body: CompletionRequest,
        prepared: Prepared,
        head: dict[str, Any],
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        continuous_usage: bool,
    ) -> AsyncIterator[dict[str, Any]]:
        completion_tokens: dict[int, int] = {}  # per choice index
        prompt_lps: dict[int, Any] = {}  # per prompt: they come with its first output only
        offsets: dict[int, int] = {}
        async for i, out in outputs:
            if out.error is not None:
                raise ServingError(out.error, 400)
            if out.prompt_logprobs is not None:
                prompt_lps[i] = out.prompt_logprobs
            num_prompt_tokens = len(prepared[i][0].prompt_token_ids)
            for c in out.outputs:
                index = i * body.n + c.index
                first = index not in completion_tokens
                if not (c.text or c.token_ids or c.finish_reason or first):
                    continue  # nothing new to show (vLLM sends no empty chunks)
                completion_tokens[index] = completion_tokens.get(index, 0) + len(c.token_ids)
                echo = body.echo and first
                text, logprobs = c.text, None
                if body.logprobs is not None:
                    logprobs = self._completion_logprobs(
                        out.prompt_token_ids if echo else [],
                        prompt_lps.get(i),
                        c,
                        self.top_k_shown(body.logprobs),
                        offsets.get(index, 0),
                        bool(body.return_tokens_as_token_ids),
                    )
                    # Offsets run over the tokens' texts, as in a whole answer (a chunk's
                    # text may lag them while a stop string holds text back).
                    offsets[index] = offsets.get(index, 0) + sum(map(len, logprobs["tokens"]))
                if echo:
                    text = (out.prompt or "") + text
                choice = {
                    "index": index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                if first and body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = _prompt_logprobs_json(prompt_lps.get(i))
                if body.return_token_ids:
                    if first:
                        choice["prompt_token_ids"] = out.prompt_token_ids
                    choice["token_ids"] = c.token_ids
                chunk = {**head, "object": "text_completion", "choices": [choice]}
                if continuous_usage:
                    chunk["usage"] = _usage(num_prompt_tokens, completion_tokens[index])
                yield chunk
        if body.stream_options is not None and body.stream_options.include_usage:
            prompt_tokens = sum(len(req.prompt_token_ids) for req, _ in prepared)
            yield {
                **head,
                "object": "text_completion",
                "choices": [],
                "usage": _usage(prompt_tokens, sum(completion_tokens.values())),
            }

    def _completion_logprobs(
        self,
        echoed_ids: list[int],
        prompt_logprobs: PromptLogprobs | None,
        c: CompletionOutput,
        k: int,
        offset: int,
        as_token_ids: bool = False,
    ) -> dict[str, Any]:
        """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs, text_offset
        (echoed prompt positions first; the prompt's first token has no logprob). With
        as_token_ids, tokens are named "token_id:N" (vLLM's return_tokens_as_token_ids)."""

        def name(token_id: int, lp: Logprob | None) -> str:
            if as_token_ids:
                return f"token_id:{token_id}"
            return self._token_text(token_id) if lp is None else (lp.decoded_token or "")

        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        positions: list[tuple[int, dict[int, Logprob] | None]] = []
        if echoed_ids:
            lps = list(prompt_logprobs or [None])
            lps += [None] * (len(echoed_ids) - len(lps))
            positions.extend(zip(echoed_ids, lps))
        positions.extend(zip(c.token_ids, c.logprobs or []))
        for token_id, entry in positions:
            if entry is None:
                tokens.append(name(token_id, None))
                token_logprobs.append(None)
                top.append(None)
                continue
            chosen = entry[token_id]
            tokens.append(name(token_id, chosen))
            token_logprobs.append(max(chosen.logprob, _MIN_LOGPROB))
            top.append(
                {
                    name(t, lp): max(lp.logprob, _MIN_LOGPROB)
                    for t, lp in entry.items()
                    if t == token_id or (lp.rank is not None and lp.rank <= k)
                }
            )
        text_offset = []
        for token in tokens:
            text_offset.append(offset)
            offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": text_offset,
        }

    def _token_text(self, token_id: int) -> str:
        tokenizer = self.engine.tokenizer
        return "" if tokenizer is None else tokenizer.decode([token_id])


def _choice(
    index: int, text: str, logprobs: Any, finish_reason: str | None, stop_reason: Any
) -> dict[str, Any]:
    """A whole answer's choice; vLLM's extra fields are present as null when not asked for."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason, "prompt_logprobs": None, "prompt_token_ids": None,
            "token_ids": None}  # fmt: skip
