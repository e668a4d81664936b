"""Penalties and biases (vLLM's semantics) against logits worked out by hand, and through the
whole engine against a step-by-step reference built on HF transformers' own logits."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenmill import LLM, SamplingParams
from tokenmill.worker.sample.base import Bans
from tokenmill.worker.sample.logit_bias import AllowedMask, Bias
from tokenmill.worker.sample.penalties import Penalties
from tokenmill.worker.sampler import SamplingMetadata, apply_adjustments


def _meta(rows: int, *adjustments) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.zeros(rows),
        all_greedy=True,
        top_k=None,
        top_p=None,
        min_p=None,
        generators={},
        adjustments=list(adjustments),
    )


def test_penalties_by_hand() -> None:
    # Row 1 has: token 1 in its prompt; token 0 generated once, token 2 twice.
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0], [2.0, -1.0, 0.5, 0.0]])
    counts = torch.tensor([[1, 0, 2, 0]], dtype=torch.int32)
    penalties = Penalties(
        rows=torch.tensor([1]),
        presence=torch.tensor([[0.25]]),
        frequency=torch.tensor([[0.5]]),
        repetition=torch.tensor([[2.0]]),
        output_counts=counts,
        prompt_mask=torch.tensor([[False, True, False, False]]),
    )
    apply_adjustments(logits, _meta(2, penalties))
    # token 0: 2 / 2 (repetition, positive) - 0.5 * 1 (frequency) - 0.25 (presence) = 0.25
    # token 1: -1 * 2 (repetition, negative; prompt only, so no frequency or presence) = -2
    # token 2: 0.5 / 2 - 0.5 * 2 - 0.25 = -1.0;  token 3: never seen, unchanged
    assert logits.tolist() == [[1.0, 1.0, 1.0, 1.0], [0.25, -2.0, -1.0, 0.0]]


def test_allowed_bans_and_bias_by_hand() -> None:
    logits = torch.zeros(3, 5)
    meta = _meta(
        3,
        AllowedMask(torch.tensor([0]), torch.tensor([[False, True, False, True, False]])),
        Bans({1: [4, 2]}),
        Bias(torch.tensor([1, 2, 2]), torch.tensor([0, 3, 3]), torch.tensor([1.5, -2.0, 1.0])),
    )
    apply_adjustments(logits, meta)
    inf = float("-inf")
    assert logits.tolist() == [
        [inf, 0.0, inf, 0.0, inf],
        [1.5, 0.0, inf, 0.0, inf],
        [0.0, 0.0, 0.0, -1.0, 0.0],  # two biases on one token add up
    ]


def reference_greedy(hf_model, prompt: list[int], steps: int, params: SamplingParams) -> list[int]:
    """Greedy decoding with the penalties and bias applied by hand to HF's fp32 logits."""
    out: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + out])).logits[0, -1].clone()
        for token, bias in (params.logit_bias or {}).items():
            logits[token] += bias
        for token in set(prompt) | set(out):
            x = logits[token]
            logits[token] = (
                x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
            )
        for token in set(out):
            logits[token] -= params.frequency_penalty * out.count(token) + params.presence_penalty
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, frequency_penalty=1.5),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, presence_penalty=2.0),
        SamplingParams(
            temperature=0,
            max_tokens=20,
            ignore_eos=True,
            repetition_penalty=1.8,
            frequency_penalty=0.3,
            logit_bias={7: 3.0, 11: -50.0},
        ),
    ],
)
def test_engine_penalties_match_a_hand_reference(tiny_model, params: SamplingParams) -> None:
    path = str(tiny_model("llama-gqa"))
    g = torch.Generator().manual_seed(4)
    # Short prompts from a small alphabet, so that tokens repeat and the penalties bite.
    prompts = [torch.randint(3, 40, (n,), generator=g).tolist() for n in (3, 9, 30)]
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=16 << 20)
    try:
        plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        # Mixed in one batch with plain requests, which must stay unpenalized.
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts * 2],
            [params] * 3 + [plain] * 3,
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    got = [o.outputs[0].token_ids for o in outputs]
    for i, prompt in enumerate(prompts):
        assert got[i] == reference_greedy(hf, prompt, 20, params), i
        assert got[3 + i] == reference_greedy(hf, prompt, 20, plain), i
    assert got[:3] != got[3:], "the penalties changed nothing"


def test_allowed_token_ids_and_bad_words(tiny_model) -> None:
    llm = LLM(
        str(tiny_model("llama-gqa")), skip_tokenizer_init=True, kv_cache_memory_bytes=16 << 20
    )
    try:
        allowed = [17, 99, 301]
        params = SamplingParams(temperature=1.0, seed=0, max_tokens=30, allowed_token_ids=allowed)
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)
        assert set(out[0].outputs[0].token_ids) <= set(allowed)
        with pytest.raises(ValueError, match="allowed_token_ids holds out-of-vocab token ids"):
            llm.generate(
                {"prompt_token_ids": [5]}, SamplingParams(allowed_token_ids=[512]), use_tqdm=False
            )
        with pytest.raises(ValueError, match="bad_words needs a tokenizer"):
            llm.generate({"prompt_token_ids": [5]}, SamplingParams(bad_words=["x"]), use_tqdm=False)
    finally:
        llm.shutdown()


def test_penalties_survive_preemption(tiny_model) -> None:
    """A preempted request comes back with its outputs: its token counts are rebuilt."""
    path = str(tiny_model("llama-gqa"))
    g = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(3, 40, (n,), generator=g).tolist()} for n in
               (20, 25, 30, 35)]  # fmt: skip
    params = SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, frequency_penalty=1.0, repetition_penalty=1.5
    )
    results = []
    for blocks in (None, 8):  # ample, then too few for all four at once
        # fp32: bf16 results depend on the batch's shape, which preemption changes.
        llm = LLM(path, skip_tokenizer_init=True, kv_cache_memory_bytes=16 << 20,
                  max_model_len=112, num_gpu_blocks_override=blocks, dtype="float32")  # fmt: skip
        try:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            results.append(([o.outputs[0].token_ids for o in outputs], llm.get_stats()))
        finally:
            llm.shutdown()
    (ample, ample_stats), (tight, tight_stats) = results
    assert ample_stats["num_preemptions"] == 0 and tight_stats["num_preemptions"] > 0
    assert tight == ample
