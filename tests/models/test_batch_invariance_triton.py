"""Batch-invariant mode on the Triton path (TRITON_ATTN, Triton's layers and its matmul,
kernels/matmul.py): a greedy request's tokens and top-20 log-probabilities, compared as bits,
are the same alone, beside 3 random requests, in prefill chunks of 16 tokens, after a
prefix-cache hit and with its positions verified as n-gram proposals. On a GPU the kernels run
compiled, else in Triton's interpreter on the CPU (slow: a small batch and short outputs).
Launch counters prove the Triton matmul and attention ran and that no decode was split."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from helpers import require_triton

from tokenmill import LLM, SamplingParams
from tokenmill.kernels.batch_invariant import batch_invariant, set_batch_invariant
from tokenmill.worker.attention.base import StepAttentionInputs

require_triton()
from tokenmill.kernels.launches import LAUNCHES  # noqa: E402
from tokenmill.worker.attention.triton_backend import TritonAttentionBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# A prompt whose greedy tokens (43, 353, 260, 114, 43, 353 in fp32) repeat its 43 and then
# themselves, so that n-gram lookup proposes (and has accepted) tokens; one full cache block.
TARGET = [477, 149, 95, 381, 404, 479, 278, 343, 389, 286, 389, 224, 58, 43, 465, 222, 325, 496,
          127, 94, 132, 484, 418, 145]  # fmt: skip
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "auto_disable": False}  # fmt: skip
SETTINGS = {
    "beside-3": dict(beside=3),
    "chunks-16": dict(beside=3, max_num_batched_tokens=16),
    "prefix-hit": dict(beside=3, repeat=True),
    "ngram-verify": dict(beside=3, speculative_config=NGRAM),
}


@pytest.fixture(autouse=True)
def restore_mode():
    """An engine sets the process's mode and leaves it so; later tests get theirs back."""
    previous = batch_invariant()
    yield
    set_batch_invariant(previous)


def others(count: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    found = []
    for _ in range(count):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(4, 16))]
        params = SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(1000),
                                max_tokens=rng.randint(1, 6), ignore_eos=True)  # fmt: skip
        found.append((prompt, params))
    return found


def bits(logprob: float) -> int:
    return torch.tensor(logprob, dtype=torch.float32).view(torch.int32).item()


