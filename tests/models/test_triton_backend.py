"""The Triton attention backend and Triton layers, wired into the whole engine: on the CPU they
run in Triton's interpreter (slow, so the batch is small; on a GPU they run compiled) and must
give the torch backend's greedy tokens through mixed prefill/decode steps, chunked prefills, a
prefix-cache hit and preemptions; launch counters prove that every kernel ran (a torch
fallback cannot pass)."""

from __future__ import annotations

import pytest
import torch
from helpers import require_triton

from tokenmill import LLM, SamplingParams
from tokenmill.protocol.config import EngineArgs
from tokenmill.worker.model_runner import ModelRunner

require_triton()
from tokenmill.kernels.launches import LAUNCHES  # noqa: E402

KERNELS = [
    "reshape_and_cache",
    "paged_attention",
    "combine_splits",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def prompts(seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 512, (32,), generator=g).tolist()  # two full blocks
    return [
        {"prompt_token_ids": shared + torch.randint(3, 512, (16,), generator=g).tolist()},
        {"prompt_token_ids": torch.randint(3, 512, (40,), generator=g).tolist()},
        {"prompt_token_ids": torch.randint(3, 512, (9,), generator=g).tolist()},
        {"prompt_token_ids": shared + torch.randint(3, 512, (5,), generator=g).tolist()},
    ]


def run(
    model: str,
    backend: str,
    static_decodes: bool = False,
    batch: list[dict] | None = None,
    engine: dict | None = None,
    params: SamplingParams = PARAMS,
    **triton_settings,
) -> tuple[list[list[int]], dict]:
    llm = LLM(
        model,
        **(engine or {}),
        device="cuda" if torch.cuda.is_available() else "cpu",
        dtype="float32",
        enforce_eager=True,  # CUDA graphs have their own test
        skip_tokenizer_init=True,
        attention_backend=backend,
        max_model_len=128,
        block_size=16,
        # Chunked prefill (40-token prompts in 32-token steps, mixed with decodes), and 9
        # blocks for 4 requests that need up to 4 each: preemptions.
        max_num_batched_tokens=32,
        num_gpu_blocks_override=9,
    )
    try:
        runner = llm.llm_engine.client.engine_core.executor.worker.model_runner
        for name, value in triton_settings.items():
            setattr(runner.attn_backend, name, value)
        if static_decodes:
            # The CUDA-graph path's buffers and padding, run eagerly: decode batches of 1-4
            # requests run padded to 2 or 4 (cudagraph_capture_sizes).
            runner.enable_decode_graphs(capture=False)
        batch = batch or prompts(0)
        first = llm.generate(batch[:3], params, use_tqdm=False)
        second = llm.generate(batch[3:], params, use_tqdm=False)  # reuses the shared prefix
        tokens = [o.outputs[0].token_ids for o in first + second]
        stats = llm.get_stats()
        if static_decodes:
            stats["static_decode_steps"] = runner.decode_graphs.num_steps
            stats["static_verify_steps"] = runner.decode_graphs.num_verify_steps
        return tokens, stats
    finally:
        llm.shutdown()


# qwen3: per-head q/k norms; gemma2: windows and soft-caps; gemma3: Gemma's per-head q/k
# norms; mistral-window: every layer
# slides, so blocks behind the window are freed and handed to other requests while the
# workers' tables still name them (the kernel must skip them); qwen3-moe: the fused-MoE kernel.
@pytest.mark.parametrize(
    "name", ["llama-gqa", "qwen3", "gemma2", "gemma3", "mistral-window", "qwen3-moe"]
)
def test_triton_engine_matches_torch_engine(tiny_model, monkeypatch, name: str) -> None:
    monkeypatch.setenv("TOKENMILL_MULTIPROC", "0")  # in this process, to read the counters
    model = str(tiny_model(name))
    expected, torch_stats = run(model, "TORCH_SDPA")
    LAUNCHES.clear()
    # Short contexts still split into parts (flash-decoding) with a small split size.
    tokens, stats = run(model, "TRITON_ATTN", min_split_tokens=16)
    assert tokens == expected
    # (Mistral frees each block once it is behind the window: the 8 usable are then enough
    # for everyone, and the shared prefix, freed first, is evicted first.)
    sliding = name == "mistral-window"
    assert sliding or (stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0), stats
    assert stats["num_preemptions"] == torch_stats["num_preemptions"]
    # Gemma: (1 + w) norms (rms_norm's plus_one) and GeGLU instead of SiLU.
    expected_kernels = (
        KERNELS if not name.startswith("gemma") else KERNELS[:5] + ["gelu_tanh_and_mul"]
    )
    if name.endswith("moe"):
        expected_kernels = [*expected_kernels, "fused_moe"]
    missing = [k for k in expected_kernels if LAUNCHES[k] == 0]
    assert not missing, f"kernels never launched: {missing} ({dict(LAUNCHES)})"


def test_padded_static_decode_batches_match(tiny_model, monkeypatch) -> None:
    """Decode-only steps through the CUDA-graph buffers (padded rows write nowhere and read
    nothing) give the same tokens."""
    monkeypatch.setenv("TOKENMILL_MULTIPROC", "0")
    model = str(tiny_model("llama-gqa"))
    expected, _ = run(model, "TRITON_ATTN")
    tokens, stats = run(
        model, "TRITON_ATTN", static_decodes=True, engine=dict(cudagraph_capture_sizes=[2, 4]),
        min_split_tokens=16, max_splits=4,
    )  # fmt: skip
    assert tokens == expected
    assert stats["static_decode_steps"] > 10, stats


def test_padded_static_verify_batches_match(tiny_model, monkeypatch) -> None:
    """Steps that verify n-gram proposals through the CUDA-graph buffers: every request
    padded to 1 + k tokens (fewer proposals: padded rows after its own, its context
    lengthened to keep their positions), the batch to 2 or 4 requests; greedy tokens equal
    the torch backend's without speculation."""
    monkeypatch.setenv("TOKENMILL_MULTIPROC", "0")
    model = str(tiny_model("llama-gqa"))
    # Repeated tokens, whose continuations this model often repeats too: with one-token
    # lookups proposals of 1 to 3 tokens are found at most steps, and some are accepted.
    batch = [{"prompt_token_ids": [5 + i] * 20} for i in range(4)]
    batch += [{"prompt_token_ids": [3 + (j % 2) * i for j in range(20)]} for i in (1, 2)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected, _ = run(model, "TORCH_SDPA", batch=batch, params=params)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
             "prompt_lookup_max": 3, "auto_disable": False}  # fmt: skip
    engine = dict(cudagraph_capture_sizes=[2, 4], speculative_config=ngram)
    tokens, stats = run(model, "TRITON_ATTN", static_decodes=True, batch=batch, engine=engine,
                        params=params)  # fmt: skip
    assert tokens == expected
    assert stats["static_verify_steps"] > 10, stats
    assert stats["spec_decode_num_accepted_tokens"] > 10, stats


@pytest.mark.parametrize("backend", ["TORCH_SDPA", "TRITON_ATTN"])
def test_profile_run_covers_prefill_and_split_decodes(tiny_model, backend: str) -> None:
    """The memory-profiling step runs before any KV cache exists: a full token budget of
    prefill, then max_num_seqs decodes with long contexts (split across programs), and leaves
    no cache behind."""
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (the interpreter only without)
    config = EngineArgs(
        model=str(tiny_model("llama-gqa")),
        device=device,
        dtype="float32",
        attention_backend=backend,
        skip_tokenizer_init=True,
        max_num_seqs=4,
        max_num_batched_tokens=64,
    ).create_engine_config()
    runner = ModelRunner(config, torch.device(device))
    runner.load_model()
    LAUNCHES.clear()
    runner.profile_run()
    if backend == "TRITON_ATTN":
        assert LAUNCHES["combine_splits"] > 0, dict(LAUNCHES)
    assert all(a.kv_cache.numel() == 0 for a in runner.model.attention_layers())


def test_profile_run_includes_the_draft_models_forwards(tiny_model) -> None:
    """With a draft model its activations count too: the same two steps run through it."""
    path = str(tiny_model("llama-gqa"))
    config = EngineArgs(
        model=path,
        device="cpu",
        dtype="float32",
        skip_tokenizer_init=True,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 2},
    ).create_engine_config()
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    assert runner.proposer is not None and runner.proposer.model is not None
    tokens_seen = []
    hook = runner.proposer.model.register_forward_hook(
        lambda module, args, out: tokens_seen.append(args[0].shape[0])
    )
    try:
        runner.profile_run()
    finally:
        hook.remove()
    assert tokens_seen == [64, 4]  # the token budget's prefill, then max_num_seqs decodes
    assert all(a.kv_cache.numel() == 0 for a in runner.proposer.model.attention_layers())


def test_fp8_kv_cache_triton_engine_matches_torch_engine(tiny_model, monkeypatch) -> None:
    """kv_cache_dtype="fp8": the Triton kernels write and read the e4m3 cache as the torch
    backend does (chunked prefill, preemption, prefix hits, split decodes): the same greedy
    tokens."""
    monkeypatch.setenv("TOKENMILL_MULTIPROC", "0")
    model = str(tiny_model("llama-gqa"))
    fp8 = dict(kv_cache_dtype="fp8")
    expected, torch_stats = run(model, "TORCH_SDPA", engine=fp8)
    tokens, stats = run(model, "TRITON_ATTN", engine=fp8, min_split_tokens=16)
    assert tokens == expected
    assert stats["num_preemptions"] == torch_stats["num_preemptions"] > 0, stats
