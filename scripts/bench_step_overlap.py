"""Fake-model step benchmark: how much of a step is the engine's own CPU work.

Runs the real EngineCore in this process (Scheduler, KV cache manager, ModelRunner with its
input preparation, attention metadata, sampler over the model's full vocabulary, output
building) with only the model swapped for one whose forward takes a set time without holding
the GIL (a sleep, as the seed's §9 simulator fakes the model) and whose logits are a fixed
random tensor. At 1, 64 and 256 running requests (decoding, prompts of 16 tokens) and forward
times of 0.5, 2 and 10 ms it prints steps per second and the per-step split: schedule,
prepare, forward, logits, sample, update, and output (encoding the step's EngineCoreOutputs as
the engine-core process does before sending them), and the step's host-to-device traffic:
KiB and copies, as a CUDA run would copy them (worker/staging.py counts them; with
`--executor uni` only, the worker then being in this process).

With every stage run in turn, a step takes about forward + CPU work; async scheduling
(scheduling step N+1 while step N runs) brings it towards max(forward, CPU work). The worker
runs on a thread of the core's process (`--executor uni`) or in a process of its own
(`--executor mp`, MultiprocExecutor; its stages then include the step's transport). "cpu work"
is the sum of the CPU stages (all but forward and wait), "vs max" the step's time over
max(forward, cpu work); "wait" is how long the core waited for the worker (async only). With
async scheduling the worker prepares the next step while this one's forward runs, as on CUDA
(see TOKENMILL_OVERLAP_STEPS), but forward, logits and sample still follow one another (the
next forward needs the sampled tokens), so a step takes at least their sum.

    python scripts/bench_step_overlap.py [--requests 1 64 256] [--forward-ms 0.5 2 10]
        [--temperature 1.0] [--top-k 0] [--top-p 1.0] [--seeded]
        [--async-scheduling off on] [--executor uni mp] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ["TOKENMILL_STEP_TIMING"] = "1"  # the engine times its stages (read at start-up)
# The fake forward leaves the CPU free, as a GPU's does: with async scheduling the workers
# overlap their steps as they do on CUDA (TOKENMILL_OVERLAP_STEPS=0 keeps them in turn).
os.environ.setdefault("TOKENMILL_OVERLAP_STEPS", "1")

import torch  # noqa: E402

from tokenmill.core.engine_core import EngineCore  # noqa: E402
from tokenmill.core.executor import multiproc  # noqa: E402
from tokenmill.protocol.codec import Encoder  # noqa: E402
from tokenmill.protocol.config import EngineArgs  # noqa: E402
from tokenmill.protocol.messages import EngineCoreRequest, SamplingParams  # noqa: E402
from tokenmill.worker.model_runner import ModelRunner  # noqa: E402
from tokenmill.worker.staging import H2D  # noqa: E402

CONFIG = Path(__file__).parent / "configs" / "smollm2-135m"
STAGES = ("schedule", "prepare", "forward", "logits", "sample", "update", "output", "wait")


class SleepingModel(torch.nn.Module):
    """Stands in for the model: a forward that sleeps (releasing the GIL, as a GPU forward
    leaves the CPU free) and logits from a fixed random tensor of the real vocabulary."""

    def __init__(self, real: torch.nn.Module, hidden_size: int, vocab_size: int,
                 device: torch.device, dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__()
        self.forward_s = 0.0
        self.hidden = torch.zeros(8192, hidden_size, device=device, dtype=dtype)
        logits = torch.randn(512, vocab_size, generator=torch.Generator().manual_seed(0))
        self.logits = logits.to(device, dtype)
        # Written afresh every step, as a model's logits are, but into memory already mapped
        # (a fresh 50 MB tensor per step costs page faults that vary from run to run).
        self.out = torch.empty_like(self.logits)
        self.real = [real]  # kept (not as a submodule): its layers own the KV cache views

    def attention_layers(self) -> list:  # the KV cache is sized and allocated for the real one
        return self.real[0].attention_layers()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        time.sleep(self.forward_s)
        return self.hidden[: input_ids.shape[0]]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[0]  # (a copy: the sampler may change them in place)
        return self.out[:n].copy_(self.logits[:n])


_FORWARD_MS = "BENCH_FAKE_FORWARD_MS"  # how long the fake forward sleeps, in every process
_load_model = ModelRunner.load_model


def _load_sleeping_model(runner: ModelRunner) -> None:
    """ModelRunner.load_model, then the model swapped for the fake (in whichever process
    the worker lives)."""
    _load_model(runner)
    config = runner.config.model_config
    fake = SleepingModel(runner.model, config.hidden_size, config.vocab_size, runner.device,
                         runner.dtype)  # fmt: skip
    fake.forward_s = float(os.environ[_FORWARD_MS]) / 1000
    runner.model = fake


_start_module = multiproc.start_module


def _start_fake_worker(module: str, args, config, env=None):
    """Starts worker processes through this script, which installs the fake model first."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                      env.get("PYTHONPATH")]))  # fmt: skip
    return _start_module("bench_step_overlap", ["--as-worker", module, *args], config, env)


