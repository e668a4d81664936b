"""Drives the real Scheduler and KV cache manager with a fake executor (random tokens, no
model) and draws what happened, step by step, as a self-contained HTML/SVG page.

Scenarios:
  continuous  ample KV blocks, requests arriving over time (continuous batching)
  preemption  3 blocks of 10 tokens: requests must be preempted and recomputed
  prefix      a shared 64-token system prompt: prefix-cache hits
It also measures the scheduler's own overhead: microseconds per schedule() +
update_from_output() with 256 running requests.

    python scripts/simulate_scheduler.py --out out/simulator
"""

from __future__ import annotations

import argparse
import html
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.core.request import Request
from tokenmill.core.sched.scheduler import Scheduler
from tokenmill.protocol.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from tokenmill.protocol.messages import EngineCoreRequest, SamplingParams
from tokenmill.protocol.scheduler_output import ModelRunnerOutput, SchedulerOutput

VOCAB = 32000


@dataclass
class Arrival:
    step: int
    prompt: list[int]
    max_tokens: int


@dataclass
class Scenario:
    name: str
    title: str
    num_blocks: int
    block_size: int
    budget: int
    max_num_seqs: int
    arrivals: list[Arrival]


@dataclass
class StepRecord:
    scheduled: dict[str, int]  # request -> tokens this step
    new: set[str]  # first scheduled (or resumed) this step
    hits: dict[str, int]  # request -> prefix-cache hit tokens at admission
    preempted: set[str]
    finished: set[str]
    blocks_used: int
    waiting: int


@dataclass
class Trace:
    scenario: Scenario
    steps: list[StepRecord] = field(default_factory=list)
    order: list[str] = field(default_factory=list)


def make_config(num_blocks: int, block_size: int, budget: int, max_num_seqs: int) -> EngineConfig:
    max_len = (num_blocks - 1) * block_size
    model = ModelConfig(
        model="simulated",
        tokenizer="simulated",
        dtype="float32",
        seed=0,
        max_model_len=max_len,
        architecture="none",
        vocab_size=VOCAB,
        hidden_size=1,
        intermediate_size=1,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_kv_heads=1,
        head_size=1,
        max_position_embeddings=max_len,
        eos_token_ids=(),
    )
    return EngineConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
        parallel_config=ParallelConfig(),
        device_config=DeviceConfig(),
        load_config=LoadConfig(),
    )


class FakeExecutor:
    """Samples a random token for every request whose tokens are all computed."""

    def __init__(self, scheduler: Scheduler, seed: int = 0) -> None:
        self.scheduler = scheduler
        self.rng = random.Random(seed)

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            done = request.num_computed_tokens >= request.num_tokens
            sampled.append([self.rng.randrange(VOCAB)] if done else [])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def make_request(req_id: str, prompt: list[int], max_tokens: int, max_len: int) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(EngineCoreRequest(req_id, prompt, params, [], time.time()), max_len)


def simulate(scenario: Scenario, max_steps: int = 2000) -> Trace:
    config = make_config(
        scenario.num_blocks, scenario.block_size, scenario.budget, scenario.max_num_seqs
    )
    scheduler = Scheduler(config, scenario.num_blocks)
    executor = FakeExecutor(scheduler)
    trace = Trace(scenario)
    pending = sorted(enumerate(scenario.arrivals), key=lambda x: x[1].step)
    preempted_before = 0
    for step in range(max_steps):
        while pending and pending[0][1].step <= step:
            i, arrival = pending.pop(0)
            req_id = f"r{i}"
            trace.order.append(req_id)
            scheduler.add_request(
                make_request(req_id, arrival.prompt, arrival.max_tokens, scheduler.max_model_len)
            )
        if not scheduler.has_unfinished_requests():
            if not pending:
                break
            trace.steps.append(StepRecord({}, set(), {}, set(), set(), 0, 0))
            continue
        running_before = {r.request_id for r in scheduler.running}
        out = scheduler.schedule()
        preempted = running_before - {r.request_id for r in scheduler.running}
        new_ids = {r.req_id for r in out.scheduled_new_reqs}
        hits = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        outputs = scheduler.update_from_output(out, executor.execute_model(out))
        finished = {o.request_id for o in outputs.outputs if o.finished}
        assert scheduler.num_preemptions - preempted_before == len(preempted)
        preempted_before = scheduler.num_preemptions
        pool = scheduler.kv_cache_manager.block_pool
        trace.steps.append(
            StepRecord(
                scheduled=dict(out.num_scheduled_tokens),
                new=new_ids,
                hits=hits,
                preempted=preempted,
                finished=finished,
                blocks_used=pool.num_blocks - 1 - pool.num_free_blocks,
                waiting=scheduler.num_waiting,
            )
        )
    return trace


