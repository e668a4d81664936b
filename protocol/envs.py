"""The one typed registry of tokenmill's environment variables (all prefixed `TOKENMILL_`).

Read lazily through attribute access (`envs.TOKENMILL_CACHE`) so tests can set variables at
run time. Nothing else in the project reads `os.environ` for a tokenmill setting.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable


def _bool(name: str, default: bool) -> Callable[[], bool]:
    def read() -> bool:
        value = os.environ.get(name)
        if value is None or value == "":
            return default
        return value.strip().lower() in ("1", "true", "yes", "on")

    return read


def _optional_bool(name: str) -> Callable[[], bool | None]:
    def read() -> bool | None:
        value = os.environ.get(name)
        return None if value is None or value == "" else _bool(name, False)()

    return read


def _float(name: str, default: float) -> Callable[[], float]:
    return lambda: float(os.environ.get(name) or default)


def _cache_dir() -> Path:
    value = os.environ.get("TOKENMILL_CACHE")
    if value:
        return Path(value).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "tokenmill"


_REGISTRY: dict[str, Callable[[], Any]] = {
    # Where converted models live (the default model is converted here once).
    "TOKENMILL_CACHE": _cache_dir,
    # 0 runs EngineCore in the caller's process (InprocClient) instead of a spawned one.
    "TOKENMILL_MULTIPROC": _bool("TOKENMILL_MULTIPROC", True),
    # The token a client presents to (and a daemon demands from) tcp peers.
    "TOKENMILL_AUTH_TOKEN": lambda: os.environ.get("TOKENMILL_AUTH_TOKEN", ""),
    # The key `tokenmill serve` demands from HTTP clients when --api-key is not given.
    "TOKENMILL_API_KEY": lambda: os.environ.get("TOKENMILL_API_KEY", ""),
    # 1 lets clients of `tokenmill serve` load and unload LoRA adapters at run time
    # (/v1/load_lora_adapter, /v1/unload_lora_adapter: vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING).
    # Off by default: any client could then read a folder of the server's machine.
    "TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING": _bool("TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING", False),
    # The KV cache on the CPU when no explicit kv_cache_memory_bytes is set: this many GiB
    # (vLLM's VLLM_CPU_KVCACHE_SPACE default), at most TOKENMILL_CPU_KV_FRACTION of the
    # available RAM. 4 GiB holds 93k tokens of SmolLM2 in fp32 (186k in bf16).
    "TOKENMILL_CPU_KVCACHE_SPACE": _float("TOKENMILL_CPU_KVCACHE_SPACE", 4.0),
    "TOKENMILL_CPU_KV_FRACTION": _float("TOKENMILL_CPU_KV_FRACTION", 0.25),
    # 0 leaves glibc malloc's defaults alone on the CPU (see worker/platform.py, keep_freed_memory).
    "TOKENMILL_CPU_MALLOC_TUNING": _bool("TOKENMILL_CPU_MALLOC_TUNING", True),
    # Seconds between the engine's one-line stats summaries while busy.
    "TOKENMILL_LOG_STATS_INTERVAL": _float("TOKENMILL_LOG_STATS_INTERVAL", 5.0),
    # 1 times every step's stages (schedule, prepare, forward, logits, sample, update, output; the
    # device is synchronized around the forward) and reports the sums in get_stats()
    # under "step_time_s". Off by default: the synchronization costs overlap on a GPU.
    "TOKENMILL_STEP_TIMING": _bool("TOKENMILL_STEP_TIMING", False),
    # With async scheduling, whether the workers also overlap their steps: each step prepared
    # on the worker's thread while the step before runs its forward and sampling on the
    # runner's device thread. Unset: on with CUDA only (on the CPU the forward needs every
    # core); 1 forces it on the CPU too (tests; the fake-model benchmark, whose forward
    # leaves the CPU free as a GPU's does).
    "TOKENMILL_OVERLAP_STEPS": _optional_bool("TOKENMILL_OVERLAP_STEPS"),
    # 0 keeps tokenmill's own CPU kernels (kernels/cpu/) out: every op runs on the torch path,
    # their reference. They are also left out, with a log line, where they cannot be built.
    "TOKENMILL_CPU_KERNELS": _bool("TOKENMILL_CPU_KERNELS", True),
    # Caps the instruction set the CPU kernels use: amx, avx512_bf16, avx512, avx2 or none
    # (the portable build). Unset: all the CPU has. For tests and comparisons.
    "TOKENMILL_CPU_ISA": lambda: os.environ.get("TOKENMILL_CPU_ISA", "").strip().lower(),
    # 0 keeps the CPU worker's thread count fixed; by default it drops to one thread while
    # other work shares the cores and tries its full count again every 10 s
    # (worker/cpu_threads.py).
    "TOKENMILL_CPU_THREAD_GOVERNOR": _bool("TOKENMILL_CPU_THREAD_GOVERNOR", True),
    # 0 runs a decode step's Llama layers one op at a time from Python, as the other steps;
    # by default they run as one call of the CPU kernels (worker/models/cpu_decode.py).
    "TOKENMILL_CPU_DECODE_LOOP": _bool("TOKENMILL_CPU_DECODE_LOOP", True),
    # The batch-invariant mode for engines whose batch_invariant argument is left unset
    # (vLLM's VLLM_BATCH_INVARIANT): see kernels/batch_invariant.py.
    "TOKENMILL_BATCH_INVARIANT": _bool("TOKENMILL_BATCH_INVARIANT", False),
    # Ray: the logical CPUs each worker actor (and each data-parallel engine-core actor)
    # reserves; Ray also sets the actor's thread count (OMP_NUM_THREADS) to it.
    "TOKENMILL_RAY_WORKER_CPUS": _float("TOKENMILL_RAY_WORKER_CPUS", 1.0),
}


def __getattr__(name: str) -> Any:
    if name in _REGISTRY:
        return _REGISTRY[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(_REGISTRY)
