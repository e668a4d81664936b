"""The CUDA path, where a GPU is at hand (skipped elsewhere; scripts/gpu_check.sh runs it):
CUDA graphs give the eager path's tokens, bf16 log-probabilities stay close to HF's on the
same GPU, and seeded sampling draws on the device reproducibly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.protocol.utils import cdiv
from tokenmill.worker.attention.base import StepAttentionInputs
from tokenmill.worker.forward_context import set_forward_context

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def random_prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 200, (n,), generator=g).tolist()
    return [torch.randint(3, 512, (k,), generator=g).tolist() for k in lengths]


def in_process_llm(model: str, monkeypatch, **kwargs) -> LLM:
    monkeypatch.setenv("TOKENMILL_MULTIPROC", "0")  # to reach the model runner
    return LLM(model, skip_tokenizer_init=True, kv_cache_memory_bytes=64 << 20, **kwargs)


def runner_of(llm: LLM):
    return llm.llm_engine.client.engine_core.executor.worker.model_runner


def test_cuda_graphs_match_eager(tiny_model, monkeypatch) -> None:
    model = str(tiny_model("llama-gqa"))
    prompts = [{"prompt_token_ids": p} for p in random_prompts(24)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    results = {}
    for eager in (True, False):
        llm = in_process_llm(model, monkeypatch, dtype="float32", enforce_eager=eager)
        try:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            graphs = runner_of(llm).decode_graphs
            if eager:
                assert graphs is None
            else:
                assert graphs is not None and graphs.graphs and graphs.num_steps > 20
            results[eager] = [o.outputs[0].token_ids for o in outputs]
        finally:
            llm.shutdown()
    assert results[False] == results[True]


def test_cuda_graphs_verify_speculative_steps(tiny_model, monkeypatch) -> None:
    """(1 + k)-token verify steps replayed from their captured graphs (requests with fewer
    proposals padded) give the eager run's tokens without speculation."""
    model = str(tiny_model("llama-gqa"))
    prompts = [{"prompt_token_ids": [5 + i] * 20} for i in range(8)]
    prompts += [{"prompt_token_ids": p} for p in random_prompts(8)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
             "prompt_lookup_max": 3, "auto_disable": False}  # fmt: skip
    results = {}
    for eager in (True, False):
        extra = {} if eager else {"speculative_config": ngram}
        llm = in_process_llm(model, monkeypatch, dtype="float32", enforce_eager=eager, **extra)
        try:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            if not eager:
                graphs = runner_of(llm).decode_graphs
                assert any(q == 4 for _, q in graphs.graphs), list(graphs.graphs)
                assert graphs.num_verify_steps > 10, graphs.num_verify_steps
                assert llm.get_stats()["spec_decode_num_accepted_tokens"] > 10
            results[eager] = [o.outputs[0].token_ids for o in outputs]
        finally:
            llm.shutdown()
    assert results[False] == results[True]


def test_bf16_logprobs_close_to_hf(tiny_model, monkeypatch) -> None:
    from transformers import AutoModelForCausalLM

    path = str(tiny_model("qwen3"))
    llm = in_process_llm(path, monkeypatch, dtype="bfloat16")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    try:
        runner = runner_of(llm)
        bs = runner.block_size
        for prompt in random_prompts(4, seed=3):
            n = len(prompt)
            # A prefill of the whole prompt into free blocks 1.. (the engine is idle).
            inputs = StepAttentionInputs(
                num_decodes=0,
                query_lens=np.array([n]),
                seq_lens=np.array([n]),
                block_table=np.arange(1, cdiv(n, bs) + 1)[None, :],
                slot_mapping=np.arange(bs, bs + n),
                block_size=bs,
                device=runner.device,
                dtype=torch.bfloat16,
            )
            ids = torch.tensor(prompt, device="cuda")
            with (
                torch.inference_mode(),
                set_forward_context(runner.attn_backend.build_metadata(inputs)),
            ):
                hidden = runner.model(ids, torch.arange(n, device="cuda"))
                ours = runner.model.compute_logits(hidden[-1:]).float().log_softmax(-1)[0]
                ref = hf(ids[None]).logits[0, -1].float().log_softmax(-1)
            top = ref.topk(10).indices
            assert (ours[top] - ref[top]).abs().max().item() < 0.1
    finally:
        llm.shutdown()


def test_seeded_sampling_on_the_device(tiny_model, monkeypatch) -> None:
    llm = in_process_llm(str(tiny_model("llama-gqa")), monkeypatch, dtype="float32")
    try:
        prompt = [{"prompt_token_ids": random_prompts(1)[0]}]

        def sample(seed: int) -> list[int]:
            params = SamplingParams(temperature=1.0, seed=seed, max_tokens=24, ignore_eos=True)
            return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids

        assert sample(5) == sample(5)
        assert sample(5) != sample(6)
    finally:
        llm.shutdown()
