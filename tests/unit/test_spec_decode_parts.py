"""Speculative decoding's parts: the n-gram proposer against a brute-force search, the
rejection sampler's exactness (chi-square over 200,000 draws per case, against the target
distribution computed here), and the scheduler's handling of proposals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_scheduler import EOS, add, make_scheduler

from tokenmill.protocol.config import SpeculativeConfig
from tokenmill.protocol.scheduler_output import ModelRunnerOutput
from tokenmill.worker import spec_decode
from tokenmill.worker.sampler import Sampler, SamplingMetadata
from tokenmill.worker.spec_decode import NgramProposer, rejection_sample


def brute_force_proposal(tokens: list[int], k: int, low: int, high: int) -> list[int]:
    last = len(tokens) - 1
    for n in range(high, low - 1, -1):
        if n > last:
            continue
        suffix = tokens[last - n + 1 :]
        ends = [j for j in range(n - 1, last) if tokens[j - n + 1 : j + 1] == suffix]
        if ends:
            full = [j for j in ends if j + k <= last]
            end = (full or ends)[-1]
            return tokens[end + 1 : end + 1 + k]
    return []


def test_ngram_proposer_matches_a_brute_force_search() -> None:
    rng = np.random.default_rng(0)
    for trial in range(400):
        vocab = int(rng.integers(2, 6))
        tokens = rng.integers(0, vocab, size=int(rng.integers(1, 40))).tolist()
        k, low = int(rng.integers(1, 5)), int(rng.integers(1, 4))
        high = low + int(rng.integers(0, 3))
        got = NgramProposer(k, low, high).propose(np.array(tokens))
        assert got == brute_force_proposal(tokens, k, low, high), (tokens, k, low, high)


def test_ngram_batch_proposals_match_a_brute_force_search() -> None:
    rng = np.random.default_rng(1)
    for trial in range(60):
        k, low = int(rng.integers(1, 5)), int(rng.integers(1, 4))
        high = low + int(rng.integers(0, 3))
        vocab = int(rng.integers(2, 6))
        lengths = rng.integers(1, 40, size=int(rng.integers(8, 20)))  # the batched search
        token_ids = np.zeros((len(lengths), 48), dtype=np.int64)
        rows = []
        for i, n in enumerate(lengths):
            row = rng.integers(0, vocab, size=int(n))
            token_ids[i, :n] = row
            token_ids[i, n:] = rng.integers(0, vocab, size=48 - int(n))  # stale tokens
            rows.append(row.tolist())
        got = NgramProposer(k, low, high).propose_batch(token_ids, lengths)
        assert got == [brute_force_proposal(r, k, low, high) for r in rows], (rows, k, low, high)


def test_ngram_proposer_continues_a_repeated_passage() -> None:
    passage = [5, 6, 7, 8, 9, 10, 11]
    tokens = np.array([1, 2] + passage + [3, 4] + passage[:3])
    assert NgramProposer(3, 2, 4).propose(tokens) == [8, 9, 10]
    assert NgramProposer(3, 4, 4).propose(np.array([1, 2, 3, 1, 2, 3])) == []


def test_speculative_config_defaults_and_errors() -> None:
    spec = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 4})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)
    spec = SpeculativeConfig.from_user('{"prompt_lookup_max": 3}')
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (3, 3)
    with pytest.raises(ValueError, match="speculative_config.method"):
        SpeculativeConfig.from_user({"method": "medusa"})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig.from_user({"num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        SpeculativeConfig.from_user({"prompt_lookup_min": 4, "prompt_lookup_max": 2})
    with pytest.raises(ValueError, match="speculative_config.*'speed'"):
        SpeculativeConfig.from_user({"speed": 1})
    with pytest.raises(ValueError, match="speculative_config.model"):
        SpeculativeConfig.from_user({"method": "draft_model"})


# ------------------------------------------------------------------------ rejection sampler
DRAWS = 200_000
CHUNK = 50_000


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """The target distribution, computed independently of the sampler: temperature, then
    top-k, then the top-p nucleus of what top-k left (the smallest most-likely set whose
    renormalized mass reaches p), as vLLM orders them."""
    probs = (logits.double() / temperature).softmax(-1)
    order = probs.argsort(descending=True).tolist()
    if top_k:
        order = order[:top_k]
    total = float(probs[order].sum())
    keep, mass = [], 0.0
    for token in order:
        if mass >= top_p:
            break
        keep.append(token)
        mass += float(probs[token]) / total
    out = torch.zeros_like(probs)
    out[keep] = probs[keep]
    return out / out.sum()


def metadata(rows: int, temperature: float, top_k: int, top_p: float) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.full((rows,), temperature),
        all_greedy=temperature == 0.0,
        top_k=torch.full((rows,), top_k, dtype=torch.long) if top_k else None,
        top_p=torch.full((rows,), top_p) if top_p < 1 else None,
        min_p=None,
        generators={},
    )


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test of counts against probs: P(chi2(df) >= statistic), the upper
    regularized incomplete gamma function Q(df / 2, statistic / 2)."""
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the target's support was emitted"
    expected = probs[support] * counts.sum()
    statistic = float((((counts[support] - expected) ** 2) / expected).sum())
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(statistic / 2.0)))


