"""Batch-invariant mode (batch_invariant=True): a request's logits, read as its top-20
log-probabilities and compared as bits, do not depend on what runs beside it: alone or beside
1, 7 and 63 random requests, in prefill chunks of 16 or 64 tokens or whole, after a prefix-cache
hit or not, with async scheduling, under preemption, and at positions verified as n-gram
proposals; in bf16 and fp32, on tokenmill's CPU kernels and on the Triton backend (its
interpreter on the CPU). On the real model: 200 copies of a prompt in mixed batches give one
output, seeded sampling agrees across token budgets and preemption, and n-gram speculation
gives the greedy tokens of no speculation."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.kernels import cpu
from tokenmill.protocol import envs

pytestmark = pytest.mark.slow
# The mode lives in tokenmill's CPU kernels (the torch path without them is not invariant).
needs_kernels = pytest.mark.skipif(
    not envs.TOKENMILL_CPU_KERNELS or not cpu.load(envs.TOKENMILL_CACHE),
    reason="the batch-invariant mode runs on tokenmill's CPU kernels",
)
# bf16 on an AMX CPU: oneDNN's AMX tiles at every row count, not yet seen on one (see
# tests/unit/test_cpu_batch_invariance.py): XPASS there shows they hold.
amx_unverified = pytest.mark.xfail(
    cpu.loaded() and cpu.cpu_isa() >= 3,
    strict=False,
    reason="AMX tiles' row invariance not yet verified on an AMX CPU",
)

TARGET = [3 + (7 * j) % 500 for j in range(150)]  # long enough that decodes split the context
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "auto_disable": False}  # fmt: skip


def others(count: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    found = []
    for _ in range(count):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(4, 220))]
        params = SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(1000),
                                max_tokens=rng.randint(1, 30), ignore_eos=True)  # fmt: skip
        found.append((prompt, params))
    return found


def target_logprobs(path: str, dtype: str, beside: int = 0, prompt: list[int] = TARGET,
                    repeat: bool = False, loras: list | None = None,
                    **engine_args) -> list:  # fmt: skip
    """The target request's sampled tokens and top-20 log-probabilities (as bits), run
    among `beside` others (it goes in the middle of the batch). `loras`: the target runs
    loras[0], the others loras[i % len] in turn (None: the base model)."""
    engine_args.setdefault("max_model_len", 512)
    llm = LLM(path, dtype=dtype, batch_invariant=True, skip_tokenizer_init=True,
              multiprocess=False, **engine_args)  # fmt: skip
    try:
        target = SamplingParams(temperature=0.0, max_tokens=12, logprobs=20, ignore_eos=True)
        batch = others(beside, seed=beside)
        batch.insert(beside // 2, (prompt, target))
        prompts = [{"prompt_token_ids": p} for p, _ in batch]
        params = [p for _, p in batch]
        lora = None
        if loras:
            lora = [loras[(i + 1) % len(loras)] for i in range(beside)]
            lora.insert(beside // 2, loras[0])
        if repeat:  # the first run fills the prefix cache, the second hits it
            llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
        out = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)[beside // 2]
        if repeat:
            assert out.num_cached_tokens > 0
        return [
            (
                token,
                sorted(
                    (i, torch.tensor(lp.logprob).view(torch.int32).item()) for i, lp in step.items()
                ),
            )
            for token, step in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)
        ]
    finally:
        llm.shutdown()


SETTINGS = {
    "beside-1": dict(beside=1),
    "beside-7": dict(beside=7),
    "beside-63": dict(beside=63),
    "chunks-16": dict(beside=7, max_num_batched_tokens=16),
    "chunks-64": dict(beside=7, max_num_batched_tokens=64),
    "prefix-hit": dict(beside=7, repeat=True),
    "no-prefix-caching": dict(beside=7, enable_prefix_caching=False),
    "async": dict(beside=7, async_scheduling=True),
    "preemption": dict(beside=7, num_gpu_blocks_override=40, enable_prefix_caching=False),
    "ngram-verify": dict(beside=7, speculative_config=NGRAM),
}


@pytest.fixture(scope="module")
def alone(tiny_model):
    path = str(tiny_model("llama-gqa"))
    return path, {dtype: target_logprobs(path, dtype) for dtype in ("bfloat16", "float32")}


@needs_kernels
@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=amx_unverified), "float32"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_logits_do_not_depend_on_the_batch(alone, setting: str, dtype: str) -> None:
    path, expected = alone
    assert target_logprobs(path, dtype, **SETTINGS[setting]) == expected[dtype]


@needs_kernels
@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=amx_unverified), "float32"])
def test_a_lora_request_does_not_depend_on_the_batch(tiny_model, tmp_path, dtype: str) -> None:
    """A request under an adapter: the same bits alone and beside 7 others under another
    adapter or none, whole or in 16-token chunks (the LoRA kernels reduce each row alone)."""
    import json

    from helpers import write_lora_adapter

    from tokenmill import LoRARequest

    path = str(tiny_model("llama-gqa"))
    config = json.loads(open(f"{path}/config.json").read())
    loras = [
        LoRARequest("r8", 1, write_lora_adapter(tmp_path / "r8", config, rank=8, seed=1)),
        LoRARequest("r16", 2, write_lora_adapter(tmp_path / "r16", config, rank=16, seed=2)),
        None,
    ]
    lora_args = dict(enable_lora=True, max_loras=2, max_lora_rank=16)
    alone = target_logprobs(path, dtype, loras=loras[:1], **lora_args)
    assert alone != target_logprobs(path, dtype), "the adapter changes nothing"
    for setting in (dict(beside=7), dict(beside=7, max_num_batched_tokens=16)):
        assert target_logprobs(path, dtype, loras=loras, **setting, **lora_args) == alone, setting


# ----------------------------------------------------------------- the real model, in bf16
SMOLLM2 = dict(dtype="bfloat16", batch_invariant=True, multiprocess=False, max_model_len=512)


def smollm2_generate(path: str, prompts, params, **engine_args):
    llm = LLM(path, **{**SMOLLM2, **engine_args})
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)  # fmt: skip
        return [o.outputs[0].token_ids for o in outputs], llm.get_stats()
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def chat_prompts(smollm2_path: str) -> list[list[int]]:
    from helpers import smollm2_prompts
    from transformers import AutoTokenizer

    base = smollm2_prompts(AutoTokenizer.from_pretrained(smollm2_path))
    # 20 prompts: the parity prompts, then each of them shortened.
    return [base[i % len(base)][: None if i < len(base) else -(i // len(base))]
            for i in range(20)]  # fmt: skip


@needs_kernels
@amx_unverified
def test_smollm2_200_copies_in_mixed_batches_give_one_output(smollm2_path, chat_prompts):
    copy = chat_prompts[2]
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    rng = random.Random(5)
    prompts, params = [], []
    for i in range(200):
        prompts.append(copy)
        params.append(greedy)
        if i % 2:  # a request of another length and kind between the copies
            prompts.append(chat_prompts[rng.randrange(20)][: rng.randint(8, 200)])
            params.append(SamplingParams(temperature=0.8, seed=i, max_tokens=rng.randint(4, 40)))
    outputs, _ = smollm2_generate(smollm2_path, prompts, params, max_num_seqs=48,
                                  max_num_batched_tokens=256)  # fmt: skip
    copies = {tuple(o) for o, p in zip(outputs, params) if p is greedy}
    assert len(copies) == 1


@needs_kernels
@amx_unverified
def test_smollm2_seeded_requests_agree_across_budgets_and_preemption(smollm2_path, chat_prompts):
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1000 + i,
                             max_tokens=48) for i in range(20)]  # fmt: skip
    default, _ = smollm2_generate(smollm2_path, chat_prompts, params)
    small, _ = smollm2_generate(smollm2_path, chat_prompts, params, max_num_batched_tokens=64)
    tight, stats = smollm2_generate(smollm2_path, chat_prompts, params, block_size=16,
                                    num_gpu_blocks_override=40)  # fmt: skip
    assert stats["num_preemptions"] > 0, stats
    for other in (small, tight):
        differ = [i for i in range(20) if other[i] != default[i]]
        assert not differ, f"{len(differ)}/20 requests changed: {differ}"


@needs_kernels
@amx_unverified
def test_smollm2_ngram_speculation_keeps_greedy_tokens(smollm2_path, chat_prompts):
    prompts = chat_prompts[:14]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    plain, _ = smollm2_generate(smollm2_path, prompts, params)
    spec, stats = smollm2_generate(smollm2_path, prompts, params, speculative_config=NGRAM)
    assert stats["spec_decode_num_accepted_tokens"] > 0, stats
    differ = [i for i in range(14) if spec[i] != plain[i]]
    assert not differ, f"{len(differ)}/14 prompts changed: {differ}"
