"""n > 1 (parallel sampling) and streaming output kinds: n children in the core sharing the
prompt's blocks through the prefix cache, child i seeded with seed + i, one RequestOutput with
n completions; cumulative, delta and final-only streams; aborting a parent aborts its
children."""

from __future__ import annotations

import asyncio
import time

import pytest
from helpers import PROMPTLY_S

from tokenmill import LLM, AsyncLLM, SamplingParams
from tokenmill.protocol.messages import RequestOutputKind

PROMPT = {"prompt_token_ids": [(7 * j) % 500 + 3 for j in range(70)]}  # 4 full blocks + 6


@pytest.fixture(scope="module")
def llm(tiny_model):
    engine = LLM(
        str(tiny_model("llama-gqa")),
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=32 << 20,
        dtype="float32",  # the runs compared batch differently (bf16 rounds by batch shape)
    )
    yield engine
    engine.shutdown()


def test_n4_seeded_is_reproducible_distinct_and_shares_the_prompt(llm: LLM) -> None:
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=20, ignore_eos=True)
    llm.reset_prefix_cache()
    before = llm.get_stats()
    first = llm.generate(PROMPT, params, use_tqdm=False)
    after = llm.get_stats()
    assert len(first) == 1
    completions = first[0].outputs
    assert [c.index for c in completions] == [0, 1, 2, 3]
    tokens = [c.token_ids for c in completions]
    assert all(len(t) == 20 for t in tokens)
    assert len({tuple(t) for t in tokens}) == 4, "the children sampled alike"
    # The prompt's 4 full blocks were computed once: the other 3 children hit them.
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    assert hits == 3 * 64, hits
    again = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs
    assert [c.token_ids for c in again] == tokens
    # Child i is the single request with seed 11 + i.
    single = SamplingParams(temperature=1.0, seed=13, max_tokens=20, ignore_eos=True)
    assert llm.generate(PROMPT, single, use_tqdm=False)[0].outputs[0].token_ids == tokens[2]


def test_n_greedy_with_others_in_one_batch(llm: LLM) -> None:
    params = [
        SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    ]
    outputs = llm.generate([PROMPT, PROMPT], params, use_tqdm=False)
    assert [len(o.outputs) for o in outputs] == [3, 1]
    greedy = outputs[1].outputs[0].token_ids
    assert all(c.token_ids == greedy for c in outputs[0].outputs)
    for n in (0, 1025, 2**63):  # each sample is an engine request: n is bounded
        with pytest.raises(ValueError, match=r"n must be an integer in \[1, 1024\]"):
            SamplingParams(n=n)


def test_async_output_kinds_and_parent_abort(tiny_model) -> None:
    engine = AsyncLLM(
        str(tiny_model("llama-gqa")),
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=32 << 20,
        dtype="float32",  # the runs compared batch differently (bf16 rounds by batch shape)
    )

    def params(kind: RequestOutputKind, max_tokens: int = 12) -> SamplingParams:
        return SamplingParams(
            n=2, temperature=1.0, seed=3, max_tokens=max_tokens, ignore_eos=True, output_kind=kind
        )

    async def collect(kind: RequestOutputKind, request_id: str) -> list:
        return [o async for o in engine.generate(PROMPT, params(kind), request_id=request_id)]

    async def main() -> None:
        cumulative = await collect(RequestOutputKind.CUMULATIVE, "c")
        delta = await collect(RequestOutputKind.DELTA, "d")
        final = await collect(RequestOutputKind.FINAL_ONLY, "f")
        full = [c.token_ids for c in cumulative[-1].outputs]
        assert cumulative[-1].finished and len(cumulative) > 2
        assert all(len(o.outputs) == 2 for o in cumulative)
        # The deltas add up to the whole completions, and none repeats a token.
        joined: dict[int, list[int]] = {0: [], 1: []}
        for out in delta:
            for c in out.outputs:
                joined[c.index].extend(c.token_ids)
        assert [joined[0], joined[1]] == full
        assert len(final) == 1 and [c.token_ids for c in final[0].outputs] == full
        # Aborting a parent stops both children in the core.
        stream = engine.generate(PROMPT, params(RequestOutputKind.DELTA, 400), request_id="a")
        await stream.__anext__()
        await engine.abort("a")
        deadline = time.monotonic() + PROMPTLY_S
        while True:
            stats = await engine.get_stats()
            if stats["num_running"] == stats["num_waiting"] == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_bad_requests_fail_alone(llm: LLM) -> None:
    with pytest.raises(ValueError, match="seed must be"):
        SamplingParams(n=2, seed=2**63 - 1)
    with pytest.raises(ValueError, match="bad_words_token_ids must be"):
        SamplingParams(bad_words_token_ids=[[]])
    # Token ids outside the vocabulary that only the core can see fail that request only.
    params = [
        SamplingParams(max_tokens=4, bad_words_token_ids=[[3, 600]]),
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
    ]
    bad, good = llm.generate([PROMPT, PROMPT], params, use_tqdm=False)
    assert bad.outputs[0].finish_reason == "error" and "outside [0, 512)" in bad.error
    assert len(good.outputs[0].token_ids) == 4
