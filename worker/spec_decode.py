"""Speculative decoding in the workers: the n-gram proposer and the rejection sampler.

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

from tokenmill.worker.sampler import Sampler, SamplingMetadata


class NgramProposer:
    """Proposes the k tokens that followed the latest earlier occurrence of the longest
    suffix of a request's tokens (prompt and output) of min_n to max_n tokens.

    Vectorised over the sequence: the positions whose token equals the last one are found
    in one comparison, then narrowed one token further back per length, so a proposal costs
    O(len) numpy work plus O(max_n) small steps, not a Python loop over positions."""

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n

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
    ranks = ranks_within(counts)  # each proposed token's position in its proposal
    draft_rows = np.repeat(starts, counts) + ranks
    x = torch.from_numpy(draft_ids.astype(np.int64)).to(device)
    rows_t = torch.from_numpy(draft_rows).to(device)
    greedy_tokens, probs = sampler.distributions(logits, meta)
    greedy_accept = greedy_tokens[rows_t] == x
    if probs is None:
        accepted, tokens = greedy_accept, greedy_tokens
    else:
        p = probs[rows_t]
        p_x = p.gather(1, x.unsqueeze(1))[:, 0]
        if draft_probs is None:
            q = torch.zeros_like(p).scatter_(1, x.unsqueeze(1), 1.0)
        else:
            q = draft_probs.to(p.dtype)
        q_x = q.gather(1, x.unsqueeze(1))[:, 0]
        u = sampler.uniform(len(draft_rows), meta, draft_rows.tolist(), device)
        accepted = u * q_x < p_x  # u < p / q, with q(x) > 0 for a drawn x
        # Where rejected, the token comes from the residual max(0, p - q) (the race needs
        # no normalizing); elsewhere (the bonus, requests without a proposal) from p.
        weights = probs.clone()
        weights[rows_t] = residual(p, q)
        tokens = sampler.race(weights, meta)
        greedy = meta.temperature == 0.0
        tokens = torch.where(greedy, greedy_tokens, tokens)
        accepted = torch.where(greedy[rows_t], greedy_accept, accepted)
    # Leading accepted proposals per request.
    width = int(counts.max(initial=0))
    grid = torch.zeros(len(counts), max(width, 1), dtype=torch.bool, device=device)
    if len(draft_rows):
        owner = torch.from_numpy(np.repeat(np.arange(len(counts)), counts)).to(device)
        grid[owner, torch.from_numpy(ranks).to(device)] = accepted
    num_accepted = grid.long().cumprod(dim=1).sum(dim=1).cpu().numpy()
    token_list = tokens.cpu().tolist()
    drafts = draft_ids.tolist()
    out, at = [], 0
    for i, k in enumerate(counts.tolist()):
        a = int(num_accepted[i]) if k else 0
        out.append(drafts[at : at + a] + [token_list[int(starts[i]) + a]])
        at += k
    return out


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
