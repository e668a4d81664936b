"""Beam search with vLLM's semantics, run over ordinary one-token requests.

Each step asks the engine for one token per live beam with `2 * beam_width` logprobs; every
candidate (beam + token) is scored, the best `beam_width` that did not end in EOS live on,
and those that did are set aside as completed. Beams share their prompt and common prefix
through the prefix cache, so a step recomputes only each beam's newest token. The score is
vLLM's: cumulative logprob / (length ** length_penalty), the length counting the prompt and
not a final EOS. `LLM.beam_search` drives it synchronously, the server's `use_beam_search`
from the event loop; both only feed `BeamSearch` the engine's outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.frontend.outputs import Logprob, RequestOutput
from tokenmill.protocol.messages import RequestOutputKind, SamplingParams


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be a positive integer, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")


@dataclass
class BeamSearchSequence:
    """One beam: the prompt and its tokens so far, with their logprobs."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


def beam_search_score(
    tokens: list[int], cum_logprob: float, eos_token_ids: frozenset[int], length_penalty: float
) -> float:
    length = len(tokens) - (1 if tokens and tokens[-1] in eos_token_ids else 0)
    return cum_logprob / (length**length_penalty)


class BeamSearch:
    """One prompt's search: `live()` are the beams to extend this step (none once done),
    `advance()` takes one engine output per live beam, `result()` the best beams."""

    def __init__(
        self,
        prompt_token_ids: list[int],
        params: BeamSearchParams,
        eos_token_ids: frozenset[int],
        max_model_len: int,
    ) -> None:
        self.params = params
        self.eos = eos_token_ids
        self.prompt_len = len(prompt_token_ids)
        self.limit = min(self.prompt_len + params.max_tokens, max_model_len)
        self.beams = [BeamSearchSequence(list(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []

    def step_params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=1,
            logprobs=2 * self.params.beam_width,
            temperature=self.params.temperature,
            ignore_eos=True,  # EOS is a candidate like any other token here
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def live(self) -> list[BeamSearchSequence]:
        return self.beams if all(len(b.tokens) < self.limit for b in self.beams) else []

    def _score(self, beam: BeamSearchSequence) -> float:
        penalty = self.params.length_penalty
        return beam_search_score(beam.tokens, beam.cum_logprob, self.eos, penalty)

    def advance(self, outputs: list[RequestOutput]) -> None:
        candidates = []
        for beam, out in zip(self.beams, outputs, strict=True):
            if out.error is not None:
                raise ValueError(f"beam search step failed: {out.error}")
            entry = out.outputs[0].logprobs[0]  # type: ignore[index]
            for token_id, lp in entry.items():
                grown = BeamSearchSequence(
                    beam.tokens + [token_id], beam.logprobs + [entry], beam.cum_logprob + lp.logprob
                )
                if token_id in self.eos and not self.params.ignore_eos:
                    grown.finish_reason = "stop"
                    self.completed.append(grown)
                else:
                    candidates.append(grown)
        candidates.sort(key=self._score, reverse=True)
        self.beams = candidates[: self.params.beam_width]

    def result(self, tokenizer: object | None = None) -> BeamSearchOutput:
        for beam in self.beams:
            beam.finish_reason = beam.finish_reason or "length"
        best = sorted(self.completed + self.beams, key=self._score, reverse=True)
        best = best[: self.params.beam_width]
        for beam in best:
            if tokenizer is not None:
                beam.text = tokenizer.decode(beam.tokens)  # type: ignore[attr-defined]
        return BeamSearchOutput(best)