def scenarios(seed: int = 0) -> list[Scenario]:
    rng = random.Random(seed)
    continuous = [
        Arrival(
            step=int(i * 1.5),
            prompt=_tokens(rng, rng.randint(20, 160)),
            max_tokens=rng.randint(8, 40),
        )
        for i in range(30)
    ]
    preemption = [
        Arrival(step=0, prompt=_tokens(rng, rng.randint(4, 8)), max_tokens=rng.randint(6, 12))
        for _ in range(4)
    ]
    system = _tokens(rng, 64)
    prefix = [
        Arrival(
            step=i, prompt=system + _tokens(rng, rng.randint(8, 40)), max_tokens=rng.randint(8, 24)
        )
        for i in range(16)
    ]
    return [
        Scenario(
            "continuous",
            "Continuous batching: ample KV, requests arriving over time",
            num_blocks=400,
            block_size=16,
            budget=256,
            max_num_seqs=32,
            arrivals=continuous,
        ),
        Scenario(
            "preemption",
            "Forced preemption: 3 KV blocks of 10 tokens",
            num_blocks=4,
            block_size=10,
            budget=64,
            max_num_seqs=8,
            arrivals=preemption,
        ),
        Scenario(
            "prefix",
            "Prefix caching: a shared 64-token system prompt",
            num_blocks=200,
            block_size=16,
            budget=128,
            max_num_seqs=16,
            arrivals=prefix,
        ),
    ]


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


# ------------------------------------------------------------------------------- drawing
def render(trace: Trace) -> str:
    """One SVG: a row per request (cells = tokens scheduled per step), KV usage below."""
    sc, steps = trace.scenario, trace.steps
    cell, row, left, top = 9, 12, 40, 20
    width = left + cell * len(steps) + 20
    grid_h = row * len(trace.order)
    chart_h = 80
    height = top + grid_h + 30 + chart_h + 30
    max_tokens = max((n for s in steps for n in s.scheduled.values()), default=1)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="monospace" font-size="9">'
    ]
    for y, req_id in enumerate(trace.order):
        parts.append(f'<text x="2" y="{top + y * row + 9}">{req_id}</text>')
    for x, s in enumerate(steps):
        px = left + x * cell
        if x % 10 == 0:
            parts.append(f'<text x="{px}" y="{top - 6}">{x}</text>')
        for y, req_id in enumerate(trace.order):
            py = top + y * row
            tip = None
            if req_id in s.scheduled:
                n = s.scheduled[req_id]
                decode = n == 1 and req_id not in s.new
                shade = 0.35 + 0.65 * n / max_tokens
                color = "#2e7d32" if decode else f"rgba(21,101,192,{shade:.2f})"
                tip = f"step {x}: {req_id} {n} tokens" + (" (decode)" if decode else "")
                if s.hits.get(req_id):
                    color = "#f9a825"
                    tip += f", {s.hits[req_id]} tokens from the prefix cache"
                parts.append(
                    f'<rect x="{px}" y="{py}" width="{cell - 1}" height="{row - 2}" fill="{color}">'
                    f"<title>{html.escape(tip)}</title></rect>"
                )
            if req_id in s.preempted:
                parts.append(
                    f'<rect x="{px}" y="{py}" width="{cell - 1}" height="{row - 2}" fill="#c62828">'
                    f"<title>step {x}: {req_id} preempted</title></rect>"
                )
            if req_id in s.finished:
                parts.append(f'<text x="{px + 1}" y="{py + 9}" fill="#fff">✓</text>')
    base = top + grid_h + 30 + chart_h
    usable = sc.num_blocks - 1
    parts.append(f'<text x="2" y="{base - chart_h - 6}">KV blocks in use (of {usable})</text>')
    points = " ".join(
        f"{left + x * cell + cell / 2:.1f},{base - chart_h * s.blocks_used / usable:.1f}"
        for x, s in enumerate(steps)
    )
    parts.append(f'<line x1="{left}" y1="{base}" x2="{width - 20}" y2="{base}" stroke="#999"/>')
    parts.append(f'<polyline points="{points}" fill="none" stroke="#6a1b9a" stroke-width="1.5"/>')
    parts.append("</svg>")
    return "".join(parts)


