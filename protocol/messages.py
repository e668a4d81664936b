"""Messages between the frontend and EngineCore: sampling and pooling parameters, requests,
outputs.

All are msgspec Structs (`array_like`, `omit_defaults`, `gc=False`) so they encode compactly
and never need pickle. The frontend builds `EngineCoreRequest`s; EngineCore answers with
`EngineCoreOutputs` holding only the tokens produced since the last step.
"""

from __future__ import annotations

import enum
import json as _json
import re
from typing import Optional, Union

import msgspec
import numpy as np

from tokenmill.protocol.config import EngineConfig, ModelConfig, check_dimensions
from tokenmill.protocol.lark import is_lark, lark_to_ebnf
from tokenmill.protocol.lora import LoRARequest
from tokenmill.protocol.utils import short_repr

# Temperatures below this are treated as greedy (argmax), as in vLLM.
GREEDY_TEMPERATURE = 1e-5
# The most samples one request may ask for: each is a request of its own in the engine.
MAX_N = 1024


class RequestOutputKind(enum.IntEnum):
    """What each streamed RequestOutput holds (vLLM's names)."""

    CUMULATIVE = 0  # everything so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # one output, when the request is finished


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):  # type: ignore[call-arg]
    """Constrains a completion (vLLM's names), compiled by xgrammar in the engine core: a JSON
    schema (a dict or its JSON text), a regular expression, one of a list of strings, an EBNF
    grammar (GBNF style: `root ::= ...`, or simple Lark, converted), or any JSON object.
    Exactly one may be set."""

    json: Union[str, dict, None] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    # JSON only in the compact form (no free whitespace between tokens), as in vLLM; small
    # models otherwise tend to fill the allowed whitespace.
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        kinds = [
            k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k)
        ]
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object; got {kinds or 'none'}"
            )
        if self.choice is not None and (
            not isinstance(self.choice, list) or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError(
                f"structured_outputs.choice must be a list of strings, got {self.choice!r}"
            )
        if isinstance(self.json, dict):
            self.json = _json.dumps(self.json)
        if isinstance(self.grammar, str) and is_lark(self.grammar):  # as vLLM accepts it
            try:
                self.grammar = lark_to_ebnf(self.grammar)
            except ValueError as e:
                raise ValueError(f"grammar (Lark): {e}") from None

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text) of the constraint; xgrammar caches compiled grammars by them."""
        if self.json is not None:
            return ("json", str(self.json))
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            return ("choice", _json.dumps(self.choice))
        if self.grammar is not None:
            return ("grammar", self.grammar)
        return ("json_object", "")


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):  # type: ignore[call-arg]
    """How to sample one request's completion, under vLLM's names and defaults."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Penalties and biases, vLLM's semantics: presence/frequency on output tokens, repetition
    # on prompt and output tokens (> 1 discourages), logit_bias added to the logits (clamped
    # to [-100, 100]), only allowed_token_ids may be sampled, bad_words are never completed.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    # Filled by the frontend from bad_words and its tokenizer: the token sequences to avoid.
    bad_words_token_ids: Optional[list[list[int]]] = None
    # Log-probabilities (of the model's raw logits) of the sampled token and the `logprobs`
    # most likely ones per generated token; `prompt_logprobs` the same for prompt tokens.
    # -1: the whole vocabulary. The engine's max_logprobs caps both.
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    structured_outputs: Optional[StructuredOutputsParams] = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Keep only k prompt tokens (-1: max_model_len of them), applied by the frontend before
    # the request leaves it (vLLM's semantics): the last k ("left", dropping the start), or
    # the first k ("right").
    truncate_prompt_tokens: Optional[int] = None
    truncation_side: str = "left"
    # Trace replay (vLLM's): the decode emits these tokens in turn instead of sampling, while
    # its logprobs stay the model's own (for comparing engines and settings, or RL rollouts
    # on one trajectory). As vLLM, generation then ends with the trace: max_tokens is capped
    # to its length and EOS does not stop it.
    trace_decode_token_ids: Optional[list[int]] = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k == -1:
            self.top_k = 0
        trace = self.trace_decode_token_ids
        if trace is not None:
            if not isinstance(trace, list) or not trace:
                raise ValueError(
                    f"trace_decode_token_ids must be a non-empty list of token ids, got {trace!r}"
                )
            self.ignore_eos = True
            self.max_tokens = min(self.max_tokens or len(trace), len(trace))
            self.min_tokens = min(self.min_tokens, self.max_tokens)
        if self.logit_bias is not None:
            # JSON gives string keys; OpenAI and vLLM clamp biases to [-100, 100].
            try:
                self.logit_bias = {
                    int(t): min(max(float(b), -100.0), 100.0) for t, b in self.logit_bias.items()
                }
            except (TypeError, ValueError, AttributeError):
                raise ValueError(
                    f"logit_bias must map token ids to numbers, got {self.logit_bias!r}"
                ) from None
        self._verify()

    def _verify(self) -> None:
        def fail(name: str, expected: str) -> None:
            raise ValueError(f"{name} must be {expected}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            fail("n", f"an integer in [1, {MAX_N}]")
        if not self.temperature >= 0.0:
            fail("temperature", "non-negative")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", "in (0, 1]")
        if self.top_k < 0:
            fail("top_k", "0 or -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            fail("max_tokens", "at least 1")
        if self.min_tokens < 0:
            fail("min_tokens", "non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"<= max_tokens ({self.max_tokens})")
        # Any 64-bit signed seed, as vLLM takes (child i of n > 1 draws with seed + i).
        if self.seed is not None and not -(2**63) <= self.seed <= 2**63 - self.n:
            fail("seed", "a 64-bit signed integer (seed + n - 1 included)")
        assert isinstance(self.stop, list)
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            fail("stop", "a non-empty string or a list of non-empty strings")
        assert self.stop_token_ids is not None
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "a list of non-negative token ids")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            fail("repetition_penalty", "positive")
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids
            or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)
        ):
            fail("allowed_token_ids", "a non-empty list of token ids")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or k < -1 or k == 0):
            fail("truncate_prompt_tokens", "-1 (max_model_len) or a positive integer")
        if self.truncation_side not in ("left", "right"):
            fail("truncation_side", '"left" (keep the last tokens) or "right" (the first)')
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < -1):
                fail(name, "None, -1 (the whole vocabulary) or a non-negative integer")
        if self.bad_words_token_ids is not None and any(
            not isinstance(seq, list)
            or not seq
            or any(not isinstance(t, int) or t < 0 for t in seq)
            for seq in self.bad_words_token_ids
        ):
            fail("bad_words_token_ids", "a list of non-empty token id lists")
        if self.trace_decode_token_ids is not None and any(
            not isinstance(t, int) or isinstance(t, bool) or t < 0
            for t in self.trace_decode_token_ids
        ):
            fail("trace_decode_token_ids", "a non-empty list of non-negative token ids")
        if self.bad_words is not None and any(
            not isinstance(w, str) or not w.strip() for w in self.bad_words
        ):
            fail("bad_words", "a list of non-empty strings")

    def token_ids_used(self) -> list[int]:
        """Every token id these parameters name (for a range check against the vocabulary)."""
        ids = list(self.stop_token_ids or ()) + list(self.allowed_token_ids or ())
        ids += list(self.logit_bias or ())
        for seq in self.bad_words_token_ids or ():
            ids += seq
        return ids + list(self.trace_decode_token_ids or ())

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


