"""Greedy parity with HF transformers: tokenmill's batched generate() must produce exactly
the token ids of HF `generate(do_sample=False)` run one prompt at a time (the reference).

The one accepted difference is a near-tie: at the first differing position both tokens are
in HF's top 2 with logits within 1e-3, where fp32 summation order alone may flip the argmax.
"""

from __future__ import annotations

import pytest
import torch
from helpers import smollm2_prompts
from transformers import AutoModelForCausalLM, AutoTokenizer

from tokenmill import LLM, SamplingParams

MAX_TOKENS = 32
NEAR_TIE = 1e-3


def compare_greedy(hf_model, prompts: list[list[int]], outputs: list[list[int]]) -> int:
    """Asserts parity for every prompt; returns how many ended in an accepted near-tie."""
    near_ties = 0
    for prompt, ours in zip(prompts, outputs):
        with torch.inference_mode():
            ref = hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False
            )[0, len(prompt) :].tolist()
        if ours == ref:
            continue
        i = next((j for j, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
        assert i is not None, f"same prefix, different lengths:\nours {ours}\nhf   {ref}"
        with torch.inference_mode():
            logits = hf_model(torch.tensor([prompt + ref[:i]])).logits[0, -1]
        top2 = logits.topk(2)
        tie = (
            set(top2.indices.tolist()) == {ours[i], ref[i]}
            and float(top2.values[0] - top2.values[1]) < NEAR_TIE
        )
        assert tie, f"diverged at {i} without a near-tie:\nours {ours}\nhf   {ref}"
        near_ties += 1
    return near_ties


@pytest.mark.slow
def test_smollm2_greedy_matches_hf(smollm2_path: str, smollm2_llm: LLM) -> None:
    prompts = smollm2_prompts(AutoTokenizer.from_pretrained(smollm2_path))
    lengths = sorted(len(p) for p in prompts)
    assert 5 <= lengths[0] <= 8 and 250 <= lengths[-1] <= 300, lengths

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outputs = smollm2_llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    hf_model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    near_ties = compare_greedy(hf_model, prompts, [o.outputs[0].token_ids for o in outputs])
    assert near_ties <= 1


# (Prompts of up to 333 tokens: longer than the 24-token windows of mistral-window, gemma2 and
# gemma3.)
@pytest.mark.parametrize(
    "name",
    ["llama-gqa", "llama-tied", "qwen2", "qwen3", "mistral", "mistral-window", "gemma2", "gemma3"],
)
def test_random_model_greedy_matches_hf(tiny_model, name: str) -> None:
    path = tiny_model(name)
    generator = torch.Generator().manual_seed(1)
    lengths = [1, 5, 17, 64, 200, 333]
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in lengths]
    # A small chunk budget and few blocks per step exercise chunked prefill and block growth.
    llm = LLM(
        str(path),
        dtype="float32",  # also on a GPU, where "auto" would pick bf16
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=16 << 20,
        max_num_batched_tokens=128,
        block_size=8,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    hf_model = hf_reference(path)
    assert compare_greedy(hf_model, prompts, [o.outputs[0].token_ids for o in outputs]) == 0


def hf_reference(path):
    """HF's fp32 model, with its eager attention (the one that soft-caps Gemma 2's scores)."""
    return AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.mark.slow
def test_smollm2_repetition_penalty_matches_hf(smollm2_path: str, smollm2_llm: LLM) -> None:
    """HF's RepetitionPenaltyLogitsProcessor has vLLM's semantics (prompt and output tokens,
    positive logits divided, negative multiplied)."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    prompts = smollm2_prompts(tokenizer)[:4]
    params = SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3)
    outputs = smollm2_llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    plain = smollm2_llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=24),
        use_tqdm=False,
    )
    changed = [a.outputs[0].token_ids != b.outputs[0].token_ids for a, b in zip(outputs, plain)]
    assert any(changed), "the penalty changed nothing"
    hf_model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outputs):
        with torch.inference_mode():
            ref = hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=24, do_sample=False, repetition_penalty=1.3
            )[0, len(prompt) :].tolist()
        assert out.outputs[0].token_ids == ref


@pytest.mark.slow
def test_smollm2_bad_words_are_never_completed(smollm2_llm: LLM) -> None:
    tokenizer = smollm2_llm.get_tokenizer()
    prompt = "The capital of France is"
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    text = smollm2_llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].text
    word = text.split()[0]  # what the model says first ("Paris", say)
    banned = SamplingParams(temperature=0.0, max_tokens=12, bad_words=[word])
    out = smollm2_llm.generate(prompt, banned, use_tqdm=False)[0].outputs[0]
    assert word not in out.text.split(), (word, out.text)
    for sequence in (
        tokenizer.encode(word, add_special_tokens=False),
        tokenizer.encode(" " + word, add_special_tokens=False),
    ):
        n = len(sequence)
        ids = out.token_ids
        assert all(ids[i : i + n] != sequence for i in range(len(ids) - n + 1)), sequence