def summary(trace: Trace) -> str:
    steps = trace.steps
    preemptions = sum(len(s.preempted) for s in steps)
    hits = sum(sum(s.hits.values()) for s in steps)
    busiest = max((len(s.scheduled) for s in steps), default=0)
    return (
        f"{len(trace.order)} requests, {len(steps)} steps, up to {busiest} requests in one step, "
        f"{preemptions} preemptions, {hits} prompt tokens served from the prefix cache"
    )


def write_page(traces: list[Trace], path: Path) -> None:
    legend = (
        '<p><span style="background:#1565c0;color:#fff">&nbsp;prefill chunk&nbsp;</span> '
        '(darker = more tokens) <span style="background:#2e7d32;color:#fff">&nbsp;decode&nbsp;'
        '</span> <span style="background:#f9a825">&nbsp;admitted with a prefix-cache hit&nbsp;'
        '</span> <span style="background:#c62828;color:#fff">&nbsp;preempted&nbsp;</span> '
        "✓ finished. Hover a cell for details.</p>"
    )
    body = [f"<h1>tokenmill scheduler simulation</h1>{legend}"]
    for trace in traces:
        body.append(f"<h2>{html.escape(trace.scenario.title)}</h2><p>{summary(trace)}</p>")
        body.append(render(trace))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>tokenmill scheduler</title>"
        "</head><body style='font-family:sans-serif'>" + "".join(body) + "</body></html>"
    )


# ------------------------------------------------------------------------------ overhead
def measure_overhead(num_requests: int = 256, steps: int = 200) -> float:
    """Microseconds per schedule() + update_from_output() with num_requests decoding."""
    scheduler = Scheduler(make_config(40000, 16, 8192, num_requests), 40000)
    executor = FakeExecutor(scheduler)
    rng = random.Random(0)
    for i in range(num_requests):
        request = make_request(f"r{i}", _tokens(rng, 128), 10**6, scheduler.max_model_len)
        scheduler.add_request(request)
    while scheduler.num_waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running
    ):
        out = scheduler.schedule()
        scheduler.update_from_output(out, executor.execute_model(out))
    outputs = []
    elapsed = 0.0
    for _ in range(steps):
        start = time.perf_counter()
        out = scheduler.schedule()
        elapsed += time.perf_counter() - start
        runner_output = executor.execute_model(out)  # the fake model is not the scheduler
        start = time.perf_counter()
        outputs.append(scheduler.update_from_output(out, runner_output))
        elapsed += time.perf_counter() - start
    assert scheduler.num_running == num_requests
    return elapsed / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("out/simulator"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    traces = [simulate(s) for s in scenarios(args.seed)]
    for trace in traces:
        print(f"{trace.scenario.name:>10}: {summary(trace)}")
    page = args.out / "scheduler_timeline.html"
    write_page(traces, page)
    print(f"wrote {page}")
    overhead = measure_overhead()
    print(
        f"scheduler overhead: {overhead:.0f} us per schedule() + update_from_output() "
        f"with 256 running requests"
    )


if __name__ == "__main__":
    main()
