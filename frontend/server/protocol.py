"""The OpenAI API's request bodies (pydantic models), with vLLM's extra sampling fields.

Unknown fields are refused (a typo must not pass silently), and so are OpenAI fields this
engine does not have (audio, web search, ...): `unsupported_fields()` names them, and the server
answers 400. OpenAI fields that change nothing in the answer (`user`, `metadata`, caching
hints, `service_tier`) are accepted and ignored, as vLLM ignores them. Responses are plain
dicts built in serving.py.
"""

from __future__ import annotations

import types
import typing
from functools import cache
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_means_the_default(cls, data: Any) -> Any:
        """A null for a field that has no null value of its own (`n`, `presence_penalty`,
        `echo`, ...) means its default, as OpenAI's API and vLLM's `X | None = default`
        fields take it. Where null means something (`max_tokens`: up to the context), it
        stays."""
        if not isinstance(data, dict):
            return data
        defaulted = _not_nullable(cls)
        return {k: v for k, v in data.items() if v is not None or k not in defaulted}


@cache
def _not_nullable(model: type[BaseModel]) -> frozenset[str]:
    """The names (as a body spells them) of the model's fields that do not take None."""
    names = set()
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if typing.get_origin(annotation) in (Union, types.UnionType):
            if type(None) in typing.get_args(annotation):
                continue
        if not field.is_required():
            names.add(field.alias or name)
    return frozenset(names)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    # A chunk holds at least this many characters of text (the last may hold fewer); also
    # taken at the top level of the body, where vLLM's tests put it.
    min_characters: Optional[int] = Field(default=None, ge=1)
    # OpenAI's random padding of chunks against length side channels: accepted, not sent
    # (the server answers on loopback or behind the operator's TLS).
    include_obfuscation: Optional[bool] = None


class _SamplingFields(_Strict):
    """What both endpoints share: OpenAI's sampling fields and vLLM's extras."""

    model: Optional[str] = None
    n: int = 1
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # vLLM's extra sampling fields.
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    prompt_logprobs: Optional[int] = None
    priority: int = 0
    # vLLM's: the choices also carry their token ids (and the prompt's).
    return_token_ids: bool = False
    # vLLM's: keep only k prompt tokens (-1: max_model_len of them), the last ones unless
    # truncation_side is "right".
    truncate_prompt_tokens: Optional[int] = Field(default=None, ge=-1)
    truncation_side: Optional[Literal["left", "right"]] = None
    min_characters: Optional[int] = Field(default=None, ge=1)
    # vLLM's: logprobs name their tokens "token_id:N" (for tokens that are not valid text).
    return_tokens_as_token_ids: Optional[bool] = None
    # vLLM's beam search: n beams, scored by logprob / length ** length_penalty.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # Structured outputs: vLLM's current field, and its older guided_* names.
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Union[str, dict[str, Any], None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    response_format: Optional[ResponseFormat] = None

    # OpenAI fields the engine does not have: refused when set.
    _UNSUPPORTED: ClassVar[tuple[str, ...]] = ()

    def unsupported_fields(self) -> list[str]:
        return [name for name in self._UNSUPPORTED if getattr(self, name, None) not in (None, [])]


class JsonSchema(_Strict):
    name: str = "response"
    description: Optional[str] = None
    # `schema` shadows a pydantic BaseModel attribute, hence the alias.
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchema] = None


_SamplingFields.model_rebuild()


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    echo: bool = False
    logprobs: Optional[int] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    add_special_tokens: bool = True

    _UNSUPPORTED = ("suffix",)


class ContentPart(BaseModel):
    # Parts of other types (images, audio, files) are named in a clear error when the
    # messages are rendered, not refused here as unknown fields.
    model_config = ConfigDict(extra="allow")

    type: str
    text: Optional[str] = None
    refusal: Optional[str] = None  # an assistant's refusal part: text to the template


class ChatMessage(BaseModel):
    # Histories replayed from other APIs carry fields such as refusal or annotations: the
    # ones that matter are read, the rest ignored (as OpenAI and vLLM do).
    model_config = ConfigDict(extra="ignore")

    # Any role: the chat template decides what it knows (as vLLM passes roles through).
    role: str
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[Any]] = None
    tool_call_id: Optional[str] = None
    function_call: Optional[Any] = None
    audio: Optional[Any] = None  # a reference to an earlier audio answer


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = None  # deprecated by OpenAI for max_completion_tokens
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    # vLLM's chat extras. echo: the answer starts with the last message's content when that
    # message has the answer's role (a continued assistant message, say).
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template holds them; the tokenizer's on top
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # Handed to the chat template as a keyword, as vLLM does (templates without it ignore it).
    reasoning_effort: Optional[str] = None
    # OpenAI fields that change nothing in the answer: accepted and ignored (as in vLLM).
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    prompt_cache_options: Optional[dict[str, Any]] = None
    # Function tools (checked in tool_choice.py, as vLLM checks them).
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None
    # OpenAI fields without an engine behind them (refused when they ask for something).
    functions: Optional[list[Any]] = None
    function_call: Optional[Any] = None
    audio: Optional[Any] = None
    modalities: Optional[list[str]] = None
    prediction: Optional[Any] = None
    web_search_options: Optional[Any] = None
    moderation: Optional[Any] = None
    verbosity: Optional[str] = None
    store: Optional[bool] = None

    _UNSUPPORTED = (
        "functions",
        "audio",
        "prediction",
        "web_search_options",
        "moderation",
        "verbosity",
    )

    def unsupported_fields(self) -> list[str]:
        found = super().unsupported_fields()
        if self.function_call not in (None, "none"):
            found.append("function_call")
        if self.modalities not in (None, ["text"]):
            found.append("modalities")
        if self.store:
            found.append("store")
        return found


class TokenizeRequest(_Strict):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[Any]] = None  # to the chat template, as in a chat request
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: Optional[str] = None
    tokens: list[int]


class _EmbeddingFields(_Strict):
    """What both embeddings bodies share (vLLM's EmbeddingCompletionRequest and
    EmbeddingChatRequest)."""

    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    # Matryoshka models only: the first `dimensions` of the vector (normalized after).
    dimensions: Optional[int] = None
    user: Optional[str] = None
    # vLLM's: keep only k prompt tokens (-1: max_model_len of them), the last ones.
    truncate_prompt_tokens: Optional[int] = Field(default=None, ge=-1)
    # vLLM's: override the pooler's normalization for this request.
    normalize: Optional[bool] = None
    priority: int = 0


class EmbeddingCompletionRequest(_EmbeddingFields):
    input: Union[str, list[str], list[int], list[list[int]]]
    add_special_tokens: bool = True


class EmbeddingChatRequest(_EmbeddingFields):
    messages: list[ChatMessage]
    # vLLM's defaults for embedding a chat: no generation prompt, no tokenizer specials.
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
