"""The Sampler: logits of the rows that complete a request's step -> one token each.

Order, as in vLLM: min_tokens masking of stop tokens, then greedy argmax for temperature 0;
for the rest temperature, top-k, top-p, min-p, and an exponential race (argmax of p / q with
q ~ Exp(1)), which draws exactly like multinomial sampling. A request with a `seed` draws its
q from its own generator, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [R] fp32; rows of greedy requests hold 0
    all_greedy: bool
    top_k: torch.Tensor | None  # [R] int64, 0 = off; None when no row uses it
    top_p: torch.Tensor | None  # [R] fp32, 1 = off
    min_p: torch.Tensor | None  # [R] fp32, 0 = off
    generators: dict[int, torch.Generator]  # row -> the request's own generator
    # rows still under min_tokens -> token ids they may not sample yet
    banned_token_ids: dict[int, list[int]]


class Sampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator  # for requests without a seed

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        # max() finds the first maximum like argmax(), and is faster on the CPU.
        if meta.all_greedy and not meta.banned_token_ids:
            # Upcasting is exact: 16-bit logits have the argmax of their fp32 copy.
            return logits.max(dim=-1).indices
        logits = logits.float()
        if meta.banned_token_ids:
            logits = logits.clone()  # the caller's logits stay as they were
        for row, token_ids in meta.banned_token_ids.items():
            logits[row, token_ids] = float("-inf")
        greedy_tokens = logits.max(dim=-1).indices
        if meta.all_greedy:
            return greedy_tokens
        greedy = meta.temperature == 0.0
        temperature = torch.where(greedy, torch.ones_like(meta.temperature), meta.temperature)
        logits = logits / temperature.unsqueeze(1)
        if meta.top_k is not None or meta.top_p is not None:
            logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        probs = logits.softmax(dim=-1)
        if meta.min_p is not None:
            threshold = meta.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        q = torch.empty_like(probs)
        q.exponential_(generator=self.generator)
        for row, generator in meta.generators.items():
            q[row].exponential_(generator=generator)
        sampled = (probs / q).argmax(dim=-1)
        return torch.where(greedy, greedy_tokens, sampled)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Masks with -inf every logit outside each row's top-k, then outside its top-p nucleus
    (the smallest set of most likely tokens whose probability reaches p)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        sorted_logits = sorted_logits.masked_fill(before >= top_p.unsqueeze(1), float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
