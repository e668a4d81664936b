"""When speculative decoding pays: the governor that turns it off where it does not.

A speculative step verifies 1 + k tokens per request and runs the proposer; it pays when the
tokens it accepts outweigh what the longer forward and the proposer cost. That depends on
the workload (how often proposals are right) and on the batch size (at one request a decode
reads the weights for one token, so verifying k more is nearly free; at many requests the
step is bound by compute, and each verified token costs nearly as much as a decoded one).
Neither is known ahead, so the governor measures both modes and runs the faster.

Per class of batch size (requests decoding: 1, 2, 3-4, 5-8, ...) it keeps the output tokens
per second of steps with speculation and without, over decode-only steps (a prefill chunk
in the step would swamp the difference) whose mode is the same as the step before's (a
switch costs a transition step: the first speculative step after a pause has no proposals
to verify yet, and a draft model first catches up on the tokens it missed). The figures are
decayed sums, so they follow the workload. The slower mode is tried again now and then, for
`PROBE_STEPS` steps, at an interval chosen so that probing costs about `PROBE_COST` of the
time: a mode twice as slow is probed rarely, a close one often, and a switch to speculation
that costs a long catch-up (a draft model's, after a pause) makes the probes rarer still.

A class without measurements takes the nearest smaller measured class's choice when that
choice is "off" (speculation that loses at a batch size loses at larger ones: verifying
costs more there and saves fewer steps), and the switch cost measured there; otherwise it
measures speculation first.

Proposals that are almost never accepted cannot pay at any batch size: a speculative step
emits at most 1 + (accepted tokens per proposal) tokens per request where a plain one emits
1, and costs at least as much. While fewer than `MIN_ACCEPTED` tokens per proposal are
accepted (a decayed mean over the proposals verified), classes start off without measuring
and probe only every `MAX_INTERVAL` steps, which is where the acceptance is measured again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_SAMPLES = 3  # steady steps of each mode before a class chooses
PROBE_STEPS = 4  # steps of a probe: one transition, then steady ones
PROBE_COST = 0.02  # the share of time probes may lose
MIN_INTERVAL = 16
MAX_INTERVAL = 4096
DECAY = 0.8  # per sample: the figures follow the last several steps of each mode
MIN_ACCEPTED = 0.05  # accepted tokens per proposal below which speculation cannot pay
MIN_PROPOSALS = 3  # proposals verified before that is judged (a first measurement's)
ACCEPT_DECAY = 0.98  # per proposal: the acceptance follows the last ~50 proposals


@dataclass
class _Class:
    tokens: list[float] = field(default_factory=lambda: [0.0, 0.0])  # [off, on]
    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0])
    samples: list[int] = field(default_factory=lambda: [0, 0])
    choice: bool | None = None  # None: still measuring
    probe_left: int = 0
    since_probe: int = 0
    # How much slower the other mode is, from a smaller class, until this one measures it.
    prior_loss: float = 0.0
    # What a switch to speculation costs beyond a step without it (a draft catching up on
    # the tokens of the pause), in such steps: decayed over the switches measured.
    switch_steps: float = 0.0
    switches: int = 0

    def rate(self, on: bool) -> float | None:
        s = self.seconds[on]
        return self.tokens[on] / s if self.samples[on] and s > 0 else None

    def loss(self) -> float:
        """Extra time per step of the mode not chosen, in steps of the chosen one."""
        fast, slow = self.rate(bool(self.choice)), self.rate(not self.choice)
        if not fast or not slow:
            return self.prior_loss
        return max(fast / slow - 1.0, 0.0)

    def interval(self, hopeless: bool = False) -> int:
        """Steps between probes, so that a probe's loss is about PROBE_COST of the time
        (hopeless: proposals are almost never accepted, so the longest interval)."""
        if hopeless and self.choice is False:
            return MAX_INTERVAL
        switch = self.switch_steps if self.choice is False else 0.0
        steps = (PROBE_STEPS * self.loss() + switch) / PROBE_COST
        return int(min(MAX_INTERVAL, max(MIN_INTERVAL, steps)))


def size_class(batch_size: int) -> int:
    """0 for 1 request, 1 for 2, 2 for 3-4, 3 for 5-8, ..."""
    return max(0, batch_size - 1).bit_length()


class SpeculationGovernor:
    def __init__(self) -> None:
        self.classes: dict[int, _Class] = {}
        self.last_mode: bool | None = None  # the last recorded step's
        # Decayed sums over the proposals verified: how many, and their accepted tokens.
        self.proposals = 0.0
        self.accepted = 0.0
        self.num_proposals = 0

    def verified(self, num_accepted: int) -> None:
        """A request's proposal was verified and `num_accepted` of its tokens accepted."""
        self.proposals = self.proposals * ACCEPT_DECAY + 1.0
        self.accepted = self.accepted * ACCEPT_DECAY + num_accepted
        self.num_proposals += 1

    def hopeless(self) -> bool:
        """Whether proposals are so rarely accepted that speculation cannot pay."""
        return self.num_proposals >= MIN_PROPOSALS and self.accepted < MIN_ACCEPTED * self.proposals

    def _class(self, batch_size: int) -> _Class:
        key = size_class(batch_size)
        c = self.classes.get(key)
        if c is None:
            c = self.classes[key] = _Class()
            smaller = [k for k in self.classes if k < key and self.classes[k].choice is not None]
            if smaller and self.classes[max(smaller)].choice is False:
                c.choice = False
                c.prior_loss = self.classes[max(smaller)].loss()
                c.switch_steps = self.classes[max(smaller)].switch_steps
            elif self.hopeless():
                c.choice = False
        return c

    def decide(self, batch_size: int) -> bool:
        """Whether the step being scheduled for `batch_size` decoding requests proposes
        tokens (which its next step verifies)."""
        c = self._class(batch_size)
        if c.choice is None:
            # Measuring: speculation first, then without.
            if c.samples[True] < MIN_SAMPLES:
                return True
            if c.samples[False] < MIN_SAMPLES:
                return False
            c.choice = self._faster(c)
        if c.probe_left:
            c.probe_left -= 1
            if not c.probe_left:  # the probe's figures are in: choose again
                c.choice = self._faster(c)
                c.since_probe = 0
            return not c.choice
        c.since_probe += 1
        if c.since_probe >= c.interval(self.hopeless()):
            c.probe_left = PROBE_STEPS
            c.since_probe = 0
        return c.choice

    @staticmethod
    def _faster(c: _Class) -> bool:
        on, off = c.rate(True), c.rate(False)
        if on is None or off is None:
            return on is not None or off is None
        return on >= off

    def record(self, batch_size: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A decode-only step that ran (`speculated`: it proposed tokens), its output tokens
        and its duration. Only a step in the same mode as the one before counts."""
        steady = self.last_mode == speculated
        switched_on = self.last_mode is False and speculated
        self.last_mode = speculated
        if seconds <= 0:
            return
        c = self._class(batch_size)
        if switched_on and (off := c.rate(False)):
            plain = tokens / off  # what the step would take without speculation
            extra = max(seconds - plain, 0.0) / plain
            c.switch_steps = (
                extra if not c.switches else c.switch_steps * DECAY + extra * (1 - DECAY)
            )
            c.switches += 1
        if not steady:
            return
        c.tokens[speculated] = c.tokens[speculated] * DECAY + tokens
        c.seconds[speculated] = c.seconds[speculated] * DECAY + seconds
        c.samples[speculated] += 1

    def interrupt(self) -> None:
        """A step that is not decode-only ran: the next step is no steady sample."""
        self.last_mode = None
