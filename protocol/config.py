"""Engine arguments and the configuration bus that reaches every constructor.

`EngineArgs` holds the user's arguments under vLLM's names; `create_engine_config()` validates
them, resolves the model folder and derives what can be derived into a frozen `EngineConfig`
(model, cache, scheduler, parallel, device and load sub-configs). Built by the frontend (or the
engine-core CLI); read by EngineCore, the scheduler, executors, workers and model runners.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tokenmill.protocol import envs
from tokenmill.protocol.default_model import resolve_model
from tokenmill.protocol.device_defaults import DeviceDefaults, device_defaults, has_triton
from tokenmill.protocol.lora import LoRAConfig
from tokenmill.protocol.model_registry import check_architecture

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


def _check(ok: bool, name: str, value: Any, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


# vLLM's pooling types; "ALL" and "STEP" (a vector per token) are not built here.
POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNER_TYPES = ("auto", "generate", "pooling")
CONVERT_TYPES = ("auto", "none", "embed")


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling model turns a prompt's hidden states into one vector (vLLM's
    `--pooler-config` keys): the last token's (LAST), their mean (MEAN) or the first token's
    (CLS); L2-normalized unless `normalize` is False; `dimensions`, a Matryoshka model's
    default output size (a request's own PoolingParams.dimensions wins)."""

    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        kind = self.pooling_type
        if kind is not None:
            kind = str(kind).upper()
            object.__setattr__(self, "pooling_type", kind)
            _check(kind in POOLING_TYPES, "pooler_config.pooling_type", self.pooling_type,
                   f"one of {list(POOLING_TYPES)} (ALL and STEP pool per token, which "
                   "tokenmill does not run)")  # fmt: skip
        _check(self.normalize is None or isinstance(self.normalize, bool),
               "pooler_config.normalize", self.normalize, "true, false or null")  # fmt: skip
        dims = self.dimensions
        _check(dims is None or (isinstance(dims, int) and dims >= 1), "pooler_config.dimensions",
               dims, "a positive integer or null")  # fmt: skip

    @staticmethod
    def from_user(value: Any) -> PoolerConfig | None:
        """From `LLM(pooler_config=...)`: a PoolerConfig, a dict of vLLM's keys or its JSON."""
        if value is None or isinstance(value, PoolerConfig):
            return value
        if isinstance(value, str):
            value = json.loads(value)
        _check(isinstance(value, dict), "pooler_config", value, "a dict of vLLM's keys")
        known = {f.name for f in dataclasses.fields(PoolerConfig)}
        unknown = sorted(set(value) - known)
        _check(not unknown, "pooler_config", unknown, f"keys among {sorted(known)}")
        return PoolerConfig(**value)


