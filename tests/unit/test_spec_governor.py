"""The speculation governor against simulated step costs: where speculation is slower it
runs without almost all the time (so a setting never costs much more than speculation off),
where it is faster it runs with it, it follows a workload that changes, and a batch size it
has not seen starts from what a smaller one learned."""

from __future__ import annotations

import random

from tokenmill.core.sched.spec_governor import MAX_INTERVAL, SpeculationGovernor, size_class


class Simulated:
    """A step of `batch` requests: without speculation 1 token each in `base` seconds; with
    it `tokens_on` tokens each in `base * cost_on`; the first step after a switch to
    speculation verifies nothing yet and pays `switch` steps more (a draft catching up)."""

    def __init__(self, tokens_on: float, cost_on: float, switch: float = 1.0, noise=0.1):
        self.tokens_on, self.cost_on, self.switch, self.noise = tokens_on, cost_on, switch, noise
        self.rng = random.Random(0)
        self.last = False

    def step(self, batch: int, on: bool) -> tuple[int, float]:
        jitter = 1.0 + self.rng.uniform(-self.noise, self.noise)
        base = 0.01 * (1 + batch / 8) * jitter
        if on and not self.last:  # nothing to verify yet
            tokens, seconds = batch, base * (self.cost_on + self.switch)
        elif on:
            tokens, seconds = round(batch * self.tokens_on), base * self.cost_on
        else:
            tokens, seconds = batch, base
        self.last = on
        return tokens, seconds


def run(governor, sim, batch: int, steps: int) -> tuple[int, float, int]:
    """Steps with speculation, seconds, tokens."""
    on_steps, seconds, tokens = 0, 0.0, 0
    for _ in range(steps):
        on = governor.decide(batch)
        t, s = sim.step(batch, on)
        governor.record(batch, on, t, s)
        on_steps += on
        seconds += s
        tokens += t
    return on_steps, seconds, tokens


def test_speculation_that_is_slower_runs_almost_never() -> None:
    # A draft model that is rarely right: 1.05 tokens per step at 1.5x the cost (0.7x).
    governor, sim = SpeculationGovernor(), Simulated(tokens_on=1.05, cost_on=1.5)
    on_steps, seconds, tokens = run(governor, sim, batch=4, steps=2000)
    off_rate = 4 / (0.01 * 1.5)  # tokens per second without speculation, noise aside
    assert on_steps < 0.05 * 2000
    assert tokens / seconds > 0.95 * off_rate * 0.97  # (the noise's mean is 0; its spread)


def test_speculation_that_is_much_slower_is_probed_rarely() -> None:
    # 0.33x: every probe step costs two steps; probes stay near 2% of the time.
    governor, sim = SpeculationGovernor(), Simulated(tokens_on=1.0, cost_on=3.0, switch=2.0)
    on_steps, seconds, tokens = run(governor, sim, batch=16, steps=3000)
    assert on_steps < 0.015 * 3000
    assert seconds < 1.05 * 3000 * 0.01 * (1 + 16 / 8)  # all 3000 without speculation


def test_a_costly_switch_to_speculation_makes_probes_rarer() -> None:
    # 0.33x, and every switch back costs 30 steps more (a draft catching up on a long pause).
    governor, sim = SpeculationGovernor(), Simulated(tokens_on=1.0, cost_on=3.0, switch=30.0)
    on_steps, seconds, tokens = run(governor, sim, batch=16, steps=3000)
    assert seconds < 1.05 * 3000 * 0.01 * (1 + 16 / 8)  # all 3000 without speculation


def test_speculation_that_pays_runs_almost_always() -> None:
    # 3 tokens per step at 1.2x the cost: 2.5x.
    governor, sim = SpeculationGovernor(), Simulated(tokens_on=3.0, cost_on=1.2)
    on_steps, seconds, tokens = run(governor, sim, batch=1, steps=2000)
    assert on_steps > 0.9 * 2000
    assert tokens / seconds > 2.3 * (1 / (0.01 * 1.125))


def test_the_governor_follows_a_workload_that_changes() -> None:
    governor = SpeculationGovernor()
    run(governor, Simulated(tokens_on=3.0, cost_on=1.2), batch=2, steps=300)
    assert governor.decide(2)
    # The answers stop repeating the prompt: speculation now loses.
    on_steps, _, _ = run(governor, Simulated(tokens_on=1.0, cost_on=1.2), batch=2, steps=600)
    assert on_steps < 0.2 * 600
    tail, _, _ = run(governor, Simulated(tokens_on=1.0, cost_on=1.2), batch=2, steps=300)
    assert tail < 0.15 * 300
    # And back.
    on_steps, _, _ = run(governor, Simulated(tokens_on=3.0, cost_on=1.2), batch=2, steps=600)
    assert on_steps > 0.8 * 600


def test_a_new_batch_size_starts_from_a_smaller_ones_off() -> None:
    governor = SpeculationGovernor()
    run(governor, Simulated(tokens_on=1.0, cost_on=2.0), batch=1, steps=100)
    assert not governor.decide(1)
    # Never measured at 16: speculation starts off there, and is probed later.
    assert not governor.decide(16)
    on_steps, _, _ = run(governor, Simulated(tokens_on=1.0, cost_on=2.0), batch=16, steps=400)
    assert 0 < on_steps < 0.05 * 400
    # A smaller class where speculation pays says nothing about larger ones: 32 measures.
    other = SpeculationGovernor()
    run(other, Simulated(tokens_on=3.0, cost_on=1.1), batch=1, steps=100)
    assert other.decide(32)


def test_size_classes() -> None:
    assert [size_class(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 1, 2, 2, 3, 3, 4, 4, 5]


def test_proposals_never_accepted_stop_the_probing_at_every_batch_size() -> None:
    """A draft whose proposals are never accepted: after a first measurement at one request,
    larger batches start off without measuring and probe only every MAX_INTERVAL steps, even
    where speculation is barely slower and a switch cheap (which would be probed every ~60
    steps), so each runs within 2% of the time off."""
    governor = SpeculationGovernor()

    def steps(sim, batch: int, n: int, accepted: int) -> tuple[int, float]:
        on_steps, seconds = 0, 0.0
        for _ in range(n):
            on = governor.decide(batch)
            verifies = on and sim.last  # (a switch's first step has nothing to verify)
            t, s = sim.step(batch, on)
            governor.record(batch, on, t, s)
            for _ in range(batch if verifies else 0):
                governor.verified(accepted)
            on_steps += on
            seconds += s
        return on_steps, seconds

    useless = Simulated(tokens_on=1.0, cost_on=1.05, switch=1.0)
    steps(useless, 1, 200, accepted=0)
    assert governor.hopeless()
    for batch in (2, 4, 8, 16):
        assert not governor.decide(batch)  # no measuring first
        on_steps, seconds = steps(useless, batch, 3000, accepted=0)
        off = Simulated(tokens_on=1.0, cost_on=1.05, noise=0.0)
        plain = sum(off.step(batch, False)[1] for _ in range(3000))
        assert on_steps <= 2 * 4, (batch, on_steps)  # at most one probe in 3000 steps
        assert seconds < 1.02 * plain, (batch, seconds / plain)
    # Proposals accepted again bring the probes back to their measured interval.
    assert governor.classes[size_class(16)].interval(governor.hopeless()) == MAX_INTERVAL
    for _ in range(200):
        governor.verified(2)
    assert not governor.hopeless()
    assert governor.classes[size_class(16)].interval(governor.hopeless()) < MAX_INTERVAL
