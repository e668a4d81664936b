"""`LLM`: the offline entry point, with vLLM's constructor arguments and methods.

`LLM(model, **engine_args)` builds the engine: by default EngineCore runs in a spawned
engine-core process (`multiprocess=False` or TOKENMILL_MULTIPROC=0: in this process), or
`LLM(engine_address=...)` connects to a running `engine-core` daemon;
`generate(prompts, sampling_params)` submits everything, steps the engine until every
request is finished, and returns RequestOutputs in prompt order; `chat(messages, ...)`
applies the model's chat template first; `beam_search(prompts, BeamSearchParams(...))`
runs vLLM's beam search. A pooling model (runner="pooling") serves `embed(prompts,
pooling_params)` and `encode(...)` instead.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any, Union

import msgspec
from tqdm.auto import tqdm

from tokenmill.frontend.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from tokenmill.frontend.input_processor import PromptType, render_chat
from tokenmill.frontend.llm_engine import LLMEngine
from tokenmill.frontend.outputs import EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from tokenmill.protocol import envs
from tokenmill.protocol.config import EngineArgs
from tokenmill.protocol.lora import LoRARequest
from tokenmill.protocol.messages import (
    POOLING_TASKS,
    PoolingParams,
    RequestOutputKind,
    SamplingParams,
)

logger = logging.getLogger(__name__)

ChatMessages = list[dict[str, Any]]
LoRARequests = Union[LoRARequest, Sequence[Union[LoRARequest, None]], None]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        multiprocess: bool | None = None,
        engine_address: str | None = None,
        auth_token: str | None = None,
        reconnect: bool = False,
        **kwargs: Any,
    ) -> None:
        known = EngineArgs.field_names()
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown engine arguments {unknown}; known: {sorted(known)}")
        if kwargs.get("distributed_executor_backend") == "external_launcher":
            # Under torchrun this process is one rank: its engine core runs right here.
            multiprocess = False
        elif multiprocess is None:
            multiprocess = envs.TOKENMILL_MULTIPROC
        token = auth_token if auth_token is not None else envs.TOKENMILL_AUTH_TOKEN
        if engine_address is not None:
            if kwargs:
                raise TypeError(
                    f"engine arguments {sorted(kwargs)} belong to the engine-core daemon at "
                    f"{engine_address}, not to a client that connects to it"
                )
            self.llm_engine = LLMEngine(None, True, engine_address, token, reconnect)
        else:
            self.engine_args = EngineArgs(model=model, **kwargs)
            config = self.engine_args.create_engine_config()
            self.llm_engine = LLMEngine(config, multiprocess, auth_token=token)
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (vLLM's
        --generation-config auto; "vllm" leaves the engine's own)."""
        return SamplingParams(**self.llm_engine.config.model_config.sampling_defaults)

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequests = None,
    ) -> list[RequestOutput]:
        """Every prompt's final output, in prompt order. `lora_request`: the LoRA adapter
        the prompts run (one for all, or one per prompt; None: the base model)."""
        self._require_runner("generate", "LLM.generate()")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        prompts, params_list, priorities = _per_prompt(prompts, sampling_params, priority)
        loras = _per_prompt_loras(lora_request, len(prompts))
        return self._run(prompts, params_list, priorities, use_tqdm, loras)

    def embed(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequests = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (a string, `{"prompt_token_ids": [...]}`, or a list of
        them), in prompt order, from a pooling model (vLLM's LLM.embed).
        `truncate_prompt_tokens` keeps each prompt's last k tokens (-1: max_model_len of
        them) where its PoolingParams set none."""
        self._require_runner("pooling", "LLM.embed()")
        outputs = self.encode(
            prompts,
            pooling_params,
            truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm,
            priority=priority,
            lora_request=lora_request,
        )
        return [EmbeddingRequestOutput.from_base(o) for o in outputs]

    def encode(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        pooling_task: str = "embed",
        lora_request: LoRARequests = None,
    ) -> list[PoolingRequestOutput]:
        """The pooled vector of each prompt, in prompt order, as PoolingRequestOutputs
        (`outputs.data`: a float32 tensor), from a pooling model (vLLM's LLM.encode); a
        prompt the engine rejected has `error` set and an empty vector."""
        self._require_runner("pooling", "LLM.encode()")
        if pooling_task not in POOLING_TASKS:
            raise ValueError(f"pooling_task must be one of {list(POOLING_TASKS)}, got "
                             f"{pooling_task!r}")  # fmt: skip
        if pooling_params is None:
            pooling_params = PoolingParams(task=pooling_task)
        prompts, params_list, priorities = _per_prompt(prompts, pooling_params, priority)
        if truncate_prompt_tokens is not None:
            params_list = [
                p if p.truncate_prompt_tokens is not None
                else msgspec.structs.replace(p, truncate_prompt_tokens=truncate_prompt_tokens)
                for p in params_list
            ]  # fmt: skip
        loras = _per_prompt_loras(lora_request, len(prompts))
        return self._run(prompts, params_list, priorities, use_tqdm, loras)  # type: ignore[return-value]

    def _require_runner(self, runner_type: str, method: str) -> None:
        """vLLM's refusal of a method the model's runner does not serve."""
        if self.llm_engine.config.model_config.runner_type != runner_type:
            kind = "generative" if runner_type == "generate" else "pooling"
            raise ValueError(
                f"{method} is only supported for {kind} models. Try passing "
                f"`--runner {runner_type}` to use the model as a {kind} model."
            )

    def chat(
        self,
        messages: Union[ChatMessages, Sequence[ChatMessages]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequests = None,
    ) -> list[RequestOutput]:
        """Generates for one conversation or several, each rendered with the model's chat
        template (or `chat_template`); `tools` (OpenAI's function tools) and
        `chat_template_kwargs` reach the template, as in vLLM. The answer is text: turning it
        into tool calls is the server's (--enable-auto-tool-choice)."""
        self._require_runner("generate", "LLM.chat()")
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat() needs a tokenizer; it was skipped (skip_tokenizer_init=True)")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptType] = [
            render_chat(
                tokenizer,
                conversation,
                chat_template,
                add_generation_prompt,
                chat_template_kwargs,
                tools=tools,
            )  # fmt: skip
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def beam_search(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        lora_request: LoRARequests = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search: per prompt, the best `params.beam_width` sequences (prompt
        included in `tokens` and `text`), best first (see frontend/beam_search.py)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        engine = self.llm_engine
        config = engine.config.model_config
        eos = frozenset(config.eos_token_ids)
        tokenize = engine.input_processor.prompt_token_ids
        searches = [BeamSearch(tokenize(p), params, eos, config.max_model_len) for p in prompts]
        loras = _per_prompt_loras(lora_request, len(searches))
        step = searches[0].step_params() if searches else None
        for _ in tqdm(range(params.max_tokens), desc="Beam search", disable=not use_tqdm):
            batch = [(i, beam) for i, s in enumerate(searches) for beam in s.live()]
            if not batch:
                break
            outputs = self.generate(
                [{"prompt_token_ids": beam.tokens} for _, beam in batch], step, use_tqdm=False,
                lora_request=[loras[i] for i, _ in batch],
            )  # fmt: skip
            start = 0
            for search in searches:
                n = len(search.live())
                search.advance(outputs[start : start + n])
                start += n
        return [s.result(engine.tokenizer) for s in searches]

    def _run(
        self,
        prompts: list[PromptType],
        params_list: list[Any],
        priorities: list[int],
        use_tqdm: bool,
        loras: list[LoRARequest | None],
    ) -> list[Any]:
        """Every prompt's final output, in prompt order (RequestOutputs for SamplingParams,
        PoolingRequestOutputs for PoolingParams)."""
        engine = self.llm_engine
        # Only finished outputs are returned here: skip building the ones in between.
        final: dict[int, Any] = {}
        for params in params_list:
            if id(params) not in final and isinstance(params, SamplingParams):
                final[id(params)] = msgspec.structs.replace(
                    params, output_kind=RequestOutputKind.FINAL_ONLY
                )
        params_list = [final.get(id(p), p) for p in params_list]
        # Validate every prompt before submitting any, so a bad one costs nothing else.
        requests = []
        for prompt, params, prio, lora in zip(prompts, params_list, priorities, loras):
            req_id = str(next(self._request_counter))
            requests.append(engine.input_processor.process(req_id, prompt, params, prio, lora))
        engine.submit(requests)

        order = {request.request_id: i for i, (request, _) in enumerate(requests)}
        results: list[Any] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc="Processed prompts", disable=not use_tqdm)
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        results[order[output.request_id]] = output
                        bar.update(1)
        except BaseException:
            engine.abort_request(list(order))
            raise
        finally:
            bar.close()
        return [r for r in results if r is not None]

    def get_stats(self) -> dict[str, Any]:
        """num_running, num_waiting, kv_cache_usage, num_preemptions, prefix_cache_queries
        and prefix_cache_hits (token counts), and the KV cache's size."""
        return self.llm_engine.get_stats()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix. Refused (False, nothing cleared) while requests hold
        KV blocks, as in vLLM."""
        return self.llm_engine.reset_prefix_cache()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Reads a LoRA adapter into the workers before any request names it."""
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.llm_engine.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.llm_engine.list_loras()

    def shutdown(self) -> None:
        self.llm_engine.shutdown()


def _per_prompt_loras(lora_request: LoRARequests, num_prompts: int) -> list[LoRARequest | None]:
    """Each prompt's adapter: one for all (or None), or one per prompt (vLLM's)."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ValueError(f"lora_request has {len(loras)} entries for {num_prompts} prompts")
    return loras


def _per_prompt(
    prompts: Union[PromptType, Sequence[PromptType]],
    params: Any,
    priority: Sequence[int] | None,
) -> tuple[list[PromptType], list[Any], list[int]]:
    """The prompts as a list, with each one's parameters and priority (one set of parameters
    for all, or one per prompt)."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    prompts = list(prompts)
    if isinstance(params, (SamplingParams, PoolingParams)):
        params_list = [params] * len(prompts)
    else:
        params_list = list(params)
        kind = (
            "pooling_params"
            if params_list and isinstance(params_list[0], PoolingParams)
            else "sampling_params"
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"{kind} has {len(params_list)} entries for {len(prompts)} prompts")
    priorities = list(priority) if priority is not None else [0] * len(prompts)
    if len(priorities) != len(prompts):
        raise ValueError(f"priority has {len(priorities)} entries for {len(prompts)} prompts")
    return prompts, params_list, priorities
