"""What the OpenAI endpoints share: request bodies -> checked engine requests -> outputs.

`OpenAIServing` turns a validated body into SamplingParams (checking what the engine would
otherwise clip or reject later: context length, logprob counts, structured output specs),
prepares every prompt's request before any answer starts, and runs them on AsyncLLM, whole
(`_collect`) or as server-sent events (`_stream`). A request whose client goes away is aborted
in the core at once. A body's `model` names the base model or a LoRA adapter
(serving_models.py), whose LoRARequest goes with each of its requests. Errors are
`ServingError`s, which the app turns into OpenAI error bodies. The endpoints' own shapes live
in serving_completion.py and serving_chat.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import re
from collections.abc import AsyncIterator, Coroutine
from typing import TYPE_CHECKING, Any, Optional

import msgspec
from fastapi import Request

from tokenmill.frontend.async_llm import AsyncLLM
from tokenmill.frontend.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
)
from tokenmill.frontend.input_processor import truncate_prompt
from tokenmill.frontend.outputs import CompletionOutput, PromptLogprobs, RequestOutput
from tokenmill.frontend.server.protocol import _SamplingFields
from tokenmill.protocol.lora import LoRARequest
from tokenmill.protocol.messages import (
    EngineCoreRequest,
    PoolingParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
    describe_validation_error,
)

if TYPE_CHECKING:  # (serving_models.py raises this module's ServingError)
    from tokenmill.frontend.server.serving_models import OpenAIServingModels

logger = logging.getLogger("tokenmill.server")

# Every prompt's request for the core, and its text.
Prepared = list[tuple[EngineCoreRequest, Optional[str]]]

# JSON has no -inf: vLLM sends this floor instead.
_MIN_LOGPROB = -9999.0
# Fields of structured_outputs that modify a constraint rather than being one.
_STRUCTURED_OPTIONS = ("disable_any_whitespace",)


class ServingError(Exception):
    """A request the server refuses: an OpenAI error body with this status. `err_type`
    overrides the body's type where vLLM names it otherwise (its LoRA routes'
    "InvalidUserInput")."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        err_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
        self.err_type = err_type

    @property
    def type(self) -> str:
        if self.err_type is not None:
            return self.err_type
        return {
            400: "BadRequestError",
            401: "AuthenticationError",
            404: "NotFoundError",
            503: "ServiceUnavailableError",
        }.get(self.status, "InternalServerError")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }


