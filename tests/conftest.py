"""Shared fixtures: the default model's folder, and small random-weight HF models made here.

Random models are written with transformers' own classes (save_pretrained), so they double as
the independent reference that tokenmill's outputs are compared against.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# First of the project: it takes the repository's root off sys.path (`python -m pytest` puts
# it there), where its kernels/ folder would shadow the `kernels` package transformers imports.
import tokenmill  # noqa: F401

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Without a GPU, Triton kernels run in its interpreter on CPU tensors; it must be chosen before
# any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_CONFIGS = {
    # Llama with grouped-query attention (4 query heads share 2 KV heads).
    "llama-gqa": dict(
        arch="LlamaForCausalLM",
        kwargs=dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    ),
    # Llama with tied embeddings and multi-head attention, like SmolLM2's shape in miniature.
    "llama-tied": dict(
        arch="LlamaForCausalLM",
        kwargs=dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    ),
    "qwen2": dict(
        arch="Qwen2ForCausalLM",
        kwargs=dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    ),
    # Qwen3: explicit head_dim different from hidden/heads, per-head q/k norms.
    "qwen3": dict(
        arch="Qwen3ForCausalLM",
        kwargs=dict(
            num_attention_heads=4, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False
        ),
    ),
    "mistral": dict(
        arch="MistralForCausalLM",
        kwargs=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            sliding_window=None,
        ),
    ),
    # Mistral's window, shorter than most test prompts: every layer attends to 24 keys.
    "mistral-window": dict(
        arch="MistralForCausalLM",
        kwargs=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            sliding_window=24,
        ),
    ),
    # Qwen3-MoE: 8 experts of which 2 per token (renormalized), the second layer dense
    # (mlp_only_layers), q/k norms.
    "qwen3-moe": dict(
        arch="Qwen3MoeForCausalLM",
        kwargs=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        ),
    ),
    # Mixtral: top-2 of 4 experts (renormalized), every layer sparse.
    "mixtral": dict(
        arch="MixtralForCausalLM",
        kwargs=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
            sliding_window=None,
        ),
    ),
    # Phi-3: q/k/v and gate/up fused in the checkpoint, LongRoPE with a 64-token original
    # context (of 1024), so prompts and outputs cross from the short to the long factors.
    "phi3": dict(
        arch="Phi3ForCausalLM",
        kwargs=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            original_max_position_embeddings=64,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.6],
                "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0],
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    # Gemma 2: soft-capped attention and logits, a 24-token window on alternate layers,
    # query_pre_attn_scalar unlike head_dim, tied embeddings.
    "gemma2": dict(
        arch="Gemma2ForCausalLM",
        kwargs=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=24,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=4.0,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    # Gemma 3 (text): q/k norms, one local (24-token window, base 10k) and one global layer
    # (base 1M).
    "gemma3": dict(
        arch="Gemma3ForCausalLM",
        config="Gemma3TextConfig",
        kwargs=dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            sliding_window=24,
            query_pre_attn_scalar=32,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
        ),
    ),
}


def make_tiny_model(folder: Path, name: str, seed: int = 0) -> Path:
    """Writes a small random-weight HF checkpoint (fp32 safetensors) and returns its folder."""
    import transformers

    spec = TINY_CONFIGS[name]
    arch = spec["arch"]
    config_cls = getattr(transformers, spec.get("config", arch.replace("ForCausalLM", "Config")))
    config = config_cls(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        # Larger than the default 0.02 so that logits are well separated (few near-ties).
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **spec["kwargs"],
    )
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).float().eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = make_tiny_model(tmp_path_factory.mktemp(name), name)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The default model's HF folder (its Q4_1 weights de-quantized: what HF reads)."""
    from tokenmill.protocol.default_model import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_path: str):
    """One shared in-process engine on the real SmolLM2 weights (fp32)."""
    from tokenmill import LLM

    llm = LLM(smollm2_path, max_model_len=1024, kv_cache_memory_bytes=256 << 20, dtype="float32")
    yield llm
    llm.shutdown()


@pytest.fixture(autouse=True)
def _batch_invariant_mode_off():
    """An in-process engine with batch_invariant=True turns the process-wide switch on
    (kernels/batch_invariant.py); no test after it inherits the mode."""
    yield
    from tokenmill.kernels.batch_invariant import batch_invariant, set_batch_invariant

    if batch_invariant():
        set_batch_invariant(False)
