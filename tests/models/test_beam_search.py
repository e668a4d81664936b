"""Beam search against HF transformers on SmolLM2 (fp32, CPU), compared as vLLM's
tests/samplers/test_beam_search.py compares them: for each prompt, the k-th best sequence's
token ids (prompt included) equal HF `generate(num_beams=4, num_return_sequences=4)`'s."""

from __future__ import annotations

import pytest
import torch

from tokenmill import BeamSearchParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The history of the printing press begins",
    "In a small village by the sea, there lived",
    "The three primary colours are",
    "def fibonacci(n):",
]
BEAM_WIDTH = 4
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def hf_beams(smollm2_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    results = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            out = model.generate(
                ids, do_sample=False, num_beams=BEAM_WIDTH, num_return_sequences=BEAM_WIDTH,
                max_new_tokens=MAX_TOKENS, pad_token_id=tokenizer.eos_token_id,
            )  # fmt: skip
            # Shorter beams are padded; the pad is EOS here, so keep one EOS at most.
            beams = []
            for row in out.tolist():
                while len(row) > ids.shape[1] + 1 and row[-1] == row[-2] == tokenizer.eos_token_id:
                    row.pop()
                beams.append(row)
            results.append(beams)
    return results


def test_beam_search_equals_hf(smollm2_llm, hf_beams) -> None:
    params = BeamSearchParams(beam_width=BEAM_WIDTH, max_tokens=MAX_TOKENS)
    outputs = smollm2_llm.beam_search(PROMPTS, params)
    for prompt, hf, ours in zip(PROMPTS, hf_beams, outputs):
        got = [seq.tokens for seq in ours.sequences]
        assert len(got) == len(hf) == BEAM_WIDTH
        for k, (a, b) in enumerate(zip(hf, got)):
            assert a == b, f"{prompt!r}: beam {k} differs from HF's"
        assert ours.sequences[0].text.startswith(prompt)
        scores = [
            s.cum_logprob / len(s.tokens) for s in ours.sequences if s.finish_reason == "length"
        ]
        assert scores == sorted(scores, reverse=True)


def test_beam_width_one_is_greedy(smollm2_llm) -> None:
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    greedy = smollm2_llm.generate(PROMPTS[:2], params, use_tqdm=False)
    beams = smollm2_llm.beam_search(PROMPTS[:2], BeamSearchParams(1, 12, ignore_eos=True))
    for g, b in zip(greedy, beams):
        assert b.sequences[0].tokens == g.prompt_token_ids + g.outputs[0].token_ids