def make_core(max_requests: int, async_scheduling: bool, executor: str,
              forward_ms: float) -> EngineCore:  # fmt: skip
    os.environ[_FORWARD_MS] = str(forward_ms)
    ModelRunner.load_model = _load_sleeping_model  # type: ignore[method-assign]
    multiproc.start_module = _start_fake_worker  # type: ignore[assignment]
    args = EngineArgs(
        distributed_executor_backend=executor,
        async_scheduling=async_scheduling,
        enforce_eager=True,  # (a CUDA graph would capture the fake forward without its sleep)
        model=str(CONFIG),
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=2048,
        max_num_seqs=max_requests,
        max_num_batched_tokens=max(2048, 16 * max_requests),
        kv_cache_memory_bytes=1 << 30,
    )
    return EngineCore(args.create_engine_config())


def measure(core: EngineCore, num_requests: int, forward_ms: float, steps: int,
            params: SamplingParams) -> dict[str, float]:  # fmt: skip
    """Per-step means over `steps` decode steps with `num_requests` running."""
    for i in range(num_requests):
        core.add_request(
            EngineCoreRequest(f"r{forward_ms}-{i}", list(range(100 + i, 116 + i)), params, [], 0.0)
        )
    while core.scheduler.num_running < num_requests or core.scheduler.num_waiting:
        core.step()  # admit everyone and finish their prompts
    core.step()
    encoder = Encoder()
    before = dict(core.timing.times)
    h2d_bytes, h2d_copies = H2D.bytes, H2D.copies
    output_s = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        outputs = core.step()
        routed = time.perf_counter()
        encoder.encode(outputs)
        output_s += time.perf_counter() - routed
    wall = time.perf_counter() - start
    h2d_bytes, h2d_copies = H2D.bytes - h2d_bytes, H2D.copies - h2d_copies
    core.abort_requests([f"r{forward_ms}-{i}" for i in range(num_requests)])
    while core.has_unfinished_requests():  # the steps still in flight
        core.step()
    split = {s: (core.timing.times.get(s, 0.0) - before.get(s, 0.0)) / steps for s in STAGES}
    split["output"] = output_s / steps
    split["step"] = wall / steps
    # (A worker in a process of its own counts there: main() prints nan for it.)
    split["h2d_kb"] = h2d_bytes / steps / 1024
    split["h2d_copies"] = h2d_copies / steps
    return split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--forward-ms", type=float, nargs="+", default=[0.5, 2.0, 10.0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0: off")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seeded", action="store_true", help="every request has its own seed")
    parser.add_argument("--async-scheduling", nargs="+", choices=["off", "on"],
                        default=["off", "on"])  # fmt: skip
    parser.add_argument("--executor", nargs="+", choices=["uni", "mp"], default=["uni"])
    parser.add_argument("--rounds", type=int, default=1,
                        help="sweeps, one after another; each row is its best round")  # fmt: skip
    args = parser.parse_args()
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            seed=0 if args.seeded else None, max_tokens=100_000,
                            ignore_eos=True)  # fmt: skip
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, temperature "
          f"{args.temperature}, top-k {args.top_k}, top-p {args.top_p}"
          f"{', seeded' if args.seeded else ''}; ms per step")  # fmt: skip
    best: dict[tuple, dict[str, float]] = {}
    for _ in range(args.rounds):  # each round sweeps every setting once
        for executor in args.executor:
            for mode in args.async_scheduling:
                for ms in args.forward_ms:
                    core = make_core(max(args.requests), mode == "on", executor, ms)
                    try:
                        for n in args.requests:
                            s = measure(core, n, ms, args.steps, params)
                            key = (executor, mode, n, ms)
                            if key not in best or s["step"] < best[key]["step"]:
                                best[key] = s
                    finally:
                        core.shutdown()
    header = ("executor", "async", "requests", "forward", "steps/s", "step", "cpu work",
              "vs max", *STAGES, "H2D KiB", "copies")  # fmt: skip
    print("| " + " | ".join(f"{h:>8}" for h in header) + " |")
    print("|" + "|".join("-" * 10 for _ in header) + "|")
    for (executor, mode, n, ms), s in best.items():
        cpu = sum(s[stage] for stage in STAGES if stage not in ("forward", "wait"))
        if executor != "uni":
            s["h2d_kb"] = s["h2d_copies"] = float("nan")
        row = (executor, mode, n, ms, 1 / s["step"], 1e3 * s["step"], 1e3 * cpu,
               s["step"] / max(s["forward"], cpu),
               *(1e3 * s[stage] for stage in STAGES), s["h2d_kb"], s["h2d_copies"])  # fmt: skip
        print("| " + " | ".join(f"{v:>8.2f}" if isinstance(v, float) else f"{v:>8}"
                                for v in row) + " |")  # fmt: skip


def run_worker(argv: list[str]) -> None:
    """`--as-worker MODULE ARGS...`: a worker process (MODULE's main()) with the fake model
    installed."""
    import importlib

    ModelRunner.load_model = _load_sleeping_model  # type: ignore[method-assign]
    module, *sys.argv[1:] = argv
    importlib.import_module(module).main()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--as-worker"]:
        run_worker(sys.argv[2:])
    else:
        main()