# The pooling tasks PoolingParams.task takes (vLLM's "embed"; its classify, score and per-token
# tasks need heads tokenmill does not build).
POOLING_TASKS = ("embed",)


class PoolingParams(msgspec.Struct, omit_defaults=True, kw_only=True):  # type: ignore[call-arg]
    """How a pooling model turns one prompt into one vector, under vLLM's names: `dimensions`
    keeps a Matryoshka embedding's first n values, `normalize` L2-normalizes it (None: the
    model's pooler config says, normalized by default), `truncate_prompt_tokens` keeps the
    prompt's last k tokens (-1: max_model_len of them; the frontend applies it)."""

    task: str = "embed"
    dimensions: Optional[int] = None
    normalize: Optional[bool] = None
    truncate_prompt_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        def fail(name: str, expected: str) -> None:
            raise ValueError(f"{name} must be {expected}, got {getattr(self, name)!r}")

        if self.task not in POOLING_TASKS:
            fail("task", f"one of {list(POOLING_TASKS)}")
        dims = self.dimensions
        if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool)):
            fail("dimensions", "an integer")
        if dims is not None and dims < 1:
            raise ValueError(f"Dimensions must be greater than 0, got {dims}")  # (vLLM's words)
        if self.normalize is not None and not isinstance(self.normalize, bool):
            fail("normalize", "true, false or null")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or k < -1 or k == 0):
            fail("truncate_prompt_tokens", "-1 (max_model_len) or a positive integer")

    def verify(self, model_config: ModelConfig) -> PoolingParams:
        """These parameters for this model, checked as vLLM checks them, its pooler config's
        defaults filled in (a copy: one PoolingParams may serve many prompts)."""
        pooler = model_config.pooler_config
        if model_config.runner_type != "pooling" or pooler is None:
            raise ValueError(
                "pooling_params are for pooling models; this one generates "
                "(runner='generate'): pass runner='pooling' to embed with it"
            )
        dims = self.dimensions if self.dimensions is not None else pooler.dimensions
        if self.dimensions is not None:
            check_dimensions(model_config, self.dimensions)
        normalize = self.normalize if self.normalize is not None else pooler.normalize
        return msgspec.structs.replace(self, dimensions=dims, normalize=normalize)