def sse(payload: dict[str, Any] | str) -> str:
    if isinstance(payload, str):
        return f"data: {payload}\n\n"
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLM,
        models: OpenAIServingModels,
        trust_request_chat_template: bool = False,
        chat_template: str | None = None,
    ) -> None:
        """models: the names a request's `model` may give (the base model, LoRA adapters);
        chat_template: the server's (--chat-template), over the model's own."""
        self.engine = engine
        self.models = models
        self.trust_request_chat_template = trust_request_chat_template
        self.chat_template = chat_template
        self.max_model_len = engine.model_config.max_model_len
        self.max_logprobs = engine.model_config.max_logprobs

    # -------------------------------------------------------------------- checks
    def resolve_model(self, model: str | None) -> tuple[LoRARequest | None, str]:
        """The adapter a body's `model` names (None: the base model, also for a body without
        a model) and the name its response gives; an unknown model is a 404."""
        lora_request = self.models.resolve(model)
        return lora_request, self.models.model_name(lora_request)

    def check_supported(self, body: _SamplingFields) -> None:
        for name in body.unsupported_fields():
            what = " (use tools and tool_choice)" if "function" in name else ""
            raise ServingError(f"{name} is not supported by this server{what}", 400, name)
        if body.n < 1:
            raise ServingError(f"n must be at least 1, got {body.n}", 400, "n")

    def check_length(
        self,
        num_prompt_tokens: int,
        max_tokens: int | None,
        field: str = "max_tokens",
        prompt: str = "prompt",
    ) -> None:
        """vLLM's check and message; `prompt` names what the prompt came from (the prompt,
        or the messages), the param the prompt if it alone is too long."""
        too_long = num_prompt_tokens >= self.max_model_len
        if too_long or (
            max_tokens is not None and num_prompt_tokens + max_tokens > self.max_model_len
        ):
            asked = num_prompt_tokens + (max_tokens or 0)
            raise ServingError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {asked} tokens ({num_prompt_tokens} in the {prompt}, "
                f"{max_tokens or 0} in the completion, {field}). Please reduce the length of "
                f"the {prompt} or completion.",
                400,
                prompt if too_long or max_tokens is None else field,
            )

    def sampling_params(
        self,
        body: _SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None,
        max_tokens_field: str = "max_tokens",
        constraint: tuple[str, dict[str, Any]] | None = None,
        skip_special_tokens: bool | None = None,
    ) -> SamplingParams:
        """SamplingParams from a body; a bad value is a 400 naming its field (max_tokens
        under the name the client gave it). `constraint`: a structured output the server
        adds (a tool_choice's schema: (field, spec)); `skip_special_tokens` overrides the
        body's (a tool parser whose markers are special tokens)."""
        if max_tokens is not None and max_tokens < 1:
            raise ServingError(
                f"{max_tokens_field} must be at least 1, got {max_tokens}", 400, max_tokens_field
            )
        for name, k in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if k is None or (k == -1 and self.max_logprobs == -1):  # -1: the whole vocabulary
                continue
            if k < 0 or (self.max_logprobs != -1 and k > self.max_logprobs):
                allowed = "0 or more (or -1)" if self.max_logprobs == -1 else (
                    f"between 0 and {self.max_logprobs} (-1 needs --max-logprobs -1)"
                )  # fmt: skip
                raise ServingError(f"{name} must be {allowed}, got {k}", 400, name)
        fields: dict[str, Any] = {
            "n": body.n,
            "seed": body.seed,
            "max_tokens": max_tokens,
            "min_tokens": body.min_tokens,
            "stop": body.stop,
            "stop_token_ids": body.stop_token_ids,
            "ignore_eos": body.ignore_eos,
            "include_stop_str_in_output": body.include_stop_str_in_output,
            "skip_special_tokens": body.skip_special_tokens
            if skip_special_tokens is None
            else skip_special_tokens,
            "spaces_between_special_tokens": body.spaces_between_special_tokens,
            "presence_penalty": body.presence_penalty,
            "frequency_penalty": body.frequency_penalty,
            "logit_bias": _token_id_keys(body.logit_bias),
            "allowed_token_ids": body.allowed_token_ids,
            "bad_words": body.bad_words,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "structured_outputs": self._structured(body, constraint),
            "truncate_prompt_tokens": body.truncate_prompt_tokens,
            "truncation_side": body.truncation_side or "left",
            "output_kind": RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY,
        }
        # What the request leaves out comes from the model's generation config (vLLM's
        # --generation-config auto), else the engine's own defaults.
        defaults = self.engine.model_config.sampling_defaults
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            value = getattr(body, name)
            value = defaults.get(name) if value is None else value
            if value is not None:
                fields[name] = value
        if max_tokens is None and "max_tokens" in defaults:
            fields["max_tokens"] = defaults["max_tokens"]
        try:  # the message types' own checks: a bad value is named by its path
            return msgspec.convert(fields, SamplingParams)
        except msgspec.ValidationError as e:
            message = describe_validation_error(e, fields, SamplingParams)
            param = re.split(r"[ .\[:]", message, maxsplit=1)[0]
            raise ServingError(message, 400, param if param in fields else None) from None

    def _structured(
        self, body: _SamplingFields, constraint: tuple[str, dict[str, Any]] | None = None
    ) -> StructuredOutputsParams | None:
        specs: list[tuple[str, dict[str, Any]]] = [constraint] if constraint else []
        fmt = body.response_format
        if fmt is not None and fmt.type == "json_object":
            specs.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            schema = fmt.json_schema.json_schema if fmt.json_schema is not None else None
            # OpenAI's type leaves the schema out at will: then any JSON object is the answer.
            spec = {"json": schema} if schema is not None else {"json_object": True}
            specs.append(("response_format", spec))
        # structured_outputs may carry only options, for a constraint given another way.
        options: dict[str, Any] = {}
        if body.structured_outputs is not None:
            spec = dict(body.structured_outputs)
            options = {k: spec.pop(k) for k in _STRUCTURED_OPTIONS if k in spec}
            if spec:
                specs.append(("structured_outputs", spec))
        for name, key in (
            ("guided_json", "json"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
        ):
            value = getattr(body, name)
            if value is not None:
                specs.append((name, {key: value}))
        if not specs:
            if options:
                raise ServingError(
                    f"structured_outputs holds options {sorted(options)} but no constraint",
                    400,
                    "structured_outputs",
                )
            return None
        if len(specs) > 1:
            names = [name for name, _ in specs]
            raise ServingError(f"give one structured output constraint, got {names}", 400, names[0])
        name, spec = specs[0]
        if isinstance(spec.get("json"), str):  # a schema as JSON text must parse
            try:
                json.loads(spec["json"])
            except ValueError as e:
                message = f"{name}: the JSON schema does not parse: {e}"
                raise ServingError(message, 400, name) from None
        spec = {**spec, **options}
        try:
            return msgspec.convert(spec, StructuredOutputsParams)
        except msgspec.ValidationError as e:
            message = describe_validation_error(e, spec, StructuredOutputsParams)
            raise ServingError(f"{name}: {message}", 400, name) from None

    async def prompts(
        self, given: Any, add_special_tokens: bool, field: str = "prompt"
    ) -> list[dict[str, Any]]:
        """The prompts of a completions `prompt` or an embeddings `input`: a text, texts, a
        token list or token lists (tokenized off the loop); none may be empty."""
        if isinstance(given, str):
            texts: list[str] = [given]
        elif given and all(isinstance(p, str) for p in given):
            texts = list(given)
        elif given and all(isinstance(p, int) for p in given):
            return [{"prompt_token_ids": list(given)}]
        elif given and all(isinstance(p, list) and p for p in given):
            return [{"prompt_token_ids": list(p)} for p in given]
        else:
            raise ServingError(f"{field} must not be empty", 400, field)
        prompts = [await self.engine.encode_prompt(text, add_special_tokens) for text in texts]
        if any(not prompt["prompt_token_ids"] for prompt in prompts):
            raise ServingError(f"{field} must not be empty", 400, field)
        return prompts

    async def render_chat(
        self,
        messages: list[dict[str, Any]],
        chat_template: str | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        add_special_tokens: bool,
        tools: list[Any] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A chat as a token prompt under the template (the request's, with
        --trust-request-chat-template, else the server's, else the model's); a template
        that cannot render these messages is a 400."""
        if chat_template is not None and not self.trust_request_chat_template:
            raise ServingError(
                "chat_template from a request is refused (start the server with "
                "--trust-request-chat-template to allow it)",
                400,
                "chat_template",
            )
        try:
            return await self.engine.encode_chat(
                messages,
                chat_template or self.chat_template,
                add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                add_special_tokens=add_special_tokens,
                tools=tools,
                **(template_kwargs or {}),
            )
        except Exception as e:  # (jinja's errors, the template's own raise_exception)
            raise ServingError(f"the chat template failed: {e}", 400, "messages") from None

    def truncated(
        self, prompt: dict[str, Any], keep: int | None, side: str | None = None
    ) -> dict[str, Any]:
        """The prompt as the engine will see it under truncate_prompt_tokens (its length is
        what the context check counts): the last `keep` tokens, the first with side "right"."""
        ids = prompt["prompt_token_ids"]
        kept = truncate_prompt(ids, keep, self.max_model_len, side or "left")
        if len(kept) == len(ids):
            return prompt
        return {"prompt_token_ids": kept, "prompt": None}

    def top_k_shown(self, k: int) -> int:
        """How many top logprobs a response shows for a request of k (-1: all of them)."""
        return self.engine.model_config.vocab_size if k == -1 else k

    # -------------------------------------------------------------- beam search
    def beam_params(self, body: _SamplingFields, max_tokens: int | None) -> BeamSearchParams:
        """use_beam_search: n beams (vLLM's mapping); no stream, no logprobs."""
        if body.stream:
            raise ServingError("use_beam_search does not stream", 400, "use_beam_search")
        limit = max_tokens if max_tokens is not None else self.max_model_len
        try:
            return BeamSearchParams(
                beam_width=body.n,
                max_tokens=limit,
                ignore_eos=body.ignore_eos,
                temperature=body.temperature or 0.0,
                length_penalty=body.length_penalty,
            )
        except ValueError as e:
            raise ServingError(str(e), 400, "n") from None

    async def beam_search(
        self,
        raw: Request,
        prompt: dict[str, Any],
        params: BeamSearchParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
    ) -> tuple[BeamSearch, BeamSearchOutput]:
        """One prompt's beam search, each step's beams run as ordinary requests."""
        config = self.engine.model_config
        eos = frozenset(config.eos_token_ids)
        search = BeamSearch(prompt["prompt_token_ids"], params, eos, config.max_model_len)
        step = search.step_params()
        for n in itertools.count():
            beams = search.live()
            if not beams:
                break
            prepared = await self._prepare(
                [{"prompt_token_ids": b.tokens} for b in beams],
                step,
                f"{request_id}-{n}",
                0,
                lora_request,
            )
            search.advance(await self._collect(raw, prepared))
        return search, search.result()

    def beam_text(self, search: BeamSearch, beam: BeamSearchSequence) -> str:
        tokenizer = self.engine.tokenizer
        generated = beam.tokens[search.prompt_len :]
        return "" if tokenizer is None else tokenizer.decode(generated, skip_special_tokens=True)

    # ------------------------------------------------------------------ running
    async def _prepare(
        self,
        prompts: list[dict[str, Any]],
        params: SamplingParams | PoolingParams,
        request_id: str,
        priority: int,
        lora_request: LoRARequest | None = None,
    ) -> Prepared:
        """Every prompt's request for the core (run with the adapter where one is named),
        checked before any answer starts (so that a bad prompt or parameter is a 400, also
        for a stream)."""
        prepared = []
        for i, prompt in enumerate(prompts):
            try:
                prepared.append(
                    await self.engine.process_inputs(
                        f"{request_id}-{i}", prompt, params, priority, lora_request
                    )
                )
            except (ValueError, TypeError) as e:
                raise ServingError(str(e), 400, _param_named_in(str(e))) from None
        return prepared

    async def _generate(self, prepared: Prepared) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of every prompt's request, as (prompt index, output), interleaved."""
        streams = [self.engine.generate(req, prompt_text=text) for req, text in prepared]
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def drain(i: int, stream: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
                queue.put_nowait(done)
            except BaseException as e:  # handed to the reader, who raises it
                queue.put_nowait(e)

        tasks = [asyncio.ensure_future(drain(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()  # their streams abort their requests

    async def _collect(self, raw: Request, prepared: Prepared) -> list[RequestOutput]:
        """Every request's final output. If the client goes away first, the work is
        cancelled (its requests aborted in the core) and the client gets nothing."""

        async def gather() -> list[RequestOutput]:
            results: list[RequestOutput | None] = [None] * len(prepared)
            async for i, out in self._generate(prepared):
                results[i] = out
            return results  # type: ignore[return-value]

        results = await until_disconnect(raw, gather())
        for out in results:
            if out.error is not None:
                raise ServingError(out.error, 400)
        return results

    async def _stream(
        self, raw: Request, prepared: Prepared, chunks: Any, min_characters: int | None = None
    ) -> AsyncIterator[str]:
        """Server-sent events: what `chunks` makes of the outputs (merged per choice until
        they hold min_characters of text, when given), then `data: [DONE]`. An
        error after the stream began is sent as an error event. A client that goes away has
        its requests aborted in the core at once (not at the next token's failed send)."""
        request_ids = [req.request_id for req, _ in prepared]
        watcher = asyncio.ensure_future(_abort_on_disconnect(raw, self.engine, request_ids))
        try:
            async for event in chunks(coalesce(self._generate(prepared), min_characters)):
                yield sse(event)
        except asyncio.CancelledError:
            if watcher.done() and not watcher.cancelled():
                return  # the client went away: its requests are aborted
            raise
        except ServingError as e:
            yield sse(e.body())
        except Exception as e:
            logger.exception("a stream failed")
            status = 503 if self.engine.dead is not None else 500
            yield sse(ServingError(f"{type(e).__name__}: {e}", status).body())
        finally:
            watcher.cancel()
        yield sse("[DONE]")

    @staticmethod
    def min_characters(body: _SamplingFields) -> int | None:
        """At the body's top level (where vLLM's tests put it) or in stream_options."""
        options = body.stream_options
        return body.min_characters or (options.min_characters if options is not None else None)

    def check_stream_options(self, body: _SamplingFields) -> bool:
        """Whether every chunk carries usage so far (continuous_usage_stats)."""
        if body.stream_options is not None and not body.stream:
            raise ServingError("stream_options is only allowed with stream=true", 400)
        options = body.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats


async def coalesce(
    outputs: AsyncIterator[tuple[int, RequestOutput]], min_characters: int | None
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Streamed (delta) outputs merged per choice until their text holds at least
    min_characters (vLLM's stream_options.min_characters); a finished choice is sent with
    whatever it holds. None: as they come."""
    if not min_characters:
        async for item in outputs:
            yield item
        return
    held: dict[tuple[int, int], CompletionOutput] = {}
    async for i, out in outputs:
        ready = []
        for c in out.outputs:
            key = (i, c.index)
            if key in held:
                c = _merged(held.pop(key), c)
            if len(c.text) >= min_characters or c.finished():
                ready.append(c)
            else:
                held[key] = c
        if ready or out.error is not None or out.prompt_logprobs is not None:
            yield i, dataclasses.replace(out, outputs=ready)


def _merged(a: CompletionOutput, b: CompletionOutput) -> CompletionOutput:
    logprobs = None if a.logprobs is None and b.logprobs is None else (
        (a.logprobs or []) + (b.logprobs or [])
    )  # fmt: skip
    return dataclasses.replace(
        b, text=a.text + b.text, token_ids=a.token_ids + b.token_ids, logprobs=logprobs
    )


async def until_disconnect(raw: Request, work: Coroutine[Any, Any, Any]) -> Any:
    """What `work` returns, unless the client goes away first: then the work is cancelled
    (its requests aborted in the core) and the client gets nothing (499). Cancelled on a
    failure too, so that the rest of its requests end at once."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_cancel_on_disconnect(raw, task))
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            raise ServingError("the client disconnected", 499) from None
        raise
    finally:
        watcher.cancel()
        task.cancel()


async def _cancel_on_disconnect(raw: Request, work: asyncio.Future) -> None:
    """Waits for the client to go away, then cancels its work (which aborts its requests)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass
    work.cancel()


async def _abort_on_disconnect(raw: Request, engine: AsyncLLM, request_ids: list[str]) -> None:
    """Waits for the client to go away, then aborts its requests in the core."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass
    for request_id in request_ids:
        await engine.abort(request_id)


def _param_named_in(message: str) -> str | None:
    """The field a ValueError's message begins with (`max_tokens must be ...`, or a path:
    `sampling_params.structured_outputs.regex: ...` names structured_outputs), if any."""
    first = message.split(" ", 1)[0].strip("`'\":").removeprefix("sampling_params.")
    first = re.split(r"[.\[]", first, maxsplit=1)[0]
    named = first.isidentifier() and ("_" in first or first in ("n", "seed", "stop"))
    return first if named else None


def _token_id_keys(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """logit_bias as JSON carries it (token ids as string keys) -> keyed by token id."""
    if logit_bias is None:
        return None
    ids, bad = {}, []
    for key, bias in logit_bias.items():
        try:
            ids[int(key)] = bias
        except ValueError:
            bad.append(key)
    if bad:
        raise ServingError(
            f"logit_bias holds keys that are not integer token ids: {bad[:4]}", 400, "logit_bias"
        )
    return ids


def _prompt_logprobs_json(prompt_logprobs: PromptLogprobs | None) -> list | None:
    """vLLM's shape: per prompt position, None or {token id: {logprob, rank, decoded_token}}."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if entry is None
        else {
            str(t): {
                "logprob": max(lp.logprob, _MIN_LOGPROB),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for t, lp in entry.items()
        }
        for entry in prompt_logprobs
    ]


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": None,
    }


def whole_response(head: dict[str, Any], kind: str, choices: list, usage: dict) -> dict:
    """A whole (not streamed) answer. Every field of OpenAI's response types (and vLLM's) is
    present, as null where this server has nothing for it, so that an answer has the same
    keys whichever route served it (/invocations too) and as the `openai` client's objects."""
    response = {**head, "object": kind, "choices": choices, "usage": usage,
                "service_tier": None, "system_fingerprint": None}  # fmt: skip
    if kind == "chat.completion":
        response.update(metadata=None, moderation=None, prompt_logprobs=None,
                        prompt_token_ids=None)  # fmt: skip
    return response


def chat_message(
    role: str, content: str | None, tool_calls: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """An answer's message, with OpenAI's fields this server never fills as null (and an
    empty list of tool calls when there are none, as vLLM sends it)."""
    return {"role": role, "content": content, "refusal": None, "annotations": None,
            "audio": None, "function_call": None, "tool_calls": tool_calls or []}  # fmt: skip


def _message_dict(message: Any, index: int) -> dict[str, Any]:
    """A chat message as the template expects it: text content, and an assistant's tool
    calls or a tool answer's call id (render_chat turns the calls' arguments into objects)."""
    where = f"messages[{index}]"
    if message.role == "function" or message.function_call:
        raise ServingError(
            "the legacy function_call and function messages are not supported; use tools, "
            "tool_calls and tool messages",
            400,
            where,
        )
    if message.audio is not None:
        raise ServingError(
            "messages that refer to an audio answer are not supported by this server (no "
            "audio output)",
            400,
            f"{where}.audio",
        )
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            # A refusal part is the assistant's text, as vLLM renders it.
            text = {"text": part.text, "refusal": part.refusal}.get(part.type)
            if text is None:
                raise ServingError(
                    f"{where}.content holds a part of type {part.type!r}; only text "
                    "(and refusal) parts are supported",
                    400,
                    f"{where}.content",
                )
            texts.append(text)
        content = "\n".join(texts)  # as vLLM joins text parts
    result = {"role": message.role, "content": content or ""}
    if message.name is not None:
        result["name"] = message.name
    if message.tool_calls:
        for k, call in enumerate(message.tool_calls):
            _check_tool_call(call, f"{where}.tool_calls[{k}]")
        result["tool_calls"] = list(message.tool_calls)
    if message.tool_call_id is not None:
        result["tool_call_id"] = message.tool_call_id
    return result


def _check_tool_call(call: Any, where: str) -> None:
    """An assistant's earlier call, as OpenAI writes it: {"id", "type": "function",
    "function": {"name", "arguments"}} (arguments a JSON string, or an object)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ServingError(
            f'{where} must be {{"id": ..., "type": "function", "function": {{"name": ..., '
            f'"arguments": ...}}}}, got {call!r}',
            400,
            where,
        )
    if not isinstance(function.get("arguments", "{}"), (str, dict)):
        raise ServingError(
            f"{where}.function.arguments must be a JSON string or an object",
            400,
            f"{where}.function.arguments",
        )