@dataclass(frozen=True)
class ModelConfig:
    """The model: where it lives, how it runs, and its architecture as config.json gives it.

    config.json is read here and nowhere else. The fields below are what the engine as a whole
    needs; `hf_text_config` keeps config.json's text part as read, from which each model
    family parses its own fields in its model file (worker/models/)."""

    model: str  # local folder with config.json + weights
    tokenizer: str
    dtype: str  # "float32" | "float16" | "bfloat16"
    seed: int
    max_model_len: int
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    # rope_type ("default", "linear", "llama3"), rope_theta and the type's own parameters.
    rope_parameters: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0}
    )
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v and o (Qwen2's q/k/v bias is its class's)
    mlp_bias: bool = False
    # Sliding-window attention: every layer's kind ("full_attention" or
    # "sliding_attention"; empty: all full) and the window of the sliding ones. Mistral's
    # window covers every layer; Gemma 2 alternates; Gemma 3 has 5 local to 1 global.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    # The rope of the sliding layers where it differs from `rope_parameters` (Gemma 3's
    # local base frequency).
    sliding_rope_parameters: dict[str, Any] | None = None
    # config.json's text config (its `text_config` where it has one), as read: plain JSON
    # data, so that it crosses to worker processes with the rest of the config.
    hf_text_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    # How the checkpoint's weights are stored and run: None (as the dtype says) or "gguf"
    # (llama.cpp's block formats, from the folder's model.gguf; worker/layers/quantization/).
    quantization: str | None = None
    skip_tokenizer_init: bool = False
    max_logprobs: int = 20  # the most logprobs / prompt_logprobs a request may ask for; -1: no cap
    # Sampling defaults from the model's generation_config.json (--generation-config), used
    # where a request leaves a field out: vLLM's names (max_new_tokens -> max_tokens).
    sampling_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    # What the model runs for (vLLM's names): "generate" (sampling tokens) or "pooling" (one
    # vector per prompt, pooled from the final norm's hidden states); how a *ForCausalLM
    # checkpoint became a pooling model ("embed": its LM head dropped; "none" when generating),
    # and the pooling it does (None when generating).
    runner_type: str = "generate"
    convert_type: str = "none"
    pooler_config: PoolerConfig | None = None

    @property
    def matryoshka_dimensions(self) -> list[int] | None:
        """The output sizes a Matryoshka embedding model was trained for (config.json's
        `matryoshka_dimensions`, as vLLM reads it); None: any size, where `is_matryoshka`."""
        dims = self.hf_text_config.get("matryoshka_dimensions")
        return list(dims) if dims else None

    @property
    def is_matryoshka(self) -> bool:
        """Whether an embedding may be cut to fewer dimensions (PoolingParams.dimensions)."""
        return bool(self.matryoshka_dimensions) or bool(self.hf_text_config.get("is_matryoshka"))

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    @property
    def long_rope_threshold(self) -> int | None:
        """LongRoPE's original context (Phi-3), past which the long factors apply."""
        if self.rope_parameters.get("rope_type") not in ("longrope", "su"):
            return None
        return int(self.rope_parameters["original_max_position_embeddings"])

    def window_of(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None: it attends to the whole context)."""
        return self.sliding_window if self.is_sliding(layer) else None

    @property
    def kv_lookback(self) -> int | None:
        """How many tokens back (the query's own included) the farthest-seeing layer
        attends: the window where every layer slides (Mistral), None where any layer sees
        the whole context (Gemma's global layers). Older keys are never read again."""
        windows = [self.window_of(layer) for layer in range(self.num_hidden_layers)]
        if not windows or None in windows:
            return None
        return max(w for w in windows if w is not None)


# kv_cache_dtype's values (the element type: worker/attention/base.py's cache_torch_dtype).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    # "auto": the model's dtype; "fp8" / "fp8_e4m3" (vLLM's names): fp8 e4m3, 1 byte a value.
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        _check(self.block_size > 0, "block_size", self.block_size, "a positive integer")
        _check(self.cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", self.cache_dtype,
               f"one of {list(KV_CACHE_DTYPES)} (fp8_e5m2 is not built)")  # fmt: skip
        _check(
            0.0 < self.gpu_memory_utilization <= 1.0,
            "gpu_memory_utilization",
            self.gpu_memory_utilization,
            "in (0, 1]",
        )
        if self.kv_cache_memory_bytes is not None:
            _check(
                self.kv_cache_memory_bytes > 0,
                "kv_cache_memory_bytes",
                self.kv_cache_memory_bytes,
                "a positive number of bytes",
            )
        if self.num_gpu_blocks_override is not None:
            _check(
                self.num_gpu_blocks_override > 1,
                "num_gpu_blocks_override",
                self.num_gpu_blocks_override,
                "an integer > 1 (block 0 is reserved as the null block)",
            )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: no cap on one request's chunk
    policy: str = "fcfs"  # "fcfs" | "priority"
    # Schedule step N+1 while step N runs (EngineCore keeps two steps in flight).
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        _check(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "at least 1")
        _check(
            self.policy in ("fcfs", "priority"),
            "scheduling_policy",
            self.policy,
            '"fcfs" or "priority"',
        )
        _check(
            self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            "at least 1",
        )
        _check(
            self.long_prefill_token_threshold >= 0,
            "long_prefill_token_threshold",
            self.long_prefill_token_threshold,
            ">= 0",
        )


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism inside one engine core (its workers), and data parallelism across
    engine cores behind one frontend (each DP rank a whole engine with its own TP group).

    data_parallel_size_local: the DP ranks the frontend starts itself (default: all); the
    others are headless `engine-core` daemons on other hosts that join through
    data_parallel_address:data_parallel_rpc_port. data_parallel_routing: "prefix" sends a
    request to the rank that already holds most of its prompt's blocks unless that rank's
    load exceeds the least loaded one's by more than data_parallel_prefix_margin; "load"
    routes by load alone (vLLM's). data_parallel_rank: which rank this engine core is (set
    by whoever starts it; it names the rank in logs and in the frontend's handshake)."""

    tensor_parallel_size: int = 1
    # None | "uni" | "mp" | "ray" | "external_launcher"
    distributed_executor_backend: str | None = None
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None  # None: all of them
    data_parallel_backend: str = "mp"  # "mp" (processes here) | "ray" (actors on a cluster)
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int = 0  # 0: none (every rank is local)
    data_parallel_routing: str = "prefix"
    # Measured (scripts/bench_data_parallel.py, DP=2, concurrency 16): 8 keeps too little
    # of the prefix benefit (74.9% hits against 82.4% at 32); without a bound one hot prefix
    # sends every request to one rank (half the throughput); 32 keeps both.
    data_parallel_prefix_margin: int = 32
    data_parallel_rank: int = 0

    def __post_init__(self) -> None:
        _check(
            self.tensor_parallel_size >= 1,
            "tensor_parallel_size",
            self.tensor_parallel_size,
            "at least 1",
        )
        backends = (None, "uni", "mp", "ray", "external_launcher")
        _check(
            self.distributed_executor_backend in backends,
            "distributed_executor_backend",
            self.distributed_executor_backend,
            f"one of {backends}",
        )
        dp = self.data_parallel_size
        _check(dp >= 1, "data_parallel_size", dp, "at least 1")
        local = self.data_parallel_size_local
        _check(local is None or 0 <= local <= dp, "data_parallel_size_local", local,
               f"between 0 and data_parallel_size ({dp})")  # fmt: skip
        _check(self.data_parallel_backend in ("mp", "ray"), "data_parallel_backend",
               self.data_parallel_backend, '"mp" or "ray"')  # fmt: skip
        _check(self.data_parallel_routing in ("prefix", "load"), "data_parallel_routing",
               self.data_parallel_routing, '"prefix" or "load"')  # fmt: skip
        _check(self.data_parallel_prefix_margin >= 0, "data_parallel_prefix_margin",
               self.data_parallel_prefix_margin, "at least 0")  # fmt: skip
        _check(0 <= self.data_parallel_rpc_port < 65536, "data_parallel_rpc_port",
               self.data_parallel_rpc_port, "a port number (0: none)")  # fmt: skip
        remote = dp - (dp if local is None else local)  # headless ranks join (not with Ray)
        why = f"the port headless ranks join on ({remote} of {dp} ranks are not local)"
        _check(remote == 0 or self.data_parallel_rpc_port > 0, "data_parallel_rpc_port",
               self.data_parallel_rpc_port, why)  # fmt: skip
        _check(0 <= self.data_parallel_rank < dp, "data_parallel_rank", self.data_parallel_rank,
               f"below data_parallel_size ({dp})")  # fmt: skip
        if self.data_parallel_backend == "ray":
            _check(local is None or local == dp, "data_parallel_size_local", local,
                   "unset with data_parallel_backend='ray' (Ray places every rank)")  # fmt: skip

    @property
    def num_local_dp_ranks(self) -> int:
        """DP ranks sharing this host's cores and RAM (a frontend's own, or a headless
        host's); with Ray each rank has what Ray reserved for it."""
        if self.data_parallel_backend == "ray":
            return 1
        if self.data_parallel_size_local is None:
            return self.data_parallel_size
        return self.data_parallel_size_local


ATTENTION_BACKENDS = ("TORCH_SDPA", "TRITON_ATTN", "CPU_ATTN")  # vLLM's names


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "cpu"  # resolved: "cpu" or "cuda"
    # Resolved: "TRITON_ATTN" (Triton attention and layers; the CUDA default), "CPU_ATTN"
    # (tokenmill's CPU kernels; the CPU default, TORCH_SDPA where they cannot be built) or
    # "TORCH_SDPA" (pure torch: the reference). Triton on the CPU runs in its interpreter: for
    # tests.
    attention_backend: str = "TORCH_SDPA"
    enforce_eager: bool = False  # no CUDA graphs
    cudagraph_capture_sizes: tuple[int, ...] = ()  # decode batch sizes captured (CUDA)


@dataclass(frozen=True)
class LoadConfig:
    load_format: Literal["auto", "dummy"] = "auto"


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, under vLLM's `speculative_config` keys. Each step a request is
    given up to `num_speculative_tokens` proposed tokens, which the target model verifies in
    one forward (1 + k tokens) and the rejection sampler accepts or replaces.

    ngram: the proposal continues the latest earlier occurrence of the longest suffix of the
    request's tokens (prompt and output) of `prompt_lookup_min` to `prompt_lookup_max`
    tokens (one given: the other takes its value; neither: both 5, as vLLM).
    draft_model: a smaller model with the target's tokenizer proposes (`model`).
    `disable_by_batch_size`: steps with more running requests than this do not speculate
    (vLLM's key; None: no such limit).
    `auto_disable` (tokenmill's): the scheduler measures output tokens per second with and
    without speculation, per batch size, and runs without where that is faster (see
    core/sched/spec_governor.py); False: speculate on every step allowed."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = None
    auto_disable: bool = True
    # draft_model: the draft's config, filled in by EngineArgs.create_engine_config.
    draft_model_config: ModelConfig | None = None

    def __post_init__(self) -> None:
        name = "speculative_config"
        _check(self.method in SPECULATIVE_METHODS, f"{name}.method", self.method,
               f"one of {SPECULATIVE_METHODS}")  # fmt: skip
        k = self.num_speculative_tokens
        _check(isinstance(k, int) and k >= 1, f"{name}.num_speculative_tokens", k, "an int >= 1")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        low, high = (low or high or 5), (high or low or 5)
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)
        _check(low >= 1, f"{name}.prompt_lookup_min", low, "at least 1")
        _check(high >= low, f"{name}.prompt_lookup_max", high, f">= prompt_lookup_min ({low})")
        if self.method == "draft_model":
            _check(bool(self.model), f"{name}.model", self.model, "a draft model folder")
        if self.disable_by_batch_size is not None:
            _check(self.disable_by_batch_size >= 1, f"{name}.disable_by_batch_size",
                   self.disable_by_batch_size, "at least 1 (or None)")  # fmt: skip
        _check(isinstance(self.auto_disable, bool), f"{name}.auto_disable", self.auto_disable,
               "true or false")  # fmt: skip

    @staticmethod
    def from_user(value: Any) -> SpeculativeConfig | None:
        """From `LLM(speculative_config=...)`: a dict (or JSON text) of vLLM's keys."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            value = json.loads(value)
        _check(isinstance(value, dict), "speculative_config", value, "a dict of vLLM's keys")
        known = {f.name for f in dataclasses.fields(SpeculativeConfig)} - {"draft_model_config"}
        unknown = sorted(set(value) - known)
        _check(not unknown, "speculative_config", unknown, f"keys among {sorted(known)}")
        return SpeculativeConfig(**value)


@dataclass(frozen=True)
class EngineConfig:
    """The bus: one object that every engine-side constructor receives."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    load_config: LoadConfig
    speculative_config: SpeculativeConfig | None = None
    lora_config: LoRAConfig | None = None  # None: LoRA off
    batch_invariant: bool = False  # see kernels/batch_invariant.py

    def with_max_model_len(self, max_model_len: int) -> EngineConfig:
        model_config = dataclasses.replace(self.model_config, max_model_len=max_model_len)
        return dataclasses.replace(self, model_config=model_config)

    @property
    def kv_lookback(self) -> int | None:
        """How far back a request's KV blocks are still read, where blocks behind that go
        back to the pool as it runs (ModelConfig.kv_lookback); None: every block is kept. Not
        with a draft model: it shares the block tables, and its layers may see the whole
        context."""
        spec = self.speculative_config
        if spec is not None and spec.method == "draft_model":
            return None
        return self.model_config.kv_lookback


@dataclass
class EngineArgs:
    """The user's arguments, under vLLM's names (`LLM(**kwargs)` builds one)."""

    model: str | None = None
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    max_logprobs: int = 20
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None  # None: the model's own limit; -1: fit the KV cache
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    async_scheduling: bool | None = None  # None: on with CUDA, off on the CPU (see README)
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None
    data_parallel_backend: str = "mp"
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int = 0
    data_parallel_routing: str = "prefix"
    data_parallel_prefix_margin: int = 32
    load_format: str = "auto"
    quantization: str | None = None  # None: "gguf" for a GGUF model, else none
    device: str = "auto"
    attention_backend: str | None = None  # None: the device's (protocol/device_defaults.py)
    enforce_eager: bool = False
    cudagraph_capture_sizes: list[int] | None = None  # None: 1, 2, 4, 8, 16, 24, ... max_num_seqs
    generation_config: str = "auto"  # "auto" (the model's file) | "vllm" (none) | a folder
    speculative_config: dict | None = None  # vLLM's keys; see SpeculativeConfig
    runner: str = "auto"  # "auto" | "generate" | "pooling" (vLLM's)
    convert: str = "auto"  # "auto" | "none" | "embed": a *ForCausalLM model as an embedder
    pooler_config: dict | None = None  # vLLM's keys; see PoolerConfig
    enable_lora: bool = False  # LoRA adapters (LoRARequest); see LoRAConfig for the three below
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"  # the slots' dtype: "auto" (the model's, the only one taken)
    # A request's logits independent of its batch (kernels/batch_invariant.py); None: the
    # TOKENMILL_BATCH_INVARIANT variable's setting.
    batch_invariant: bool | None = None

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def create_engine_config(self) -> EngineConfig:
        device = resolve_device(self.device)
        defaults = device_defaults(device)
        model_path = resolve_model(self.model)
        hf = json.loads((Path(model_path) / "config.json").read_text())
        model_config = _with_runner(self, _model_config(self, model_path, hf, defaults))
        pooling = model_config.runner_type == "pooling"
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = 2048 if self.enable_chunked_prefill else max(2048, model_config.max_model_len)
        if not self.enable_chunked_prefill and model_config.max_model_len > 0:
            _check(
                batched >= model_config.max_model_len,
                "max_num_batched_tokens",
                batched,
                f">= max_model_len ({model_config.max_model_len}) when chunked prefill is off",
            )
        _check(
            self.load_format in ("auto", "dummy"),
            "load_format",
            self.load_format,
            '"auto" or "dummy"',
        )
        device_config = _device_config(self, defaults, pooling)
        invariant = _batch_invariant(self)
        if invariant and device_config.attention_backend == "TORCH_SDPA":
            raise ValueError(
                "batch_invariant=True needs attention_backend CPU_ATTN (tokenmill's CPU "
                "kernels) or TRITON_ATTN; TORCH_SDPA's attention is not batch-invariant"
            )
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching
                and _prefix_caching_pools(model_config),
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                cache_dtype=self.kv_cache_dtype,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=batched,
                enable_chunked_prefill=self.enable_chunked_prefill,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                policy=self.scheduling_policy,
                async_scheduling=_async_scheduling(self, defaults, pooling),
            ),
            parallel_config=_parallel_config(self, model_config),
            device_config=device_config,
            load_config=LoadConfig(load_format=self.load_format),  # type: ignore[arg-type]
            speculative_config=_speculative_config(self, model_config, defaults),
            lora_config=_lora_config(self, model_config),
            batch_invariant=invariant,
        )


def _batch_invariant(args: EngineArgs) -> bool:
    if args.batch_invariant is not None:
        return args.batch_invariant
    return envs.TOKENMILL_BATCH_INVARIANT


def _lora_config(args: EngineArgs, model: ModelConfig) -> LoRAConfig | None:
    if not args.enable_lora:
        return None
    lora_dtype = str(args.lora_dtype).removeprefix("torch.")  # a torch.dtype too, as vLLM
    if lora_dtype != "auto" and _DTYPES.get(lora_dtype) != model.dtype:
        # The kernels multiply an adapter in the activations' dtype (vLLM's default too).
        raise ValueError(
            f"lora_dtype={args.lora_dtype!r} is not supported: adapters run in the model's "
            f"dtype ({model.dtype}); use 'auto'"
        )
    return LoRAConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras)


def _speculative_config(
    args: EngineArgs, target: ModelConfig, defaults: DeviceDefaults
) -> SpeculativeConfig | None:
    """The user's speculative_config; for a draft model, with the draft's config, which must
    share the target's vocabulary and reach its max_model_len."""
    spec = SpeculativeConfig.from_user(args.speculative_config)
    if spec is not None and target.runner_type == "pooling":
        raise ValueError(
            "speculative_config is for generative models: a pooling model (runner='pooling') "
            "samples no tokens to speculate on"
        )
    if spec is None or spec.method != "draft_model":
        return spec
    assert spec.model is not None
    path = resolve_model(spec.model)
    hf = json.loads((Path(path) / "config.json").read_text())
    draft_args = dataclasses.replace(args, max_model_len=None, tokenizer=target.tokenizer)
    draft = _model_config(draft_args, path, hf, defaults)
    draft = dataclasses.replace(draft, dtype=target.dtype)
    _check(draft.vocab_size == target.vocab_size, "speculative_config.model", spec.model,
           f"a model with the target's vocabulary ({target.vocab_size} tokens, not "
           f"{draft.vocab_size})")  # fmt: skip
    _check(target.max_model_len <= draft.max_position_embeddings, "speculative_config.model",
           spec.model, f"a model reaching max_model_len ({target.max_model_len}; it has "
           f"{draft.max_position_embeddings} positions)")  # fmt: skip
    return dataclasses.replace(spec, model=path, draft_model_config=draft)


def _async_scheduling(args: EngineArgs, defaults: DeviceDefaults, pooling: bool) -> bool:
    """On by default where the device's forward leaves the host free (`overlaps_steps` of
    protocol/device_defaults.py: CUDA). With speculative decoding the steps that propose or
    verify tokens are not overlapped (see EngineCore). A pooling model's steps run in turn:
    each request ends with the step of its last prompt chunk, so there is no next token for
    a step to be scheduled ahead of."""
    if args.async_scheduling is None:
        return defaults.overlaps_steps and not pooling
    _check(isinstance(args.async_scheduling, bool), "async_scheduling", args.async_scheduling,
           "True, False or None")  # fmt: skip
    _check(not (pooling and args.async_scheduling), "async_scheduling", args.async_scheduling,
           "off (or unset) for a pooling model (runner='pooling')")  # fmt: skip
    return args.async_scheduling


def _with_runner(args: EngineArgs, model: ModelConfig) -> ModelConfig:
    """The model's runner and pooling as vLLM resolves them. runner="auto" pools where the
    folder holds a sentence-transformers pooling module (Qwen3-Embedding's modules.json:
    some embedding models keep a *ForCausalLM architecture), else generates, as every
    architecture here is a causal LM; pooling such a model converts it ("embed"). The pooler
    settings: --pooler-config first, then the sentence-transformers files, then vLLM's
    defaults for "embed" (LAST, normalized)."""
    _check(args.runner in RUNNER_TYPES, "runner", args.runner, f"one of {list(RUNNER_TYPES)}")
    _check(args.convert in CONVERT_TYPES, "convert", args.convert,
           f"one of {list(CONVERT_TYPES)} (tokenmill converts a causal LM to an embedder "
           "only)")  # fmt: skip
    user = PoolerConfig.from_user(args.pooler_config)
    found = sentence_transformers_pooling(model.model)
    runner = args.runner
    if runner == "auto":
        runner = "pooling" if found is not None or args.convert == "embed" else "generate"
    if runner == "generate":
        _check(args.convert in ("auto", "none"), "convert", args.convert,
               "'auto' or 'none' with runner='generate' ('embed' pools)")  # fmt: skip
        _check(user is None, "pooler_config", args.pooler_config,
               "unset for a generative model (runner='generate')")  # fmt: skip
        return model
    _check(args.convert in ("auto", "embed"), "convert", args.convert,
           f"'auto' or 'embed' for {model.architecture} with runner='pooling' (a causal LM "
           "pools only once converted)")  # fmt: skip
    user = user or PoolerConfig()
    found = found or PoolerConfig()
    pooler = PoolerConfig(
        pooling_type=user.pooling_type or found.pooling_type or "LAST",
        normalize=_first_set(user.normalize, found.normalize, True),
        dimensions=user.dimensions,
    )
    model = dataclasses.replace(
        model, runner_type="pooling", convert_type="embed", pooler_config=pooler
    )
    if pooler.dimensions is not None:
        check_dimensions(model, pooler.dimensions, "pooler_config.dimensions")
    return model


def _first_set(*values: Any) -> Any:
    return next(v for v in values if v is not None)


def check_dimensions(model: ModelConfig, dimensions: int, name: str = "dimensions") -> None:
    """An embedding cut to `dimensions`, as vLLM allows it (with its messages): only for a
    Matryoshka model, and then to one of its trained sizes where config.json lists them."""
    label = Path(model.model).name
    if not model.is_matryoshka:
        raise ValueError(
            f'Model "{label}" does not support matryoshka representation, changing output '
            "dimensions will lead to poor results."
        )
    if not isinstance(dimensions, int) or dimensions < 1:
        raise ValueError(f"{name}: Dimensions must be greater than 0, got {dimensions!r}")
    sizes = model.matryoshka_dimensions
    if sizes is not None and dimensions not in sizes:
        raise ValueError(
            f'Model "{label}" only supports {sizes} matryoshka dimensions, use other output '
            "dimensions will lead to poor results."
        )
    _check(dimensions <= model.hidden_size, name, dimensions,
           f"at most the model's hidden size ({model.hidden_size})")  # fmt: skip


# sentence-transformers' pooling modes (1_Pooling/config.json) -> vLLM's pooling types.
_ST_POOLING_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


def sentence_transformers_pooling(path: str) -> PoolerConfig | None:
    """The pooling a sentence-transformers model folder declares (vLLM's get_pooling_config):
    modules.json lists its modules, a Normalize module means normalized outputs, and the
    Pooling module's config.json sets one pooling_mode_* true. None: no modules.json."""
    modules_file = Path(path) / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    normalize = any(m.get("type") == _ST_NORMALIZE for m in modules)
    pooling = next((m for m in modules if m.get("type") == _ST_POOLING), None)
    kind = None
    if pooling is not None:
        pooling_file = Path(path) / pooling.get("path", "") / "config.json"
        modes = json.loads(pooling_file.read_text()) if pooling_file.is_file() else {}
        chosen = [mode for mode, on in modes.items() if mode.startswith("pooling_mode") and on]
        if chosen:
            kind = _ST_POOLING_MODES.get(chosen[0])
            if kind is None:
                raise ValueError(
                    f"{pooling_file}: {chosen[0]} is not supported (tokenmill pools with "
                    f"{sorted(_ST_POOLING_MODES)}); pass pooler_config to choose another"
                )
    return PoolerConfig(pooling_type=kind, normalize=normalize)


def _prefix_caching_pools(model: ModelConfig) -> bool:
    """Whether prefix caching may stay on: not for MEAN or CLS pooling, which need the hidden
    states of every prompt token (or the first), and a cached block's are not kept (vLLM
    turns it off likewise for pooling other than LAST)."""
    pooler = model.pooler_config
    if pooler is None or pooler.pooling_type == "LAST":
        return True
    logger.info("prefix caching is off: %s pooling needs every prompt token's hidden "
                "state", pooler.pooling_type)  # fmt: skip
    return False


def _parallel_config(args: EngineArgs, model: ModelConfig) -> ParallelConfig:
    """Checks, before any worker starts, that the model splits across the ranks: query heads
    evenly; KV heads evenly, or whole heads replicated when there are fewer than ranks."""
    parallel = ParallelConfig(
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        data_parallel_size=args.data_parallel_size,
        data_parallel_size_local=args.data_parallel_size_local,
        data_parallel_backend=args.data_parallel_backend,
        data_parallel_address=args.data_parallel_address,
        data_parallel_rpc_port=args.data_parallel_rpc_port,
        data_parallel_routing=args.data_parallel_routing,
        data_parallel_prefix_margin=args.data_parallel_prefix_margin,
    )
    tp = parallel.tensor_parallel_size
    heads, kv_heads = model.num_attention_heads, model.num_kv_heads
    _check(
        heads % tp == 0,
        "tensor_parallel_size",
        tp,
        f"a divisor of the model's {heads} attention heads",
    )
    _check(
        kv_heads % tp == 0 if kv_heads >= tp else tp % kv_heads == 0,
        "tensor_parallel_size",
        tp,
        f"a divisor or a multiple of the model's {kv_heads} KV heads",
    )
    return parallel


def _device_config(args: EngineArgs, defaults: DeviceDefaults, pooling: bool) -> DeviceConfig:
    device = defaults.device_type
    backend = args.attention_backend
    if backend is None:
        backend = defaults.default_attention_backend()
    known = isinstance(backend, str) and backend.upper() in ATTENTION_BACKENDS
    expected = f"None or one of {list(ATTENTION_BACKENDS)}"
    _check(known, "attention_backend", args.attention_backend, expected)
    backend = backend.upper()
    if backend == "TRITON_ATTN" and not has_triton():
        raise ValueError("attention_backend='TRITON_ATTN' needs triton (pip install triton)")
    if backend == "CPU_ATTN" and device != "cpu":
        raise ValueError(f"attention_backend='CPU_ATTN' runs on the CPU, not on {device}")
    sizes = args.cudagraph_capture_sizes
    if sizes is None:
        # vLLM's default ladder: 1, 2, 4, then every 8 up to the largest decode batch.
        limit = args.max_num_seqs
        sizes = [s for s in (1, 2, 4) if s < limit] + list(range(8, limit + 8, 8))
        sizes = sorted({min(s, limit) for s in sizes})
    for size in sizes:
        _check(isinstance(size, int) and size > 0, "cudagraph_capture_sizes", sizes,
               "positive batch sizes")  # fmt: skip
    return DeviceConfig(
        device=device,
        attention_backend=backend,
        # A pooling model's steps are prompt chunks: no decode step to capture.
        enforce_eager=args.enforce_eager or pooling,
        cudagraph_capture_sizes=tuple(sorted(set(sizes))),
    )


def resolve_device(device: str) -> str:
    _check(device in ("auto", "cpu", "cuda"), "device", device, '"auto", "cpu" or "cuda"')
    if device != "auto":
        return device
    if not _may_have_cuda():
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _may_have_cuda() -> bool:
    """False where torch cannot see a GPU: on Linux, no NVIDIA driver device node (nor WSL's
    GPU node). Spares the frontend importing torch (1-2 s of start-up) on a CPU machine."""
    if sys.platform != "linux":
        return True
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg"))


def _resolve_dtype(dtype: str, hf: dict[str, Any], defaults: DeviceDefaults) -> str:
    if dtype == "auto":
        declared = hf.get("dtype") or hf.get("torch_dtype")
        return defaults.auto_dtype(_DTYPES.get(declared, "bfloat16"))
    _check(dtype in _DTYPES, "dtype", dtype, f'"auto" or one of {sorted(_DTYPES)}')
    return _DTYPES[dtype]


def _model_config(
    args: EngineArgs, path: str, hf: dict[str, Any], defaults: DeviceDefaults
) -> ModelConfig:
    text = hf.get("text_config", hf)
    architectures = hf.get("architectures") or []
    if not architectures:
        raise ValueError(f"{path}/config.json names no `architectures`")
    check_architecture(architectures[0], path)
    heads = text["num_attention_heads"]
    hidden = text["hidden_size"]
    max_pos = int(text.get("max_position_embeddings", 2048))
    max_len = args.max_model_len
    if max_len is None:
        max_len = max_pos
    elif max_len != -1:
        _check(max_len >= 1, "max_model_len", max_len, "a positive integer or -1 (auto-fit)")
        _check(
            max_len <= max_pos,
            "max_model_len",
            max_len,
            f"<= the model's max_position_embeddings ({max_pos})",
        )
    _check(args.seed >= 0, "seed", args.seed, "a non-negative integer")
    layer_types, window = _sliding_layers(text)
    rope, sliding_rope = _rope_parameters(text)
    return ModelConfig(
        model=path,
        tokenizer=resolve_model(args.tokenizer) if args.tokenizer else path,
        dtype=_resolve_dtype(args.dtype, hf, defaults),
        seed=args.seed,
        max_model_len=max_len,
        architecture=architectures[0],
        vocab_size=text["vocab_size"],
        hidden_size=hidden,
        intermediate_size=text["intermediate_size"],
        num_hidden_layers=text["num_hidden_layers"],
        num_attention_heads=heads,
        num_kv_heads=text.get("num_key_value_heads") or heads,
        head_size=text.get("head_dim") or hidden // heads,
        max_position_embeddings=max_pos,
        eos_token_ids=_eos_token_ids(Path(path), text),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        # (Gemma names it hidden_activation)
        hidden_act=text.get("hidden_activation") or text.get("hidden_act", "silu"),
        rope_parameters=rope,
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        attention_bias=bool(text.get("attention_bias", False)),
        mlp_bias=bool(text.get("mlp_bias", False)),
        layer_types=layer_types,
        sliding_window=window,
        sliding_rope_parameters=sliding_rope,
        hf_text_config=text,
        skip_tokenizer_init=args.skip_tokenizer_init,
        max_logprobs=args.max_logprobs,
        sampling_defaults=sampling_defaults(args.generation_config, path),
        quantization=_quantization(args.quantization, path, hf),
    )


# The checkpoint formats `quantization` takes (worker/layers/quantization/).
QUANTIZATION_METHODS = ("gguf", "awq", "gptq", "int8")


def _quantization(value: str | None, path: str, hf: dict[str, Any]) -> str | None:
    """The checkpoint's format: "gguf" where the folder holds a GGUF file, "awq" or "gptq"
    as config.json's quantization_config names it (the user may name either); "int8" (W8A8,
    quantized at load) where the user asks it of an unquantized checkpoint."""
    gguf = (Path(path) / "model.gguf").exists()
    _check(value is None or value in QUANTIZATION_METHODS, "quantization", value,
           f"one of {list(QUANTIZATION_METHODS)}")  # fmt: skip
    _check(value != "gguf" or gguf, "quantization", value,
           "a GGUF model (a .gguf file, or a folder made from one)")  # fmt: skip
    _check(not gguf or value in (None, "gguf"), "quantization", value,
           "gguf (or unset) for a GGUF model")  # fmt: skip
    if gguf:
        return "gguf"
    stored = (hf.get("quantization_config") or {}).get("quant_method")
    stored = str(stored).lower() if stored is not None else None
    if value == "int8":
        _check(stored is None, "quantization", value,
               f"unset for a checkpoint already quantized ({stored})")  # fmt: skip
        return value
    if value is not None and stored != value:
        # (vLLM's words)
        raise ValueError(
            f"Quantization method specified in the model config ({stored}) does not match the "
            f"quantization method specified in the `quantization` argument ({value})."
        )
    if stored is not None and stored not in ("awq", "gptq"):
        raise ValueError(f"quantization_config.quant_method {stored!r} is not supported: "
                         f"tokenmill runs {list(QUANTIZATION_METHODS)}")  # fmt: skip
    return stored


# generation_config.json fields that become sampling defaults, by their SamplingParams name.
_GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def sampling_defaults(generation_config: str, model_path: str) -> dict[str, Any]:
    """vLLM's --generation-config: "auto" reads the model's generation_config.json, "vllm"
    ignores it (the engine's own defaults), anything else is a folder holding one."""
    if generation_config == "vllm":
        return {}
    folder = Path(model_path if generation_config == "auto" else generation_config)
    path = folder / "generation_config.json"
    if not path.is_file():
        if generation_config != "auto":
            raise ValueError(
                f"generation_config={generation_config!r} holds no generation_config.json"
            )
        return {}
    data = json.loads(path.read_text())
    return {ours: data[theirs] for theirs, ours in _GENERATION_DEFAULTS.items() if theirs in data}


def _rope_parameters(text: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the rope of full-attention layers, that of sliding ones where it differs).
    Transformers 5 keeps rope settings under `rope_parameters`, per layer kind where they
    differ (Gemma 3); older configs use `rope_theta`, `rope_scaling` and Gemma 3's
    `rope_local_base_freq`."""
    params = dict(text.get("rope_parameters") or {})
    sliding = None
    if "full_attention" in params:
        sliding = _rope_kind(dict(params.get("sliding_attention") or params["full_attention"]))
        params = dict(params["full_attention"])
    elif not params:
        params = dict(text.get("rope_scaling") or {})
        params.setdefault("rope_theta", text.get("rope_theta", 10000.0))
        if text.get("rope_local_base_freq") is not None:
            sliding = {"rope_type": "default", "rope_theta": float(text["rope_local_base_freq"])}
    # (Phi-3 keeps LongRoPE's pre-training length beside the rope settings)
    for name in ("original_max_position_embeddings", "partial_rotary_factor"):
        if text.get(name) is not None:
            params.setdefault(name, text[name])
    return _rope_kind(params), sliding


def _rope_kind(params: dict[str, Any]) -> dict[str, Any]:
    params.setdefault("rope_type", params.pop("type", "default"))
    params["rope_theta"] = float(params.get("rope_theta", 10000.0))
    return params


def _sliding_layers(text: dict[str, Any]) -> tuple[tuple[str, ...], int | None]:
    """(each layer's kind, the sliding window): a window covers every layer unless
    `layer_types` says which (Gemma 2 and 3); `use_sliding_window: false` (Qwen2) or no
    window leaves every layer full."""
    window = text.get("sliding_window")
    if not window or text.get("use_sliding_window") is False:
        return (), None
    kinds = text.get("layer_types")
    if not kinds:
        kinds = ["sliding_attention"] * text["num_hidden_layers"]
    _check(len(kinds) == text["num_hidden_layers"], "layer_types", kinds,
           f"one entry per layer ({text['num_hidden_layers']})")  # fmt: skip
    return tuple(kinds), int(window)


def _eos_token_ids(path: Path, hf: dict[str, Any]) -> tuple[int, ...]:
    # generation_config.json is what HF generate() stops on; config.json is the fallback.
    source: Any = hf.get("eos_token_id")
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        source = json.loads(gen_path.read_text()).get("eos_token_id", source)
    if source is None:
        return ()
    return tuple(source) if isinstance(source, list) else (int(source),)


# What each engine flag does, for --help (vLLM's meanings).
ENGINE_ARG_HELP = {
    "model": "model folder, or the default model's name (SmolLM2-135M-Instruct)",
    "tokenizer": "tokenizer folder (default: the model's)",
    "skip_tokenizer_init": "no tokenizer: prompts are token ids, outputs carry no text",
    "max_logprobs": "the most logprobs / prompt_logprobs a request may ask for; -1: no cap",
    "dtype": "auto, float32, bfloat16 or float16 (auto: bf16 on CUDA, on the CPU where it "
    "has bf16 instructions, else fp32)",
    "seed": "the engine's random seed (requests without a seed draw from it)",
    "max_model_len": "the longest context (prompt + output); default the model's, -1 fits "
    "the KV cache",
    "block_size": "tokens per KV cache block",
    "max_num_seqs": "the most requests running at once",
    "max_num_batched_tokens": "the token budget of one step (default by device)",
    "enable_prefix_caching": "reuse the KV blocks of prompts' shared prefixes",
    "enable_chunked_prefill": "split long prompts across steps, beside running decodes",
    "long_prefill_token_threshold": "a prompt chunk is capped at this many tokens (0: no cap)",
    "scheduling_policy": "fcfs or priority (lower priority values first)",
    "async_scheduling": "schedule step N+1 while step N runs (default: on with CUDA)",
    "num_gpu_blocks_override": "this many KV blocks instead of what memory allows",
    "kv_cache_memory_bytes": "bytes for the KV cache instead of the memory fraction",
    "kv_cache_dtype": "auto (the model's dtype) or fp8 / fp8_e4m3: the KV cache in fp8 e4m3, "
    "twice the tokens per GiB (scales 1.0, as vLLM's without calibrated ones)",
    "gpu_memory_utilization": "fraction of device memory the engine may use",
    "tensor_parallel_size": "ranks the model is sharded across",
    "distributed_executor_backend": "uni, mp, ray (workers as Ray actors, across nodes) or "
    "external_launcher (torchrun)",
    "data_parallel_size": "engine cores (each with its own tensor-parallel workers) behind one "
    "frontend",
    "data_parallel_size_local": "DP ranks started here (default all); the rest are headless "
    "engine-core daemons that join through --data-parallel-address/--data-parallel-rpc-port",
    "data_parallel_backend": "mp (engine-core processes here) or ray (Ray actors placed across "
    "the cluster, restarted when lost)",
    "data_parallel_address": "the host headless DP ranks reach the frontend on",
    "data_parallel_rpc_port": "the port headless DP ranks join on (authenticated unless loopback)",
    "data_parallel_routing": "prefix (to the rank holding most of the prompt's blocks, within "
    "the margin) or load (waiting x 4 + running, as vLLM)",
    "data_parallel_prefix_margin": "how much more loaded (waiting x 4 + running) than the least "
    "loaded rank a prefix-holding rank may be and still get the request",
    "load_format": "auto (the checkpoint) or dummy (random weights)",
    "quantization": "how the checkpoint's weights are stored and run: gguf (automatic for a "
    "GGUF model), awq or gptq (int4; automatic from config.json's quantization_config), int8 "
    "(W8A8: weights quantized per channel at load, activations per token)",
    "device": "auto, cpu or cuda",
    "attention_backend": "TRITON_ATTN, CPU_ATTN or TORCH_SDPA (default by device)",
    "enforce_eager": "no CUDA graphs",
    "cudagraph_capture_sizes": "the batch sizes CUDA graphs are captured for",
    "generation_config": "sampling defaults: auto (the model's generation_config.json), "
    "vllm (none), or a folder holding a generation_config.json",
    "runner": "auto, generate or pooling (auto: pooling where the model folder holds a "
    "sentence-transformers pooling module, else generate)",
    "convert": "auto, none or embed: a causal LM run as an embedding model (its final norm's "
    "hidden states pooled; the default with runner pooling)",
    "pooler_config": 'a pooling model\'s pooling, as JSON: {"pooling_type": "LAST" | "MEAN" | '
    '"CLS", "normalize": true, "dimensions": N} (default: the sentence-transformers files, '
    "else LAST, normalized)",
    "enable_lora": "serve LoRA adapters (PEFT folders) named by requests (LoRARequest) or by "
    "--lora-modules",
    "max_loras": "LoRA adapters in device slots: the most distinct adapters one step runs",
    "max_lora_rank": "the LoRA slots' rank; an adapter of a higher rank is refused",
    "max_cpu_loras": "LoRA adapters kept read in host memory (default: max_loras)",
    "lora_dtype": "the LoRA slots' dtype: auto (the model's dtype; the only one taken)",
    "batch_invariant": "every request's logits the same bits whatever runs beside it (fixed "
    "reduction orders in every kernel; default: TOKENMILL_BATCH_INVARIANT)",
    "speculative_config": 'speculative decoding, as JSON: {"method": "ngram", '
    '"num_speculative_tokens": 3, "prompt_lookup_max": 4} or {"method": "draft_model", '
    '"model": FOLDER, "num_speculative_tokens": 3}',
}


class _BooleanFlag(argparse.Action):
    """`--flag` (true), `--flag VALUE` (true/false/1/0/...) and `--no-flag` (false), as vLLM
    spells its boolean engine arguments."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        negated = [f"--no-{s[2:]}" for s in option_strings if s.startswith("--")]
        super().__init__([*option_strings, *negated], dest, nargs="?", **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        if option is not None and option.startswith("--no-"):
            if values is not None:
                parser.error(f"{option} takes no value")
            setattr(namespace, self.dest, False)
        elif values is None:
            setattr(namespace, self.dest, True)
        else:
            try:
                setattr(namespace, self.dest, _parse_bool(values))
            except argparse.ArgumentTypeError as e:
                parser.error(f"{option}: {e}")


def add_engine_args(parser: Any) -> None:
    """Adds every EngineArgs field to an argparse parser as a flag (`--max-model-len`, ...):
    one definition for `LLM(...)`, the engine-core daemon and the server."""
    import typing

    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        members = typing.get_args(hint) or (hint,)
        lists = [m for m in members if typing.get_origin(m) is list]
        helptext = ENGINE_ARG_HELP[f.name] + f" (default: {f.default})"
        if hint is bool or bool in members:  # bool | None: unset means the default
            parser.add_argument(
                flag, action=_BooleanFlag, default=f.default, metavar="BOOL", help=helptext
            )
        elif dict in members:  # JSON text
            parser.add_argument(flag, type=json.loads, default=f.default, help=helptext)
        elif lists:  # list[int]: space-separated values
            (item,) = typing.get_args(lists[0])
            parser.add_argument(flag, type=item, nargs="+", default=f.default, help=helptext)
        else:
            kind = int if int in members else float if float in members else str
            parser.add_argument(flag, type=kind, default=f.default, help=helptext)


def engine_args_from(namespace: Any) -> EngineArgs:
    """EngineArgs from a namespace parsed with add_engine_args."""
    return EngineArgs(
        **{f.name: getattr(namespace, f.name) for f in dataclasses.fields(EngineArgs)}
    )


def _parse_bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")
