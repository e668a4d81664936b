"""Which model architectures tokenmill runs: HF `architectures` names -> the module of
worker/models/ and the class that builds each. The one list: the engine config checks a
model against it before anything starts (an unknown name fails listing these), and the
worker's loader imports the class from it.

Adding a family: its model file in worker/models/ (built from the typed ModelConfig, its
parameter names as HF's checkpoint names, q/k/v and gate/up fused through
`packed_modules_mapping`, its own config.json fields parsed there from
`ModelConfig.hf_text_config`) and a line here.
"""

from __future__ import annotations

ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("llama", "Phi3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("moe", "MixtralForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
}


def check_architecture(architecture: str, path: str) -> None:
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"{path}/config.json: architecture {architecture!r} is not supported; supported: "
            f"{', '.join(sorted(ARCHITECTURES))}"
        )
