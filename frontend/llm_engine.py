"""LLMEngine: the synchronous engine front that `LLM` drives.

Holds the tokenizer, the InputProcessor (prompt -> EngineCoreRequest), the engine-core client
and the OutputProcessor (EngineCoreOutputs -> RequestOutput). `step()` asks the core for one
step's outputs and returns the RequestOutputs they update.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from concurrent.futures import Future
from typing import Any

from tokenmill.frontend.core_client import EngineCoreClient
from tokenmill.frontend.input_processor import InputProcessor, PromptType
from tokenmill.frontend.output_processor import OutputProcessor
from tokenmill.frontend.outputs import PoolingRequestOutput, RequestOutput
from tokenmill.protocol.config import EngineArgs, EngineConfig
from tokenmill.protocol.lora import LoRARequest
from tokenmill.protocol.messages import EngineCoreRequest, PoolingParams, SamplingParams

logger = logging.getLogger(__name__)


_TOKENIZER_LOAD_TIMEOUT_S = 300  # loading reads a few MB from disk: seconds, never minutes

# tokenizer_config.json classes that AutoTokenizer builds as transformers' generic backend
# over `tokenizers` (PreTrainedTokenizerFast is its name before transformers 5).
# Reading an adapter into every worker (and every data-parallel rank): a disk read, seconds.
LORA_TIMEOUT_S = 180.0
_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str) -> Any:
    """HF's tokenizer for a model folder. Where its tokenizer_config.json names the generic
    backend (SmolLM2's does) that class is loaded directly: it is what AutoTokenizer builds,
    but AutoTokenizer imports transformers' model registry and torch with it (4-6 s on 2
    cores), the class alone 1.5 s."""
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            tokenizer_class = json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        tokenizer_class = None
    if tokenizer_class in _GENERIC_TOKENIZERS:
        try:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
        except ImportError:  # transformers 4 has no such module
            pass
        else:
            return TokenizersBackend.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def preload_tokenizer(config: EngineConfig | None, multiprocess: bool) -> Future | None:
    """Starts loading the tokenizer on a thread of its own while a spawned core starts up:
    importing transformers takes about as long as the core's start-up (2-3 s), and the main
    thread only waits for the core's handshake meanwhile. None where there is nothing to
    overlap: a daemon's config comes with its handshake, and an in-process core would
    import torch on the main thread beside it."""
    if config is None or not multiprocess or config.model_config.skip_tokenizer_init:
        return None
    future: Future = Future()
    path = config.model_config.tokenizer

    def load() -> None:
        try:
            future.set_result(load_tokenizer(path))
        except BaseException as e:  # raised where the result is taken
            future.set_exception(e)

    threading.Thread(target=load, name="tokenizer-load", daemon=True).start()
    return future


def make_processors(
    config: EngineConfig, preloaded: Future | None = None
) -> tuple[Any, InputProcessor, OutputProcessor]:
    """The tokenizer (None with skip_tokenizer_init; `preloaded`'s where one was started) and
    the processors around it."""
    model_config = config.model_config
    if model_config.skip_tokenizer_init:
        tokenizer = None
    elif preloaded is not None:
        tokenizer = preloaded.result(timeout=_TOKENIZER_LOAD_TIMEOUT_S)
    else:
        tokenizer = load_tokenizer(model_config.tokenizer)
    lora = config.lora_config is not None
    return tokenizer, InputProcessor(model_config, tokenizer, lora), OutputProcessor(tokenizer)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig | None,
        multiprocess: bool = True,
        engine_address: str | None = None,
        auth_token: str = "",
        reconnect: bool = False,
    ) -> None:
        """`config` builds the core (in this process or a spawned one); with
        `engine_address` the core is a running daemon and its handshake gives the config."""
        tokenizer = preload_tokenizer(config, multiprocess)
        self.client = EngineCoreClient.make_client(
            config, multiprocess, engine_address, auth_token, reconnect
        )
        self.config = self.client.engine_config
        self.tokenizer, self.input_processor, self.output_processor = make_processors(
            self.config, tokenizer
        )

    @classmethod
    def from_engine_args(cls, args: EngineArgs, multiprocess: bool = True) -> LLMEngine:
        return cls(args.create_engine_config(), multiprocess)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.submit(
            [self.input_processor.process(request_id, prompt, params, priority, lora_request)]
        )

    def submit(self, processed: list[tuple[EngineCoreRequest, str | None]]) -> None:
        """Sends already processed requests to the core together (so that a spawned core
        schedules them in one step) and starts tracking their outputs."""
        to_core = []
        try:
            for request, prompt_text in processed:
                to_core.extend(self.output_processor.add_request(request, prompt_text))
        except BaseException:
            self.output_processor.abort_requests([r.request_id for r, _ in processed])
            raise
        self.client.add_requests(to_core)

    def abort_request(self, request_ids: list[str]) -> None:
        self.client.abort_requests(self.output_processor.abort_requests(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        if not self.has_unfinished_requests():
            return []  # nothing can come: waiting for the core's next output would be for ever
        outputs = self.client.get_output()
        results, stopped = self.output_processor.process_outputs(outputs.outputs)
        if stopped:
            self.client.abort_requests(stopped)
        return results

    def get_stats(self) -> dict[str, Any]:
        return self.client.call_utility("get_stats")

    def reset_prefix_cache(self) -> bool:
        return self.client.call_utility("reset_prefix_cache")

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Reads the adapter into the workers now (vLLM's add_lora); False if it was there. A
        ValueError says why it cannot run."""
        return self.client.call_utility("add_lora", lora_request, timeout=LORA_TIMEOUT_S)

    def remove_lora(self, lora_id: int) -> bool:
        return self.client.call_utility("remove_lora", lora_id, timeout=LORA_TIMEOUT_S)

    def list_loras(self) -> set[int]:
        return set(self.client.call_utility("list_loras"))

    def shutdown(self) -> None:
        self.client.shutdown()
