"""Speculative decoding in the workers: the n-gram proposer (one of worker/proposer.py's)
and the rejection sampler.

A request that speculates is scheduled for 1 + k tokens: its last sampled token, then k
proposed ones. The forward gives the target's logits at all 1 + k positions; position j
scores proposal j (j < k), and position k scores the token after the whole proposal.
`rejection_sample` then accepts proposals in order, as Leviathan et al. (and vLLM's
rejection sampler): proposal x_j, drawn from the proposer's q_j, is accepted with probability
min(1, p_j(x_j) / q_j(x_j)), p_j being the target's distribution after temperature, top-k,
top-p and min-p; at the first rejection the token is drawn from norm(max(0, p_j - q_j)) and
the step ends there; when all are accepted, a bonus token is drawn from p_k. Every emitted
token is then distributed exactly as p. An n-gram proposal is deterministic: q is one-hot.
A greedy request accepts while the proposal is the target's argmax and emits the argmax at
the first mismatch (or as the bonus), which is its greedy output with or without speculation.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.protocol.config import EngineConfig
from tokenmill.worker.input_batch import InputBatch
from tokenmill.worker.proposer import Proposer
from tokenmill.worker.sampler import Sampler, SamplingMetadata, first_arg
from tokenmill.worker.staging import to_device

# From this many requests on, the n-gram search runs on the whole batch at once (on 2 cores:
# 0.2 ms against 0.3 for 16 requests of ~600 tokens, 4.4 against 7.8 ms for 256 of ~1,100).
_BATCH_FROM = 8


class NgramProposer(Proposer):
    """Proposes the k tokens that followed the latest earlier occurrence of the longest
    suffix of a request's tokens (prompt and output) of min_n to max_n tokens.

    Vectorised over the sequence: the positions whose token equals the last one are found
    in one comparison, then narrowed one token further back per length, so a proposal costs
    O(len) numpy work plus O(max_n) small steps, not a Python loop over positions."""

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n

    @classmethod
    def from_config(cls, config: EngineConfig, device: torch.device) -> NgramProposer:
        spec = config.speculative_config
        assert spec is not None
        assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
        return cls(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)

    def propose_rows(self, batch: InputBatch, rows: np.ndarray) -> list[list[int]]:
        num_tokens = batch.num_tokens[rows]
        return self.propose_batch(batch.token_ids[rows, : int(num_tokens.max())], num_tokens)

    def propose(self, tokens: np.ndarray, k: int | None = None) -> list[int]:
        k = self.k if k is None else k
        last = len(tokens) - 1
        if last < self.min_n or k <= 0:
            return []
        # Ends j (< last) of matches of the suffix's last `length` tokens.
        ends = np.flatnonzero(tokens[:last] == tokens[last])
        best = ends if self.min_n <= 1 else None
        length = 1
        while ends.size and length < self.max_n:
            length += 1
            ends = ends[ends >= length - 1]
            ends = ends[tokens[ends - (length - 1)] == tokens[last - (length - 1)]]
            if ends.size and length >= self.min_n:
                best = ends
        if best is None or not best.size:
            return []
        # The latest match that is followed by k known tokens, else the latest.
        full = best[best + k <= last]
        end = int(full[-1] if full.size else best[-1])
        return tokens[end + 1 : end + 1 + k].tolist()

    def propose_batch(self, token_ids: np.ndarray, num_tokens: np.ndarray) -> list[list[int]]:
        """`propose` for many requests at once (row i: token_ids[i, :num_tokens[i]]): one
        comparison finds, in every row, the positions holding its last token; the (row,
        position) candidates are then narrowed one token further back per length, for the
        whole batch at once, instead of a Python call per request."""
        k, rows = self.k, len(num_tokens)
        if rows < _BATCH_FROM:  # (a few requests: their own searches cost less)
            return [self.propose(token_ids[i, : num_tokens[i]]) for i in range(rows)]
        width = int(num_tokens.max())
        tokens = token_ids[:, :width]
        last = num_tokens - 1
        at = np.arange(rows)
        before = np.arange(width)[None, :] < last[:, None]
        r, j = np.nonzero(before & (tokens == tokens[at, last][:, None]))
        best_r, best_j = (r, j) if self.min_n <= 1 else (r[:0], j[:0])
        for length in range(2, self.max_n + 1):
            if not len(r):
                break
            shift = length - 1
            keep = j >= shift
            r, j = r[keep], j[keep]
            same = tokens[r, j - shift] == tokens[r, last[r] - shift]
            r, j = r[same], j[same]
            if length >= self.min_n and len(r):
                # These rows' matches are now longer: they replace the shorter ones.
                found = np.zeros(rows, dtype=bool)
                found[r] = True
                old = ~found[best_r]
                best_r = np.concatenate((best_r[old], r))
                best_j = np.concatenate((best_j[old], j))
        short = last[best_r] < self.min_n
        best_r, best_j = best_r[~short], best_j[~short]
        # Per row the latest match followed by k known tokens, else the latest.
        latest = np.full(rows, -1)
        np.maximum.at(latest, best_r, best_j)
        full = best_j + k <= last[best_r]
        latest_full = np.full(rows, -1)
        np.maximum.at(latest_full, best_r[full], best_j[full])
        end = np.where(latest_full >= 0, latest_full, latest)
        stop = np.minimum(end + 1 + k, num_tokens)
        return [
            tokens[i, end[i] + 1 : stop[i]].tolist() if end[i] >= 0 else [] for i in range(rows)
        ]


def rejection_sample(
    sampler: Sampler,
    logits: torch.Tensor,
    meta: SamplingMetadata,
    num_drafts: np.ndarray,
    draft_ids: np.ndarray,
    draft_probs: torch.Tensor | None = None,
) -> list[list[int]]:
    """The tokens each request emits. Request i owns num_drafts[i] + 1 consecutive rows of
    `logits` and `meta` (its proposal's positions, then the bonus position); draft_ids holds
    the proposals back to back; draft_probs their proposer's distributions [sum(k), V] (None:
    deterministic proposals, q one-hot). A request with no proposal emits one ordinary sample.
    """
    device = logits.device
    counts = num_drafts.astype(np.int64)
    starts = np.concatenate(([0], np.cumsum(counts + 1)[:-1]))
    x = to_device(draft_ids.astype(np.int64), device)
    greedy_tokens, probs = sampler.distributions(logits, meta)
    if probs is None:  # all greedy: accept while the proposal is the argmax
        num_accepted, tokens = _accept_greedy(greedy_tokens, x, counts, starts)
    else:
        ranks = ranks_within(counts)
        draft_rows = (np.repeat(starts, counts) + ranks).tolist()
        # The draws, each from its request's stream: one uniform per proposed token, then
        # the race's log-uniforms for every row.
        u = sampler.uniform(len(draft_rows), meta, draft_rows, device)
        log_u = sampler.log_uniform(probs, meta)
        cu = to_device(np.concatenate(([0], np.cumsum(counts))), device)
        greedy = meta.temperature[to_device(starts, device)] == 0.0
        recover = accept_and_recover_reference
        if device.type == "cuda":
            from tokenmill.kernels.rejection import accept_and_recover as recover
        q = None if draft_probs is None else draft_probs.float()
        num_accepted, tokens = recover(probs, log_u, greedy_tokens, greedy, x, cu, q, u)
    accepted_list, token_list = num_accepted.tolist(), tokens.tolist()
    drafts = draft_ids.tolist()
    out, at = [], 0
    for i, k in enumerate(counts.tolist()):
        a = accepted_list[i]
        out.append(drafts[at : at + a] + [token_list[i]])
        at += k
    return out


def _accept_greedy(
    greedy_tokens: torch.Tensor, x: torch.Tensor, counts: np.ndarray, starts: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    device = greedy_tokens.device
    ranks = ranks_within(counts)
    rows = to_device(np.repeat(starts, counts) + ranks, device)
    num_accepted = _leading(greedy_tokens[rows] == x, counts, ranks)
    last = to_device(starts, device) + num_accepted
    return num_accepted, greedy_tokens[last]


def _leading(accepted: torch.Tensor, counts: np.ndarray, ranks: np.ndarray) -> torch.Tensor:
    """Per request, how many of its proposals lead its list unbroken by a rejection."""
    device = accepted.device
    width = int(counts.max(initial=0))
    grid = torch.zeros(len(counts), max(width, 1), dtype=torch.bool, device=device)
    if len(accepted):
        owner = to_device(np.repeat(np.arange(len(counts)), counts), device)
        grid[owner, to_device(ranks, device)] = accepted
    return grid.long().cumprod(dim=1).sum(dim=1)


def accept_and_recover_reference(
    probs: torch.Tensor,
    log_u: torch.Tensor,
    greedy_tokens: torch.Tensor,
    greedy: torch.Tensor,
    draft_ids: torch.Tensor,
    cu_drafts: torch.Tensor,
    q: torch.Tensor | None,
    u: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path (and the Triton kernel's reference, kernels/rejection.py): per request
    (its rows back to back in probs, k + 1 each), the proposals accepted and its last token.
    A sampled request accepts proposal x with probability min(1, p(x) / q(x)), a greedy one
    while x is the argmax; its last token comes from the first rejected position's residual
    max(0, p - q) (p at the bonus position) by the race argmin(w / log U), or is the argmax."""
    device = probs.device
    counts = (cu_drafts[1:] - cu_drafts[:-1]).cpu().numpy()
    starts = np.concatenate(([0], np.cumsum(counts + 1)[:-1]))
    ranks = ranks_within(counts)
    rows = to_device(np.repeat(starts, counts) + ranks, device)
    x = draft_ids[: len(rows)].unsqueeze(1)
    p = probs[rows]
    p_x = p.gather(1, x)[:, 0]
    if q is None:
        q = torch.zeros_like(p).scatter_(1, x, 1.0)
    q_x = q.gather(1, x)[:, 0]
    owner = to_device(np.repeat(np.arange(len(counts)), counts), device)
    is_greedy = greedy[owner]
    accepted = torch.where(is_greedy, greedy_tokens[rows] == x[:, 0], u * q_x < p_x)
    num_accepted = _leading(accepted, counts, ranks)
    # Where rejected, the token comes from the residual max(0, p - q) (the race needs no
    # normalizing); elsewhere (the bonus, requests without a proposal) from p.
    weights = probs.clone()
    weights[rows] = residual(p, q)
    race = first_arg(weights.div_(log_u), largest=False)
    last = to_device(starts, device) + num_accepted
    return num_accepted, torch.where(greedy, greedy_tokens[last], race[last])


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What a rejected position draws from: max(0, p - q), unnormalized."""
    return (p - q).clamp_(min=0.0)


def ranks_within(counts: np.ndarray) -> np.ndarray:
    """0, 1, ..., c - 1 for every count c, back to back."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(np.cumsum(counts) - counts, counts)
    return np.arange(total, dtype=np.int64) - offsets