def emitted_counts(vocab, logits, draft_logits, temperature, top_k, top_p, k, generator):
    """How often each token is emitted first (and, among steps that accepted the first
    proposal, second), over DRAWS steps of one request verifying k proposals."""
    sampler = Sampler(generator)
    first = np.zeros(vocab, dtype=np.int64)
    second = np.zeros(vocab, dtype=np.int64)
    for _ in range(DRAWS // CHUNK):
        meta = metadata(CHUNK * (k + 1), temperature, top_k, top_p)
        step_logits = logits.repeat(CHUNK, 1)  # [CHUNK * (k + 1), V]: k + 1 positions each
        draft_probs = None
        if draft_logits is None:  # n-gram: fixed proposals, q one-hot
            drafts = np.tile(np.arange(k) % vocab, CHUNK)
        else:
            q = draft_logits.softmax(-1)  # [k, V]
            drafts = torch.multinomial(q, CHUNK, replacement=True, generator=generator).T
            drafts = drafts.reshape(-1).numpy()
            draft_probs = q.repeat(CHUNK, 1)
        emitted = rejection_sample(
            sampler, step_logits, meta, np.full(CHUNK, k), drafts, draft_probs
        )
        first += np.bincount([t[0] for t in emitted], minlength=vocab)
        seconds = [t[1] for t in emitted if len(t) > 1]
        second += np.bincount(seconds, minlength=vocab)
    return first, second


CASES = [  # vocab, temperature, top_k, top_p, proposals, draft model
    (8, 1.0, 0, 1.0, 1, False),
    (50, 0.7, 0, 1.0, 2, False),
    (50, 1.3, 10, 0.9, 2, True),
    (120, 0.8, 40, 0.95, 3, True),
    (300, 1.0, 0, 0.8, 1, False),
]


@pytest.mark.parametrize("vocab,temperature,top_k,top_p,k,draft", CASES)
def test_rejection_sampler_emits_the_target_distribution(
    vocab, temperature, top_k, top_p, k, draft
) -> None:
    generator = torch.Generator().manual_seed(vocab + k)
    logits = torch.randn(k + 1, vocab, generator=generator) * 2
    draft_logits = torch.randn(k, vocab, generator=generator) * 2 if draft else None
    first, second = emitted_counts(
        vocab, logits, draft_logits, temperature, top_k, top_p, k, generator
    )
    want_first = reference_probs(logits[0], temperature, top_k, top_p).numpy()
    assert chi_square_p_value(first, want_first) > 0.001
    if k > 1 and second.sum() > 1000:
        want_second = reference_probs(logits[1], temperature, top_k, top_p).numpy()
        assert chi_square_p_value(second, want_second) > 0.001


@pytest.mark.parametrize("draft", [False, True], ids=["ngram", "draft-model"])
def test_the_test_fails_when_rejected_tokens_are_drawn_from_p(monkeypatch, draft) -> None:
    """Drawing the token after a rejection from p instead of max(0, p - q) over-weights the
    proposed tokens: the same check must then reject the distribution."""
    monkeypatch.setattr(spec_decode, "residual", lambda p, q: p.clone())
    vocab, temperature, top_k, top_p, k = 50, 1.0, 0, 1.0, 1
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(k + 1, vocab, generator=generator) * 2
    draft_logits = torch.randn(k, vocab, generator=generator) * 2 if draft else None
    first, _ = emitted_counts(vocab, logits, draft_logits, temperature, top_k, top_p, k, generator)
    want = reference_probs(logits[0], temperature, top_k, top_p).numpy()
    assert chi_square_p_value(first, want) < 0.001


def test_greedy_verification_accepts_the_argmax_prefix() -> None:
    logits = torch.full((7, 10), -5.0)
    best = [3, 4, 5, 6, 1, 2, 9]  # argmax per row
    logits[torch.arange(7), torch.tensor(best)] = 5.0
    meta = metadata(7, 0.0, 0, 1.0)
    # Request 0: proposals [3, 4, 0] at rows 0-2 (bonus row 3): accepts 3 and 4, then emits
    # row 2's argmax in place of 0. Request 1: no proposal, row 4. Request 2: proposal [2]
    # at row 5, accepted, then the bonus from row 6.
    out = rejection_sample(
        Sampler(torch.Generator()), logits, meta, np.array([3, 0, 1]), np.array([3, 4, 0, 2])
    )
    assert out == [[3, 4, 5], [1], [2, 9]]


# ------------------------------------------------------------------------------ scheduler
def spec_scheduler(k: int = 3, **kwargs):
    scheduler = make_scheduler(**kwargs)
    scheduler.num_spec_tokens = k
    scheduler.spec_accepted_per_pos = [0] * k
    return scheduler


def run_prefill(scheduler, request) -> None:
    out = scheduler.schedule()
    scheduler.update_from_output(
        out,
        ModelRunnerOutput(
            req_ids=[request.request_id],
            sampled_token_ids=[[7]],
            spec_token_ids={request.request_id: [8, 9, 10]},
        ),
    )


def test_a_proposal_is_scheduled_verified_and_rolled_back() -> None:
    scheduler = spec_scheduler()
    request = add(scheduler, 6)
    run_prefill(scheduler, request)
    assert request.num_tokens == 7 and request.spec_token_ids == [8, 9, 10]
    out = scheduler.schedule()
    assert out.num_scheduled_tokens[request.request_id] == 4
    assert out.scheduled_spec_decode_tokens == {request.request_id: [8, 9, 10]}
    assert request.num_computed_tokens == 10
    # The workers accept 8 and 9, and emit 11 in place of 10.
    scheduler.update_from_output(
        out,
        ModelRunnerOutput(req_ids=[request.request_id], sampled_token_ids=[[8, 9, 11]]),
    )
    assert request.output_token_ids == [7, 8, 9, 11]
    assert request.num_computed_tokens == 9 == request.num_tokens - 1
    assert request.num_output_placeholders == 0 and request.spec_token_ids == []
    assert (scheduler.spec_num_drafts, scheduler.spec_num_draft_tokens) == (1, 3)
    assert scheduler.spec_num_accepted_tokens == 2 and scheduler.spec_accepted_per_pos == [1, 1, 0]
    # No proposal now: one token.
    assert scheduler.schedule().num_scheduled_tokens[request.request_id] == 1


def test_a_proposal_stops_at_max_tokens_and_the_budget() -> None:
    scheduler = spec_scheduler(budget=3)
    request = add(scheduler, 2, max_tokens=3)
    run_prefill(scheduler, request)
    out = scheduler.schedule()
    # One output so far, max_tokens 3: the step may emit 2 more, so it verifies 1 proposal.
    assert out.scheduled_spec_decode_tokens == {request.request_id: [8]}
    assert out.num_scheduled_tokens[request.request_id] == 2


def test_a_stop_token_inside_an_accepted_proposal_ends_the_request_there() -> None:
    scheduler = spec_scheduler()
    request = add(scheduler, 4)
    run_prefill(scheduler, request)
    out = scheduler.schedule()
    outputs = scheduler.update_from_output(
        out,
        ModelRunnerOutput(req_ids=[request.request_id], sampled_token_ids=[[8, EOS, 10, 12]]),
    )
    (output,) = outputs.outputs
    assert output.new_token_ids == [8, EOS] and output.finish_reason is not None
    assert request.request_id not in scheduler.requests


def test_no_proposal_beyond_the_batch_size_limit() -> None:
    scheduler = spec_scheduler()
    scheduler.spec_disable_by_batch_size = 1
    a, b = add(scheduler, 4), add(scheduler, 4)
    out = scheduler.schedule()
    scheduler.update_from_output(
        out,
        ModelRunnerOutput(
            req_ids=[a.request_id, b.request_id],
            sampled_token_ids=[[7], [7]],
            spec_token_ids={a.request_id: [1, 2], b.request_id: [3]},
        ),
    )
    out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens == {}
    assert out.total_num_scheduled_tokens == 2


def test_spec_decode_counters_reach_prometheus() -> None:
    from tokenmill.frontend.metrics import PrometheusStatLogger
    from tokenmill.protocol.messages import EngineCoreOutputs, SchedulerStats

    logger = PrometheusStatLogger("m")

    def stats(drafts: int, proposed: int, accepted: int, per_pos: list[int]):
        return EngineCoreOutputs(scheduler_stats=SchedulerStats(
            spec_decode_num_drafts=drafts,
            spec_decode_num_draft_tokens=proposed,
            spec_decode_num_accepted_tokens=accepted,
            spec_decode_num_accepted_tokens_per_pos=per_pos,
        ))  # fmt: skip

    logger.on_outputs(stats(2, 6, 3, [2, 1, 0]))
    logger.on_outputs(stats(5, 15, 9, [5, 3, 1]))  # running totals: counters take the news
    value = logger.registry.get_sample_value
    labels = {"model_name": "m", "engine": "0"}
    assert value("tokenmill:spec_decode_num_drafts_total", labels) == 5
    assert value("tokenmill:spec_decode_num_draft_tokens_total", labels) == 15
    assert value("tokenmill:spec_decode_num_accepted_tokens_total", labels) == 9
    per_pos = "tokenmill:spec_decode_num_accepted_tokens_per_pos_total"
    assert [value(per_pos, {**labels, "position": str(p)}) for p in range(3)] == [5, 3, 1]
