"""LoRA adapters as requests name them (vLLM's `LoRARequest`): plain data that crosses to the
engine core with the request (msgspec), torch-free. The adapter's weights are read by the
workers (worker/lora/adapter.py) from `lora_path`, a PEFT folder."""

from __future__ import annotations

import msgspec


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