def target_logprobs(path: str, dtype: str, beside: int = 0, repeat: bool = False,
                    **engine_args) -> list:  # fmt: skip
    """The target's tokens and top-20 log-probabilities as int32 bits, run in the middle of
    `beside` others; also checks that the Triton matmul ran and no decode was split."""
    llm = LLM(path, dtype=dtype, batch_invariant=True, skip_tokenizer_init=True,
              multiprocess=False, attention_backend="TRITON_ATTN", device=DEVICE,
              enforce_eager=True, max_model_len=256, **engine_args)  # fmt: skip
    try:
        # Decode contexts of 16 keys and more would be split (flash-decoding), if the mode
        # let them.
        runner = llm.llm_engine.client.engine_core.executor.worker.model_runner
        runner.attn_backend.min_split_tokens = 16
        target = SamplingParams(temperature=0.0, max_tokens=6, logprobs=20, ignore_eos=True)
        batch = others(beside, seed=beside)
        batch.insert(beside // 2, (TARGET, target))
        prompts = [{"prompt_token_ids": p} for p, _ in batch]
        params = [p for _, p in batch]
        if repeat:  # the first run fills the prefix cache, the second hits it
            llm.generate(prompts, params, use_tqdm=False)
        before = LAUNCHES.copy()
        out = llm.generate(prompts, params, use_tqdm=False)[beside // 2]
        launched = LAUNCHES - before
        assert launched["matmul"] > 0 and launched["paged_attention"] > 0
        assert launched["combine_splits"] == 0
        if repeat:
            assert out.num_cached_tokens > 0
        if "speculative_config" in engine_args:
            assert llm.get_stats()["spec_decode_num_drafts"] > 0
        steps = zip(out.outputs[0].token_ids, out.outputs[0].logprobs)
        return [(token, sorted((i, bits(lp.logprob)) for i, lp in step.items()))
                for token, step in steps]  # fmt: skip
    finally:
        llm.shutdown()


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def alone(request, tiny_model) -> tuple[str, str, list]:
    """The model, a dtype, and the target's results alone in its engine."""
    path = str(tiny_model("llama-gqa"))
    expected = target_logprobs(path, request.param)
    assert len(expected) == 6
    return path, request.param, expected


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_triton_logits_do_not_depend_on_the_batch(alone, setting: str) -> None:
    path, dtype, expected = alone
    assert target_logprobs(path, dtype, **SETTINGS[setting]) == expected


@pytest.fixture
def invariant_mode():
    set_batch_invariant(True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_computes_every_query_token_as_a_decode(invariant_mode, dtype) -> None:
    """The backend alone, in the mode: a prefill chunk's 8 tokens over 200 keys of context
    (four key blocks of the kernel) beside 3 decodes give, bit for bit, what each gives as a
    decode of its own, alone or beside 5 others. Without the mode these contexts split into
    parts (min_split_tokens=16) and prefill tiles hold 32 tokens."""
    heads, kv_heads, d, block_size, context = 4, 2, 16, 16, 200
    backend = TritonAttentionBackend(
        heads, kv_heads, d, torch.device(DEVICE), dtype, min_split_tokens=16
    )
    assert backend.prefill_block_q == 1 and backend.decode_splits(1, context) == 1
    g = torch.Generator().manual_seed(0)
    blocks_per_req = -(-context // block_size)
    # Request 0 is the target; requests 1-5 decode at contexts of 60-180 keys.
    cache = torch.randn(6 * blocks_per_req + 1, 2, block_size, kv_heads, d, generator=g)
    cache = cache.to(dtype).to(DEVICE)
    table = 1 + np.arange(6 * blocks_per_req).reshape(6, blocks_per_req)
    queries = torch.randn(6, 8, heads, d, generator=g).to(dtype).to(DEVICE)
    other_lens = [60, 90, 120, 150, 180]

    def step(requests: list[tuple[int, int, int]]) -> torch.Tensor:
        """requests: (request, new tokens, context after the step), decodes first."""
        positions = [(r, p) for r, n, s in requests for p in range(s - n, s)]
        slots = np.array([table[r, p // block_size] * block_size + p % block_size
                          for r, p in positions])  # fmt: skip
        at = torch.from_numpy(slots).to(DEVICE)
        key = cache[at // block_size, 0, at % block_size]
        value = cache[at // block_size, 1, at % block_size]  # rewritten as they are
        query = torch.stack([queries[r, p % 8] for r, p in positions])
        inputs = StepAttentionInputs(
            num_decodes=sum(n == 1 for _, n, _ in requests),
            query_lens=np.array([n for _, n, _ in requests]),
            seq_lens=np.array([s for _, _, s in requests]),
            block_table=table[[r for r, _, _ in requests]],
            slot_mapping=slots,
            block_size=block_size,
            device=torch.device(DEVICE),
            dtype=dtype,
        )
        meta = backend.build_metadata(inputs)
        assert meta.num_splits == 1
        return backend.forward(query, key, value, cache, meta, scale=d**-0.5)

    bits = torch.int32 if dtype == torch.float32 else torch.int16
    before = LAUNCHES["combine_splits"]
    decodes = [(r, 1, other_lens[r - 1]) for r in (1, 2, 3)]
    chunk = step(decodes + [(0, 8, context)])[3:].view(bits)
    for i, p in enumerate(range(context - 8, context)):
        beside = [(r, 1, other_lens[r - 1]) for r in range(1, 6)][: 5 * (i % 2)]
        alone = step(beside[:2] + [(0, 1, p + 1)] + beside[2:])[min(2, len(beside))]
        assert torch.equal(alone.view(bits), chunk[i]), p
    assert LAUNCHES["combine_splits"] == before


def test_quantized_triton_matmuls_are_refused(tiny_model, monkeypatch) -> None:
    """Their tiles follow the row count: an engine that would run them in the mode does not
    start (as on CUDA; here the loader is told that Triton runs quantized matmuls)."""
    from tokenmill.worker import model_loader

    monkeypatch.setattr(model_loader, "_triton_matmuls", lambda device: True)
    with pytest.raises(ValueError, match="quantization='int8'"):
        LLM(str(tiny_model("llama-gqa")), quantization="int8", batch_invariant=True,
            skip_tokenizer_init=True, multiprocess=False, attention_backend="TRITON_ATTN",
            device=DEVICE, enforce_eager=True, max_model_len=256)  # fmt: skip