class FinishReason(enum.IntEnum):
    """Why a request ended; sent as an int, shown to users as vLLM's strings."""

    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or max_model_len
    ABORT = 2  # cancelled by the client
    ERROR = 3  # rejected by the engine; see EngineCoreOutput.error

    def __str__(self) -> str:
        return self.name.lower()


class LogprobsArrays(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    """Log-probabilities for n positions, as arrays (extra frames on the wire). Column 0 is
    the position's chosen token (sampled, or the prompt's next token), then the top k."""

    token_ids: np.ndarray  # [n, 1 + k] int32
    logprobs: np.ndarray  # [n, 1 + k] float32
    ranks: np.ndarray  # [n] int32: the chosen token's rank (1 = the most likely)

    def first(self, k: int) -> LogprobsArrays:
        """Only the top `k` columns (after the chosen one)."""
        return LogprobsArrays(self.token_ids[:, : k + 1], self.logprobs[:, : k + 1], self.ranks)

    @staticmethod
    def concat(parts: list[LogprobsArrays]) -> LogprobsArrays:
        return LogprobsArrays(
            np.concatenate([p.token_ids for p in parts]),
            np.concatenate([p.logprobs for p in parts]),
            np.concatenate([p.ranks for p in parts]),
        )


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    """A prompt to generate from (`sampling_params`) or to pool (`pooling_params`, on a
    pooling model): exactly one of the two is set."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Optional[SamplingParams]
    eos_token_ids: list[int]
    arrival_time: float
    priority: int = 0
    # Tokens the request already produced on an engine core that went away (resubmitted by
    # a client): it resumes after them as a preempted request does. They count toward
    # max_tokens, min_tokens and penalties, and its grammar is advanced through them.
    resumed_token_ids: list[int] = []
    pooling_params: Optional[PoolingParams] = None
    lora_request: Optional[LoRARequest] = None  # the adapter it runs (enable_lora)

    def __post_init__(self) -> None:
        if (self.sampling_params is None) == (self.pooling_params is None):
            raise ValueError(
                "a request sets exactly one of sampling_params (generate) and pooling_params "
                "(embed)"
            )


def check_request(request: EngineCoreRequest) -> EngineCoreRequest:
    """The request as the engine core will decode it, or a ValueError that names the bad
    field's path and value. A Struct's constructor does not check types, so an ill-typed
    field (a dict where a regex string belongs, say) would otherwise leave the frontend and
    fail to decode in the core; one round trip through builtins runs the decoder's own
    checks (and __post_init__) here instead."""
    data = msgspec.to_builtins(request)
    try:
        checked = msgspec.convert(data, EngineCoreRequest)
    except msgspec.ValidationError as e:
        raise ValueError(describe_validation_error(e, data, EngineCoreRequest)) from None
    try:
        msgspec.msgpack.encode(data)
    except OverflowError:  # msgpack carries 64-bit integers only: say which field
        where = _int_out_of_range(data, list(EngineCoreRequest.__struct_fields__))
        raise ValueError(f"{where[0]}: {where[1]} does not fit in 64 bits") from None
    return checked


def _int_out_of_range(value: object, names: list[str] | None = None, path: str = "") -> tuple:
    """(path, value) of the first integer msgpack cannot carry, or None."""
    if isinstance(value, int) and not isinstance(value, bool):
        return None if -(2**63) <= value < 2**64 else (path or "value", value)
    if isinstance(value, dict):
        items = [(f"{path}.{k}" if path else str(k), v) for k, v in value.items()]
        items += [(f"{path}.{k}" if path else str(k), k) for k in value if isinstance(k, int)]
    elif isinstance(value, list):
        items = [(names[i] if names else f"{path}[{i}]", v) for i, v in enumerate(value)]
    else:
        return None
    for where, item in items:
        found = _int_out_of_range(item, None, where)
        if found is not None:
            return found
    return None


def describe_validation_error(error: msgspec.ValidationError, data: object, type_: type) -> str:
    """msgspec's message with its `$[i]...` path spelt with field names and the value found
    there: "sampling_params.structured_outputs.regex: Expected `str | null`, got `object`
    (value: {'a': 1})"."""
    text = str(error)
    message, sep, path = text.rpartition(" - at `")
    if not sep:
        return text
    steps = re.findall(r"\.([^.\[]+)|\[(\d+)\]", path.rstrip("`").removeprefix("$"))
    names, value, fields, found = [], data, getattr(type_, "__struct_fields__", None), True
    for key, index in steps:
        if index and isinstance(value, list) and fields is not None and not names:
            names.append(fields[int(index)])  # the top-level struct travels as an array
        else:
            names.append(key or f"[{index}]")
        try:
            value = value[int(index)] if index else value[key]  # type: ignore[index]
        except (LookupError, TypeError, ValueError):
            found = False
    if not steps:  # the struct's own check, whose message names its field
        return message
    where = ".".join(names).replace(".[", "[")
    # A message from a struct's own checks (__post_init__, at the struct's path) already
    # says what is wrong inside it.
    shown = ""
    if found and (message.startswith("Expected") or not isinstance(value, dict)):
        shown = f" (value: {short_repr(value)})"
    return f"{where}: {message}{shown}"


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    request_id: str
    new_token_ids: list[int]
    finish_reason: Optional[FinishReason] = None
    stop_reason: Union[int, str, None] = None
    num_cached_tokens: int = 0
    error: Optional[str] = None
    new_logprobs: Optional[LogprobsArrays] = None  # one row per new token
    # All the prompt's positions after the first, with the request's first token.
    prompt_logprobs: Optional[LogprobsArrays] = None
    # With the first token: seconds from the core receiving the request to its first step.
    queue_time: Optional[float] = None
    # A pooling request's vector (float32 [dimensions]), with its finish.
    pooling_output: Optional[np.ndarray] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    """The scheduler's state after a step (gauges) and its running totals since start-up
    (counters), sent with the outputs so that a frontend's metrics never poll the core."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of the KV blocks in use
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found
    num_preemptions: int = 0
    # Speculative decoding (vLLM's names): request steps that verified a proposal, tokens
    # proposed, tokens accepted, and accepted by position in the proposal.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []
    # LoRA (vLLM's lora_requests_info): requests per adapter name, running and waiting.
    running_lora_adapters: dict[str, int] = {}
    waiting_lora_adapters: dict[str, int] = {}


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
    scheduler_stats: Optional[SchedulerStats] = None
    engine_index: int = 0  # the data-parallel rank of the core that sent them


# ---------------------------------------------------------------- engine-core process wire
PROTOCOL_VERSION = 6


class RequestType:
    """First frame of a client -> core message (after the router's identity frame)."""

    HELLO = b"H"
    ADD = b"A"
    ABORT = b"X"
    UTILITY = b"U"
    HEARTBEAT = b"B"  # no body: the client is alive (a daemon drops clients that go quiet)


class OutputType:
    """First frame of a core -> client message."""

    READY = b"R"
    STARTUP_ERROR = b"E"
    OUTPUTS = b"O"
    UTILITY_RESULT = b"U"
    ENGINE_DEAD = b"D"  # the core's last message: it is dying, and why
    REFUSED = b"F"  # a message whose requests could not be read: they will get no output


class Hello(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    protocol_version: int
    auth_token: str = ""


class RankRegistration(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    """A headless data-parallel rank (`engine-core --data-parallel-rank R`) telling the
    frontend where it serves; sent to the frontend's registration socket until answered,
    then now and then again (so that a restarted frontend finds it too). Answered with
    REGISTERED or REFUSED and the reason."""

    protocol_version: int
    rank: int
    address: str  # the daemon's engine address, as clients reach it
    auth_token: str = ""


REGISTERED = b"R"


class Ready(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    """The core's answer to a hello: its settled configuration (model and tokenizer paths,
    max_model_len after auto-fit, ...), which is all a client needs to build its frontend."""

    protocol_version: int
    config: EngineConfig
    num_blocks: int


class StartupError(msgspec.Struct, array_like=True):  # type: ignore[call-arg]
    message: str


class EngineDead(msgspec.Struct, array_like=True):  # type: ignore[call-arg]
    cause: str


class Refused(msgspec.Struct, array_like=True):  # type: ignore[call-arg]
    """The core could not read (the ids of) requests a client sent; the client ends the
    ones the core does not know with this message as their error."""

    message: str


# The utility a client calls now and then: the ids of its requests the core still holds
# (they will get an output). An unfinished request sent before the call and missing from the
# answer was lost on the way and is ended with an error by the client.
LIVE_REQUEST_IDS = "live_request_ids"


class UtilityCall(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    call_id: int
    method: str
    args: list = []


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    call_id: int
    result: Union[int, float, str, bool, dict, list, None] = None
    error: Optional[str] = None
