"""LoRA adapters as requests name them (vLLM's `LoRARequest`): plain data that crosses to the
engine core with the request (msgspec), torch-free. The adapter's weights are read by the
workers (worker/lora/adapter.py) from `lora_path`, a PEFT folder."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

# The ranks the kernels take (vLLM's set: a max_lora_rank outside it is refused).
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class LoRARequest(msgspec.Struct, frozen=True, omit_defaults=True):  # type: ignore[call-arg]
    """One adapter: `lora_name` (what the API calls it), `lora_int_id` (> 0; the engine's key
    for its slots and its prefix-cache entries) and `lora_path` (a PEFT adapter folder:
    adapter_config.json and adapter_model.safetensors). As vLLM's, two requests naming the
    same adapter are equal by name."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be > 0, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and other.lora_name == self.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)

    @property
    def cache_salt(self) -> bytes:
        """What its prefix-cache keys carry (vLLM's extra keys): an adapter's K/V differ from
        the base model's and from other adapters', so its blocks are cached under its id,
        name and folder (and routed by them across data-parallel ranks). The server gives a
        reloaded adapter a new id: blocks of its old weights are never reused."""
        return msgspec.msgpack.encode(("lora", self.lora_int_id, self.lora_name, self.lora_path))

    # vLLM's other names for the fields.
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA's settings (vLLM's): `max_loras` adapters in device slots, so at most that many
    distinct adapters per step; `max_lora_rank` the slots' rank (an adapter of a higher rank
    is refused); `max_cpu_loras` adapters kept read in host memory (default max_loras)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank not in MAX_LORA_RANKS:
            raise ValueError(
                f"max_lora_rank ({self.max_lora_rank}) must be one of {MAX_LORA_RANKS}"
            )
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
