"""The model registry: HF `architectures` names -> tokenmill model classes."""

from __future__ import annotations

from torch import nn

from tokenmill.worker.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {sorted(_MODELS)}"
        ) from None
