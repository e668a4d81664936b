"""InputProcessor: user prompts -> `EngineCoreRequest`s.

Accepts a string or vLLM's token form `{"prompt_token_ids": [...]}` (optionally with
"prompt"), tokenizes, checks what can be checked before the request leaves this process
(length against max_model_len, token ids against the vocabulary, every field's type as the
core will decode it), and stamps the model's EOS ids. Called by LLMEngine (and AsyncLLM)
for every request; PoolingParams make a pooling request (checked against the model's pooler
and Matryoshka sizes, its defaults filled in).
"""

from __future__ import annotations

import json
import time
from typing import Any, Union

import msgspec

from tokenmill.protocol.config import ModelConfig
from tokenmill.protocol.lora import LoRARequest
from tokenmill.protocol.messages import (
    EngineCoreRequest,
    PoolingParams,
    SamplingParams,
    check_request,
)

PromptType = Union[str, dict[str, Any]]


class InputProcessor:
    def __init__(
        self, model_config: ModelConfig, tokenizer: Any | None, lora_enabled: bool = False
    ) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.lora_enabled = lora_enabled

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> tuple[EngineCoreRequest, str | None]:
        """Returns the request for the core and the prompt text (None for token prompts):
        a request to generate from with SamplingParams (a generative model's), to pool with
        PoolingParams (a pooling model's); `lora_request`: the adapter it runs."""
        config = self.model_config
        if lora_request is not None:
            if not isinstance(lora_request, LoRARequest):
                raise TypeError(
                    f"lora_request must be a LoRARequest, got {type(lora_request).__name__}"
                )
            if not self.lora_enabled:
                raise ValueError(
                    f"request {request_id!r} names LoRA adapter {lora_request.lora_name!r}, "
                    "but LoRA is not enabled (enable_lora=True)"
                )
        pooling = isinstance(params, PoolingParams)
        if not pooling and not isinstance(params, SamplingParams):
            raise TypeError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}"
            )
        if pooling != (config.runner_type == "pooling"):
            raise ValueError(_runner_mismatch(config.runner_type))
        text, token_ids = self._tokenize(prompt)
        # A pooling prompt keeps its last tokens, as vLLM's renderer truncates token prompts.
        side = "left" if pooling else params.truncation_side  # type: ignore[union-attr]
        token_ids = truncate_prompt(
            token_ids, params.truncate_prompt_tokens, config.max_model_len, side
        )
        if not token_ids:
            raise ValueError(f"the prompt of request {request_id!r} is empty")
        if len(token_ids) > config.max_model_len:
            raise ValueError(
                f"the prompt of request {request_id!r} has {len(token_ids)} tokens, more than "
                f"max_model_len={config.max_model_len}"
            )
        bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < config.vocab_size)]
        if bad:
            raise ValueError(
                f"prompt_token_ids of request {request_id!r} holds ids outside "
                f"[0, {config.vocab_size}): {bad[:8]}"
            )
        if isinstance(params, PoolingParams):
            sampling, pooling_params = None, params.verify(config)
        else:
            sampling, pooling_params = self._resolve_sampling(params), None
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=sampling,
            eos_token_ids=list(config.eos_token_ids),
            arrival_time=time.time(),
            priority=priority,
            pooling_params=pooling_params,
            lora_request=lora_request,
        )
        # Every field as the core will decode it: an ill-typed one fails here, by name,
        # instead of in the core.
        return check_request(request), text

    def _resolve_sampling(self, params: SamplingParams) -> SamplingParams:
        """Checks token ids against the vocabulary and turns bad_words into token sequences
        (on a copy: one SamplingParams may serve many prompts)."""
        vocab = self.model_config.vocab_size
        cap = self.model_config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and cap != -1 and (vocab if k == -1 else k) > cap:
                raise ValueError(
                    f"{name}={k} asks for more than max_logprobs={cap} "
                    f"(an engine argument; -1 there lifts the cap)"
                )
        for name, ids in (
            ("logit_bias", list(params.logit_bias or ())),
            ("allowed_token_ids", params.allowed_token_ids or []),
        ):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:  # naming the vocabulary size, as vLLM's message does
                raise ValueError(
                    f"{name} holds out-of-vocab token ids {bad[:8]} (vocabulary size: {vocab})"
                )
        if not params.bad_words or params.bad_words_token_ids is not None:
            return params
        if self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer (skip_tokenizer_init=True has none)")
        sequences: list[list[int]] = []
        for word in params.bad_words:
            # The word at the start of the text, and after a space when that is another token
            # sequence of the same length (as vLLM does).
            bare = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            sequences.append(bare)
            if len(spaced) == len(bare) and spaced[0] != bare[0]:
                sequences.append(spaced)
        return msgspec.structs.replace(params, bad_words_token_ids=sequences)

    def prompt_token_ids(self, prompt: PromptType) -> list[int]:
        """The prompt's token ids (a text prompt tokenized), unchecked."""
        return self._tokenize(prompt)[1]

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "text prompts need a tokenizer; with skip_tokenizer_init=True pass "
                    '{"prompt_token_ids": [...]}'
                )
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        kind = type(prompt).__name__
        raise TypeError(f'a prompt must be a string or {{"prompt_token_ids": [...]}}, got {kind}')


def _runner_mismatch(runner_type: str) -> str:
    """Why params of the other kind were given (vLLM's wording)."""
    if runner_type == "pooling":
        return (
            "generation is only supported for generative models; this one is a pooling model "
            "(runner='pooling'): use embed() / encode() with PoolingParams, or pass "
            "`--runner generate` to use the model as a generative model"
        )
    return (
        "pooling is only supported for pooling models; this one generates "
        "(runner='generate'): pass `--runner pooling` to use the model as a pooling model"
    )


def truncate_prompt(
    token_ids: list[int], keep: int | None, max_model_len: int, side: str = "left"
) -> list[int]:
    """`keep` prompt tokens (-1: max_model_len of them): the last ones when truncating on the
    left (vLLM's default for generation), the first on the right; all of them for None."""
    if keep is None:
        return token_ids
    keep = max_model_len if keep == -1 else keep
    if len(token_ids) <= keep:
        return token_ids
    return token_ids[:keep] if side == "right" else token_ids[-keep:]


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    add_special_tokens: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """{"prompt": text, "prompt_token_ids": ids} of a chat under the model's template (which
    holds the special tokens itself: the tokenizer adds its own only when asked, as vLLM's
    add_special_tokens). `tools` (OpenAI's function tools) go to the template as `tools`;
    an assistant message's tool calls reach it with their arguments as objects (templates
    write them out with tojson), as vLLM hands them."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer; it was skipped (skip_tokenizer_init=True)")
    text = tokenizer.apply_chat_template(
        [_arguments_as_objects(m) for m in messages],
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **({"tools": tools} if tools is not None else {}),
        **(template_kwargs or {}),
    )
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return {"prompt": text, "prompt_token_ids": ids}


def _arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    parsed = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass  # (left as the client wrote it)
            call = {**call, "function": {**function, "arguments": arguments}}
        parsed.append(call)
    return {**message, "tool_calls": parsed}
