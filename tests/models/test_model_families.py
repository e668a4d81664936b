"""The model families beyond Llama against HF transformers (fp32, CPU), on small random-weight
models: Mistral with a window shorter than the prompts, Gemma 2 (soft-capping, alternating
windows), Gemma 3 (q/k norms, local and global layers with two rope bases), and the mixtures
of experts Qwen3-MoE (top-2 of 8, a dense layer among the sparse ones) and Mixtral (top-2 of
4; TP=2 splits every expert's intermediate dimension). One forward's
logits match HF's to 1e-4, and greedy generation equals HF's at TP=1 and TP=2 through chunked
prefills and prefix-cache hits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_hf_parity import MAX_TOKENS, compare_greedy, hf_reference

from tokenmill import LLM, SamplingParams
from tokenmill.protocol.utils import cdiv
from tokenmill.worker.attention.base import StepAttentionInputs
from tokenmill.worker.forward_context import set_forward_context

FAMILIES = ["mistral-window", "gemma2", "gemma3", "qwen3-moe", "mixtral"]


def engine(path, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", skip_tokenizer_init=True,
               kv_cache_memory_bytes=16 << 20, block_size=8, **kwargs)  # fmt: skip


@pytest.mark.parametrize("name", FAMILIES)
def test_one_forward_logits_match_hf(tiny_model, monkeypatch, name: str) -> None:
    monkeypatch.setenv("TOKENMILL_MULTIPROC", "0")  # to reach the model runner
    path = tiny_model(name)
    prompt = torch.randint(3, 512, (100,), generator=torch.Generator().manual_seed(2)).tolist()
    llm = engine(path)
    try:
        runner = llm.llm_engine.client.engine_core.executor.worker.model_runner
        bs, n = runner.block_size, len(prompt)
        inputs = StepAttentionInputs(
            num_decodes=0,
            query_lens=np.array([n]),
            seq_lens=np.array([n]),
            block_table=np.arange(1, cdiv(n, bs) + 1)[None, :],  # free blocks: nothing ran
            slot_mapping=np.arange(bs, bs + n),
            block_size=bs,
            device=runner.device,
            dtype=torch.float32,
        )
        with (
            torch.inference_mode(),
            set_forward_context(runner.attn_backend.build_metadata(inputs)),
        ):
            hidden = runner.model(torch.tensor(prompt), torch.arange(n))
            ours = runner.model.compute_logits(hidden)
    finally:
        llm.shutdown()
    with torch.inference_mode():
        ref = hf_reference(path)(torch.tensor([prompt])).logits[0]
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_matches_hf_through_chunks_and_prefix_hits(tiny_model, name: str, tp: int) -> None:
    """Prompts of 40-140 tokens (past the 24-token windows) sharing a 64-token prefix, in
    32-token chunks; the second batch finds the first's blocks cached."""
    path = tiny_model(name)
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 512, (64,), generator=g).tolist()
    tails = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (2, 17, 40, 76)]
    prompts = [shared + tail for tail in tails] + [tails[2]]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    llm = engine(path, tensor_parallel_size=tp, max_num_batched_tokens=32)
    try:
        first = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params,
                             use_tqdm=False)  # fmt: skip
        later = llm.generate([{"prompt_token_ids": p} for p in prompts[2:]], params,
                             use_tqdm=False)  # fmt: skip
        stats = llm.get_stats()
    finally:
        llm.shutdown()
    assert stats["prefix_cache_hits"] >= 64
    outputs = [o.outputs[0].token_ids for o in first + later]
    assert compare_greedy(hf_reference(path), prompts, outputs) == 0
