"""SamplingParams validation, the sampler's filters against brute-force references, and
seeded sampling that does not depend on the rest of the batch."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.worker.sample.base import Bans
from tokenmill.worker.sampler import (
    Sampler,
    SamplingMetadata,
    apply_top_k_top_p,
    first_arg,
    first_arg_native,
)


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("seed", 2**63),
        ("seed", -(2**63) - 1),
        ("truncation_side", "middle"),
        ("n", 0),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("allowed_token_ids", []),
        ("bad_words", [" "]),
        ("logprobs", -2),
        ("prompt_logprobs", -5),
    ],
)
def test_invalid_sampling_params_name_field_and_value(field: str, value) -> None:
    with pytest.raises(ValueError, match=f"{field} must be .*got {value!r}".replace("[", r"\[")):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_rejected() -> None:
    with pytest.raises(ValueError, match="min_tokens must be <= max_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)


def test_sampling_params_defaults_match_vllm() -> None:
    params = SamplingParams(stop="x", top_k=-1)
    assert params.stop == ["x"] and params.top_k == 0 and params.max_tokens == 16
    assert params.temperature == 1.0 and not params.greedy
    assert SamplingParams(temperature=0).greedy


def brute_force_allowed(logits: torch.Tensor, k: int, p: float) -> set[int]:
    """Tokens that survive top-k then top-p, by enumeration over the sorted vocabulary."""
    order = sorted(range(len(logits)), key=lambda i: -float(logits[i]))
    if k > 0:
        order = order[:k]
    probs = torch.softmax(logits[order], dim=0).tolist()
    allowed, mass = set(), 0.0
    for token, prob in zip(order, probs):
        if mass >= p:
            break
        allowed.add(token)
        mass += prob
    return allowed


def test_top_k_top_p_match_brute_force() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    ks = [0, 1, 5, 50, 3, 0]
    ps = [1.0, 1.0, 0.9, 0.5, 0.3, 0.05]
    masked = apply_top_k_top_p(logits.clone(), torch.tensor(ks), torch.tensor(ps))
    for row in range(6):
        kept = set(torch.nonzero(masked[row] > float("-inf")).flatten().tolist())
        assert kept == brute_force_allowed(logits[row], ks[row], ps[row]), row
        assert torch.equal(masked[row][list(kept)], logits[row][list(kept)])


def test_top_p_leaves_rows_without_it_whole() -> None:
    """A row of top_p = 1 beside one of 0.5 keeps every token, also the tail whose cumulative
    probability rounds to 1 in fp32 (one dominant token, 999 of about 2e-9 each)."""
    logits = torch.zeros(2, 1000)
    logits[:, 7] = 20.0
    masked = apply_top_k_top_p(logits.clone(), None, torch.tensor([1.0, 0.5]))
    assert torch.equal(masked[0], logits[0])
    assert torch.nonzero(masked[1] > float("-inf")).flatten().tolist() == [7]


def test_top_logprobs_in_the_batch_invariant_mode_break_ties_by_token_id() -> None:
    """In the mode a row's top n do not depend on the largest k of its step: ties (bf16
    logits have many) come in token order, so the first 2 of a top 5 are the top 2."""
    from tokenmill.kernels.batch_invariant import set_batch_invariant
    from tokenmill.worker.model_runner import compute_logprobs

    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 3.0, 1.0, 3.0, 2.0]])
    chosen = torch.tensor([2])
    set_batch_invariant(True)  # (tests/conftest.py turns it off after each test)
    five, two = compute_logprobs(logits, chosen, 5), compute_logprobs(logits, chosen, 2)
    assert five.token_ids[0].tolist() == [2, 1, 3, 4, 6, 7]  # the chosen one, then the top 5
    assert two.token_ids[0].tolist() == [2, 1, 3]
    assert five.ranks[0] == two.ranks[0] == 7  # tokens at least as likely as token 2
    lse = torch.logsumexp(logits[0], 0)
    assert five.logprobs[0][1] == pytest.approx((logits[0, 1] - lse).item(), abs=1e-6)


def _meta(rows: int, **kwargs) -> SamplingMetadata:
    defaults = dict(
        temperature=torch.ones(rows),
        all_greedy=False,
        top_k=None,
        top_p=None,
        min_p=None,
        generators={},
    )
    defaults.update(kwargs)
    return SamplingMetadata(**defaults)


def test_sampler_greedy_min_p_and_banned_tokens() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.9, -1.0], [3.0, 0.0, 0.0, 0.0], [1.0, 1.0, 9.0, 1.0]])
    sampler = Sampler(torch.Generator().manual_seed(0))
    meta = _meta(3, temperature=torch.tensor([0.0, 0.0, 0.0]), all_greedy=True)
    assert sampler(logits, meta).tolist() == [1, 0, 2]
    banned = _meta(3, temperature=torch.zeros(3), all_greedy=True, adjustments=[Bans({2: [2]})])
    assert sampler(logits, banned).tolist()[2] != 2
    # min_p=0.5 keeps only tokens at least half as likely as the best: row 1 keeps token 0.
    meta = _meta(3, min_p=torch.tensor([0.0, 0.5, 0.5]))
    for _ in range(20):
        tokens = sampler(logits, meta).tolist()
        assert tokens[1] == 0 and tokens[2] == 2


def test_sampler_follows_the_distribution() -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log().expand(4000, 4).contiguous()
    sampler = Sampler(torch.Generator().manual_seed(0))
    tokens = sampler(logits, _meta(4000))
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_model) -> None:
    llm = LLM(
        str(tiny_model("llama-gqa")),
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=16 << 20,
        dtype="float32",  # bf16 rounds by batch shape; this is about the sampler's seeds
    )
    try:
        target = {"prompt_token_ids": [5, 6, 7, 8, 9]}
        seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24)
        alone = llm.generate(target, seeded, use_tqdm=False)[0].outputs[0].token_ids
        others = [{"prompt_token_ids": list(range(10, 10 + n))} for n in (3, 40, 120)]
        crowd = [SamplingParams(temperature=1.0, max_tokens=30)] * 2 + [
            SamplingParams(temperature=0.7, seed=99, max_tokens=10)
        ]
        mixed = llm.generate(others + [target], crowd + [seeded], use_tqdm=False)
        assert mixed[-1].outputs[0].token_ids == alone
        again = llm.generate([target, target], [seeded, seeded], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [alone, alone]
        # A different seed gives a different completion (24 tokens from a 512-token vocab).
        other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=4321, max_tokens=24)
        assert llm.generate(target, other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone
    finally:
        llm.shutdown()


def test_min_p_applies_before_top_p_as_in_vllm() -> None:
    # p = [0.5, 0.3, 0.2]. min_p=0.5 first drops token 2 (0.2 < 0.25); top_p=0.6 over the
    # renormalized [0.625, 0.375] then keeps token 0 alone. (The other order keeps 0 and 1.)
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log().expand(200, 3).contiguous()
    meta = _meta(200, min_p=torch.full((200,), 0.5), top_p=torch.full((200,), 0.6))
    tokens = Sampler(torch.Generator().manual_seed(0))(logits, meta)
    assert tokens.unique().tolist() == [0]


def _extreme_rows(vocab: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(33, vocab, generator=g).to(dtype)
    x[0, 0] = x[0, -1] = 50.0  # a tie across the first and the last chunk: the first wins
    x[1, -1] = 50.0  # the maximum in the ragged last chunk
    x[2, 1024:2048] = -50.0  # the minimum fills a whole chunk
    x[3, vocab // 2] = float("inf")
    x[4, vocab // 3] = -float("inf")
    ties = torch.randint(0, 3, (8, vocab), generator=g).to(dtype)  # ties everywhere
    zeros = torch.zeros(2, vocab, dtype=dtype)
    zeros[0, vocab // 2] = -0.0  # -0 and +0 are equal: the first position wins
    zeros[1, 0] = -0.0
    nans = torch.randn(3, vocab, generator=g).to(dtype)
    nans[0, vocab - 1] = float("nan")  # a NaN is the extreme either way: its first position
    nans[1, vocab // 2] = nans[1, vocab // 4] = float("nan")
    nans[2, 0] = float("nan")
    return [x, ties, zeros, nans]


@pytest.mark.parametrize("vocab", [7, 2048, 49152, 50257])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_arg_equals_torch_argmax_and_argmin(vocab: int, dtype: torch.dtype) -> None:
    for t in _extreme_rows(vocab, dtype):
        assert torch.equal(first_arg_native(t, largest=True), t.argmax(dim=-1))
        assert torch.equal(first_arg_native(t, largest=False), t.argmin(dim=-1))
        assert torch.equal(first_arg(t, largest=True), t.argmax(dim=-1))
        assert torch.equal(first_arg(t, largest=False), t.argmin(dim=-1))


@pytest.mark.parametrize("vocab", [1, 7, 49152, 50257])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_first_extreme_kernel_equals_torch_argmax_and_argmin(
    kernels, isa, vocab: int, dtype: torch.dtype
) -> None:
    """csrc/argmax.cpp, which first_arg runs where the kernels are loaded, at each instruction
    set level this CPU has."""
    for t in _extreme_rows(vocab, dtype):
        assert torch.equal(torch.ops.tokenmill.first_extreme(t, True), t.argmax(dim=-1))
        assert torch.equal(torch.ops.tokenmill.first_extreme(t, False), t.argmin(dim=-1))
