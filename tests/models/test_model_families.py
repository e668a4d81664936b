"""The model families beyond Llama against HF transformers (fp32, CPU), on small random-weight
models: Mistral with a window shorter than the prompts, Gemma 2 (soft-capping, alternating
windows), Gemma 3 (q/k norms, local and global layers with two rope bases), and the mixtures
of experts Qwen3-MoE (top-2 of 8, a dense layer among the sparse ones) and Mixtral (top-2 of
4; TP=2 splits every expert's intermediate dimension), and Phi-3 (fused checkpoint
projections split onto the TP layers; LongRoPE with prompts on both sides of its original
context, and a short prompt whose output crosses it). One forward's
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

FAMILIES = ["mistral-window", "gemma2", "gemma3", "qwen3-moe", "mixtral", "phi3"]


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
            positions = np.arange(n)
            if runner.long_rope is not None:  # a prompt past LongRoPE's original context
                positions = runner.long_rope.table_rows(positions, np.full(n, n))
            positions = torch.from_numpy(positions).to(runner.device)
            hidden = runner.model(torch.tensor(prompt, device=runner.device), positions)
            ours = runner.model.compute_logits(hidden).cpu()
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
    if torch.cuda.is_available() and torch.cuda.device_count() < tp:
        pytest.skip(f"tensor_parallel_size={tp} on CUDA needs {tp} GPUs, this machine has "
                    f"{torch.cuda.device_count()}")  # fmt: skip
    path = tiny_model(name)
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 512, (64,), generator=g).tolist()
    tails = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (2, 17, 40, 76)]
    # (The lone prompt and its output stay below Phi-3's 64-token original context: see
    # test_long_rope_prompts_do_not_share_blocks_with_short_ones.)
    prompts = [shared + tail for tail in tails] + [tails[0]]
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


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens, each from a full forward of HF's model (no cache, no EOS stop)."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "auto_disable": False}  # fmt: skip


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "ngram-async"])
def test_blocks_behind_every_window_go_back_to_the_pool(tiny_model, speculate: bool) -> None:
    """Mistral slides a 24-token window over every layer: a request of 30 + 90 tokens holds
    15 blocks of 8 without freeing, at most 5 with it. Four of them fit a pool of 23 usable
    blocks (60 needed otherwise) only if the blocks behind the window are freed as they
    go: no preemption, and HF's tokens. Then the first conversation's next turn finds its
    last window cached, though its first blocks were handed out again long ago: a prefix
    hit with the null block behind the window. With n-gram proposals and async scheduling
    a step may take back 3 tokens, whose queries then reach further back."""
    path = tiny_model("mistral-window")
    g = torch.Generator().manual_seed(11)
    # Repeating prompts, so that n-gram lookups propose.
    prompts = [(torch.randint(3, 512, (6,), generator=g).tolist() * 5) for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True)
    extra = dict(speculative_config=NGRAM, async_scheduling=True) if speculate else {}
    llm = engine(path, num_gpu_blocks_override=24, max_model_len=160, **extra)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)  # fmt: skip
        stats = llm.get_stats()
        turn = prompts[0] + list(outputs[0].outputs[0].token_ids)  # 120 tokens
        short = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        (next_turn,) = llm.generate({"prompt_token_ids": turn}, short, use_tqdm=False)
    finally:
        llm.shutdown()
    # Its last 3 full blocks (the window before token 112) are what a hit needs.
    assert next_turn.num_cached_tokens == 112
    assert stats["num_preemptions"] == 0
    assert stats["kv_cache_usage"] == 0.0  # every block back, none freed twice
    if speculate:  # proposals made, some rejected (taken back)
        proposed, accepted = (stats[f"spec_decode_num_{k}_tokens"] for k in ("draft", "accepted"))
        assert 0 < proposed and accepted < proposed, (proposed, accepted)
    hf = hf_reference(path)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf, prompt, 90)
    assert next_turn.outputs[0].token_ids == hf_greedy(hf, turn, 10)


def test_a_sliding_window_model_runs_requests_longer_than_the_cache(tiny_model) -> None:
    """Mistral's 24-token window over every layer, 16 tokens a step: a request holds at
    most cdiv(24 + 16, 8) + 1 = 6 blocks of 8, so a cache of 11 usable blocks (88 tokens)
    takes max_model_len=160 and runs a 30 + 90-token request to the end, with HF's tokens."""
    path = tiny_model("mistral-window")
    prompt = torch.randint(3, 512, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True)
    llm = engine(path, num_gpu_blocks_override=12, max_model_len=160, max_num_batched_tokens=16)
    try:
        (out,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        stats = llm.get_stats()
    finally:
        llm.shutdown()
    assert stats["max_model_len"] == 160 and stats["num_preemptions"] == 0
    assert out.outputs[0].token_ids == hf_greedy(hf_reference(path), prompt, 90)


def test_long_rope_prompts_do_not_share_blocks_with_short_ones(tiny_model) -> None:
    """A prompt past LongRoPE's original context rotates every position by the long
    frequencies; a shorter prompt's first positions take the short ones. So a long prompt
    must not reuse a short one's cached blocks (their keys differ), and gets HF's tokens."""
    path = tiny_model("phi3")
    g = torch.Generator().manual_seed(7)
    short = torch.randint(3, 512, (48,), generator=g).tolist()  # below the 64-token context
    long = short + torch.randint(3, 512, (30,), generator=g).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    llm = engine(path)
    try:
        llm.generate({"prompt_token_ids": short}, SamplingParams(max_tokens=1), use_tqdm=False)
        before = llm.get_stats()["prefix_cache_hits"]
        out = llm.generate({"prompt_token_ids": long}, params, use_tqdm=False)
        assert llm.get_stats()["prefix_cache_hits"] == before  # nothing reused
        again = llm.generate({"prompt_token_ids": long}, params, use_tqdm=False)
        assert llm.get_stats()["prefix_cache_hits"] > before  # long with long: reused
    finally:
        llm.shutdown()
    assert out[0].outputs[0].token_ids == again[0].outputs[0].token_ids
    assert compare_greedy(hf_reference(path), [long], [out[0].outputs[0].token_ids]) == 0
