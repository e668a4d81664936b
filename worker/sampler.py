"""The Sampler: logits of the rows that complete a request's step -> one token each.

Order, as in vLLM: the features' adjustments of the logits (worker/sample/: allowed_token_ids,
bans of stop tokens under min_tokens and of bad words, logit_bias, the penalties), then
greedy argmax for temperature 0; for the rest temperature, min-p, top-k, top-p, and an
exponential race (argmax of p / q with q ~ Exp(1)), which draws exactly like multinomial
sampling. A request with a `seed` draws its q from its own
generator, so its tokens do not depend on what else is in the batch. Everything is batched on
the device; rows without a feature pay nothing for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tokenmill.kernels import cpu

if TYPE_CHECKING:
    from tokenmill.worker.sample.base import LogitsAdjustment


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [R] fp32; rows of greedy requests hold 0
    all_greedy: bool
    top_k: torch.Tensor | None  # [R] int64, 0 = off; None when no row uses it
    top_p: torch.Tensor | None  # [R] fp32, 1 = off
    min_p: torch.Tensor | None  # [R] fp32, 0 = off
    generators: dict[int, torch.Generator]  # row -> the request's own generator
    # The features' changes to the logits (worker/sample/), in the order they apply.
    adjustments: list[LogitsAdjustment] = field(default_factory=list)

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.adjustments)


class Sampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator  # for requests without a seed

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        greedy_tokens, probs = self.distributions(logits, meta)
        if probs is None:
            return greedy_tokens
        return torch.where(meta.temperature == 0.0, greedy_tokens, self.race(probs, meta))

    def distributions(
        self, logits: torch.Tensor, meta: SamplingMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every row's greedy token (after the adjustments) and, unless every row is greedy,
        its distribution to sample from (temperature, min-p, top-k, top-p applied; a greedy
        request's row holds its distribution at temperature 1, unused)."""
        if meta.all_greedy and not meta.adjusts_logits:
            # Upcasting is exact: 16-bit logits have the argmax of their fp32 copy.
            return first_arg(logits, largest=True), None
        if meta.adjusts_logits:
            # On a copy: the caller's logits stay as they were.
            logits = logits.clone() if logits.dtype == torch.float32 else logits.float()
            apply_adjustments(logits, meta)
        else:
            logits = logits.float()
        greedy_tokens = first_arg(logits, largest=True)
        if meta.all_greedy:
            return greedy_tokens, None
        greedy = meta.temperature == 0.0
        temperature = torch.where(greedy, torch.ones_like(meta.temperature), meta.temperature)
        logits = logits / temperature.unsqueeze(1)
        if meta.min_p is not None:
            # Relative to the most likely token of the full distribution (before top-k/p).
            probs = logits.softmax(dim=-1)
            threshold = meta.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        if meta.top_k is not None or meta.top_p is not None:
            logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        return greedy_tokens, logits.softmax(dim=-1)

    def race(
        self, probs: torch.Tensor, meta: SamplingMetadata, rows: list[int] | None = None
    ) -> torch.Tensor:
        """One token per row of `probs` (unnormalized weights will do), drawn exactly as
        multinomial sampling: the race argmax(p / q), q ~ Exp(1) = -log(U), taken as
        argmin(p / log U) in place (probs is overwritten). `rows`: the rows of `meta` that
        probs' rows are (default: the same), for their generators."""
        log_u = self._draws(probs, meta, rows, _log_uniform)
        return first_arg(probs.div_(log_u), largest=False)

    def log_uniform(self, like: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The race's draws for every row of `like` (log U: minus Exp(1) draws), each row
        from its request's stream."""
        return self._draws(like, meta, None, _log_uniform)

    def uniform(
        self, num: int, meta: SamplingMetadata, rows: list[int], device: torch.device
    ) -> torch.Tensor:
        """One U[0, 1) draw for each of `rows` (rows of meta), from its request's stream."""
        out = torch.empty(num, 1, device=device)
        return self._draws(out, meta, rows, lambda t, g: t.uniform_(generator=g))[:, 0]

    def _draws(self, like: torch.Tensor, meta: SamplingMetadata, rows, fill) -> torch.Tensor:
        """A tensor shaped like `like`, row i filled by fill(row, generator) from the
        generator of meta row rows[i] (seeded requests) or the shared one."""
        out = torch.empty_like(like)
        if rows is None:
            seeded = meta.generators
        else:
            seeded = {i: meta.generators[r] for i, r in enumerate(rows) if r in meta.generators}
        if len(seeded) < out.shape[0]:
            fill(out, self.generator)
        for row, generator in seeded.items():  # in row order: a request's draws in turn
            fill(out[row], generator)
        return out


_ARG_CHUNK = 1024


def first_arg(x: torch.Tensor, largest: bool) -> torch.Tensor:
    """argmax (or argmin) over the last dimension of [R, V], the first of equal extremes, as
    torch's: on the CPU tokenmill's kernel where it is loaded (csrc/argmax.cpp, two
    vectorized passes a row), else `first_arg_native`."""
    if x.device.type == "cpu" and x.dtype in _KERNEL_DTYPES and x.shape[-1] and cpu.loaded():
        return torch.ops.tokenmill.first_extreme(x, largest)
    return first_arg_native(x, largest)


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def first_arg_native(x: torch.Tensor, largest: bool) -> torch.Tensor:
    """`first_arg` in torch ops. On the CPU torch's reduction with an index is not vectorized
    (3.9 ms for 256 x 49152 on two cores); this takes the extreme of every chunk of 1024
    (amax is vectorized), then the first chunk holding the row's extreme, then the first
    position of it in that chunk: 1.2 ms."""
    rows, vocab = x.shape
    num_chunks = vocab // _ARG_CHUNK
    if x.device.type != "cpu" or num_chunks < 2:
        return x.argmax(dim=-1) if largest else x.argmin(dim=-1)
    extreme = torch.amax if largest else torch.amin
    whole = num_chunks * _ARG_CHUNK
    chunks = extreme(x[:, :whole].reshape(rows, num_chunks, _ARG_CHUNK), dim=-1)
    if vocab > whole:
        chunks = torch.cat([chunks, extreme(x[:, whole:], dim=-1, keepdim=True)], dim=1)
    chunk = chunks.argmax(dim=-1) if largest else chunks.argmin(dim=-1)
    # Past the vocabulary, the last chunk repeats the last column: never an earlier first.
    index = chunk.unsqueeze(1) * _ARG_CHUNK + torch.arange(_ARG_CHUNK)
    window = x.gather(1, index.clamp_(max=vocab - 1))
    return chunk * _ARG_CHUNK + (window.argmax(dim=-1) if largest else window.argmin(dim=-1))


def _log_uniform(out: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Fills `out` with log(U), U ~ Uniform[tiny, 1): minus an Exp(1) draw, always < 0. On
    the CPU this is about 6x faster than `exponential_` (which draws element by element: 45 ms
    for 64 x 49152 on two cores, against 7 ms); a U of exactly 0 (one in 2^24) becomes the
    smallest normal float, so the value stays finite and that token merely loses the race."""
    return out.uniform_(generator=generator).clamp_(min=torch.finfo(out.dtype).tiny).log_()


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
        # Only rows that ask (top_p < 1): a row of 1.0 beside them would lose the tail whose
        # cumulative sum rounds to 1 (and its draws would depend on its neighbours).
        outside = (before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_adjustments(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """The features' adjustments (allowed tokens, bans, logit bias, penalties, ...), in place
    on fp32 logits [R, V]."""
    for adjustment in meta.adjustments:
        adjustment.apply(logits)
